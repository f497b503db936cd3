"""Per-layer torch.compile vs eager on training steps over changing packings, and the recompiles they cause.

Two copies of one model (same weights), each with its own AdamW, run the same training steps (forward, loss,
backward, AdamW step) over micro-batches packing `1, 2, 4, 1, 3, 7, 1, 16` sequences of random lengths (so the
totals change every step too). The compiled copy goes through `flashnext.compile.compile_model`. Steps
alternate eager / compiled so load from elsewhere on the machine falls on both alike. fp32, 2 threads.

Recompiles are dynamo's frame conversions (`torch._dynamo.utils.counters["frames"]["total"]`: every cache miss is
one) counted after the warm-up, which is the first single-sequence step and the first multi-sequence step: the
first compiles everything, the second turns the graph segments between opaque ops dynamic in T. Every later step
(one sequence, many, other totals) must reuse those graphs (T turns dynamic unbacked, so inductor's size-dependent
codegen choices install no guard; see `flashnext.compile`). Exit status 1 when the count is not 0.

Output:
    step=<i> seqs=<n> tokens=<T> eager=<s> compiled=<s> loss_diff=<|eager - compiled|>
    compiled/eager=<steady-state time ratio, compile excluded> speedup=<eager/compiled>
    recompiles_after_warmup=<n>
Lines starting with `#` are context.

    python benchmarks/compile_packed.py                  # the issue's ~31M config, 2 rounds (a few minutes)
    python benchmarks/compile_packed.py --config small   # the tests' small config (fast)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
COUNTS = [1, 2, 4, 1, 3, 7, 1, 16]


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_config(name: str) -> dict:
    """The issue's ~31M benchmark config (benchmarks/model_vs_reference.py) or the tests' small one."""
    if name == "bench":
        return dict(load_module(ROOT / "benchmarks" / "model_vs_reference.py", "flashnext_bench_mvr").CONFIG)
    return dict(load_module(ROOT / "tests" / "conftest.py", "flashnext_tests_conftest").SMALL_TEXT_CONFIG)


def make_batches(counts: list[int], min_len: int, max_len: int, vocab: int, seed: int):
    """One packed (ids [T], cu_seqlens int32 [N+1]) per count, with random sequence lengths and tokens."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for n in counts:
        lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen)
        cu = torch.zeros(n + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        ids = torch.randint(0, vocab, (int(cu[-1]),), generator=gen)
        batches.append((ids, cu))
    return batches


def train_step(model, opt, ids, cu, compiled: bool) -> tuple[float, float]:
    """Forward, loss, backward, AdamW step; returns (seconds, loss)."""
    from flashnext.compile import mark_dynamic_batch

    ids, cu, labels = ids.clone(), cu.clone(), ids.clone()  # fresh tensors, as a data loader hands out
    if compiled:
        mark_dynamic_batch(ids, cu, None, labels)
    start = time.perf_counter()
    loss = model(ids, cu_seqlens=cu, labels=labels, return_logits=False).loss  # the trainer's chunked head
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, float(loss.detach())


def frames_converted() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=["bench", "small"], default="bench", help="model (default: ~31M bench)")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the 8 packings (default 2)")
    parser.add_argument("--min-len", type=int, default=16, help="shortest sequence (default 16)")
    parser.add_argument("--max-len", type=int, default=128, help="longest sequence (default 128)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and batches (default 0)")
    args = parser.parse_args(argv)

    from flashnext.compile import compile_model
    from flashnext.config import TextConfig
    from flashnext.model.text import FlashNextForCausalLM

    torch.set_num_threads(args.threads)
    cfg = TextConfig.from_dict(model_config(args.config))
    eager = FlashNextForCausalLM(cfg)
    eager.init_weights(seed=args.seed)
    compiled = FlashNextForCausalLM(cfg)
    compiled.load_state_dict(eager.state_dict())
    n_compiled = compile_model(compiled, backend=args.backend)
    opts = {m: torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (eager, compiled)}
    n_params = sum(p.numel() for p in eager.parameters())
    print(f"# config={args.config} params={n_params / 1e6:.2f}M fp32 threads={torch.get_num_threads()}")
    print(f"# compiled modules={n_compiled} backend={args.backend}; packed counts per round: {COUNTS}")

    batches = make_batches(COUNTS * args.rounds, args.min_len, args.max_len, cfg.vocab_size, args.seed)
    first_single, first_multi = COUNTS.index(1), next(i for i, n in enumerate(COUNTS) if n > 1)
    warmup_end = max(first_single, first_multi)
    frames_after_warmup = None
    steady = {"eager": 0.0, "compiled": 0.0}
    for i, (ids, cu) in enumerate(batches):
        t_eager, loss_eager = train_step(eager, opts[eager], ids, cu, compiled=False)
        t_comp, loss_comp = train_step(compiled, opts[compiled], ids, cu, compiled=True)
        if i > warmup_end:
            steady["eager"] += t_eager
            steady["compiled"] += t_comp
        tag = " (warm-up: compiles)" if i <= warmup_end else ""
        print(
            f"step={i} seqs={cu.numel() - 1} tokens={ids.numel()} eager={t_eager:.3f}s compiled={t_comp:.3f}s "
            f"loss_diff={abs(loss_eager - loss_comp):.2e}{tag}",
            flush=True,
        )
        if i == warmup_end:
            frames_after_warmup = frames_converted()
    recompiles = frames_converted() - frames_after_warmup
    ratio = steady["compiled"] / steady["eager"]
    print(
        f"# steady-state steps {warmup_end + 1}..{len(batches) - 1}: eager={steady['eager']:.2f}s "
        f"compiled={steady['compiled']:.2f}s"
    )
    print(f"compiled/eager={ratio:.3f} speedup={1 / ratio:.3f}")
    print(f"recompiles_after_warmup={recompiles}")
    return 0 if recompiles == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
