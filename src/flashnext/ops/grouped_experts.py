"""The routed experts of a few tokens as one hand-written CPU kernel, for the compiled static steps.

`grouped_experts(x, experts, weights, gate_up, down)` computes what `model.moe.reduced_experts` computes (its plain
twin: each token's k experts' SwiGLU outputs, weighted and summed in routing order; fp32 sums, bf16 weights widened
as they are read) in `grouped_experts.cpp`: the assignments counted into expert order (stable), then, split over
threads by (expert, pair of weight rows), each expert's rows against its weight rows in register blocks (up to 4
rows x 2 weight rows of 8-lane accumulators: each weight vector loaded once for 4 rows, eight independent sums in
flight, their lanes summed by one add tree), the weight rows 16 ahead prefetched; SiLU and the routing weights by
ATen; each token's k outputs summed in routing order. Deterministic: each dot product is one work item's.

Why: inside a compiled decode step inductor writes the routed experts' products (`reduced_experts`) as one
vectorised dot product per output with a single accumulator (~73 cycles per 256-long dot on an AVX2 EPYC), and
its loads do not run ahead of the compute: the batch-16 fp32 step of `benchmarks/vs_llamacpp.py`'s config spent
~4.4 of ~10 ms there, 4x its memory floor. Bench-shaped experts (16 tokens, top-4 of 16, 8 layers' weights
cycling, 2 threads): fp32 886 -> 536 us a layer, bf16 679 -> 367 (`benchmarks/RESULTS.md`, stop 44).

Built on first use by torch's C++ extension loader (the C++ compiler inductor needs anyway; ~30 s once, then cached
under `TORCH_EXTENSIONS_DIR`; GCC on x86-64: GCC's vector extensions and an x86 register constraint). `available()`
builds it (the decode graphs call it before tracing: a build cannot run inside a trace); where the build fails it is
False, said once in the log, and the experts stay `reduced_experts`. `FLASHNEXT_GROUPED_EXPERTS=0` keeps them there.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
_LOCK = threading.Lock()
_BUILT: list[bool] = []  # empty until the first `available()`; then whether the op loaded


def available() -> bool:
    """Whether the kernel is loaded, building it on the first call (not from inside a trace)."""
    if os.environ.get("FLASHNEXT_GROUPED_EXPERTS", "1") == "0":
        return False
    with _LOCK:
        if not _BUILT:
            _BUILT.append(_build())
    return _BUILT[0]


def ready() -> bool:
    """Whether `available()` has loaded the kernel, without building it (read inside a trace: a constant)."""
    return bool(_BUILT) and _BUILT[0]


def _build() -> bool:
    from torch.utils.cpp_extension import load_inline

    try:
        load_inline(
            "flashnext_grouped_experts",
            cpp_sources=SOURCE.read_text(),
            is_python_module=False,
            extra_cflags=["-O3", "-march=native", "-fopenmp"],  # OpenMP: ATen's parallel_for is inline
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # noqa: BLE001 - any build failure leaves the experts as compiled sums
        log.warning("the grouped experts kernel did not build (%s); routed experts stay compiled sums", exc)
        return False
    torch.library.register_fake("flashnext_ext::grouped_experts")(_shape)
    return True


def _shape(x, experts, weights, gate_up, down):
    return x.new_empty(x.shape, dtype=torch.float32)


def grouped_experts(
    x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """x [T, D]; experts int64 [T, k]; weights [T, k]; gate_up [E, 2I, D], down [E, D, I] (contiguous, fp32 or
    bf16) -> [T, D] fp32. CPU; call only when `available()`."""
    return torch.ops.flashnext_ext.grouped_experts(x, experts, weights, gate_up, down)
