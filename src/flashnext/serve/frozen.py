"""Decode graphs compiled with their weights frozen into them (`DecodeGraph(frozen=True)`, `Engine(freeze_weights=
True)`, `serve --freeze-weights`; see `serve.decode_graph`'s module doc): the inductor settings, the models refused,
the process-wide `freezing` setting held while such a graph is traced."""

from __future__ import annotations

import contextlib
import threading

import torch

from flashnext.errors import ConfigError
from flashnext.model import fused

# Frozen graphs: inductor's C++ GEMM template beside aten's kernels, the faster of the two timed per product at
# compile time (on the bench config the template won every product of the decode steps; the template alone fails
# to compile products it does not cover, e.g. the prefill's batched GDN chunk products).
FROZEN_PATCHES = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
REFUSAL = (
    "this engine's graphs hold the weights frozen (freeze_weights / --freeze-weights): weight updates are refused; "
    "serve without it to take weights from a trainer"
)


def check_freezable(model, device: torch.device) -> bool:
    """True, or why graphs with frozen weights cannot serve this model (ConfigError)."""
    if device.type != "cpu":
        raise ConfigError(f"frozen weights are for the CPU decode graph (inductor); this model is on {device}")
    quantized = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.dtype in quantized:
            raise ConfigError(
                f"frozen weights would fold the quantized tensor {name} ({t.dtype}) into a float constant of the "
                "graph (its memory saving lost): serve a quantized model without --freeze-weights"
            )
    return True


_FREEZING = threading.Lock()
_FREEZING_HELD = [0, False]  # traces holding inductor's `freezing` on; its value before the first of them


@contextlib.contextmanager
def freezing():
    """inductor's `freezing` held on (and products traced as `fused.frozen_products`) while a frozen graph's step
    may be traced: dynamo reads the process-wide setting to make the parameters graph constants. Counted, so two
    threads' overlapping traces never turn it off under each other."""
    import torch._inductor.config as inductor_config

    with _FREEZING:
        if _FREEZING_HELD[0] == 0:
            _FREEZING_HELD[1] = inductor_config.freezing
            inductor_config.freezing = True
        _FREEZING_HELD[0] += 1
    try:
        with fused.frozen_products():
            yield
    finally:
        with _FREEZING:
            _FREEZING_HELD[0] -= 1
            if _FREEZING_HELD[0] == 0:
                inductor_config.freezing = _FREEZING_HELD[1]
