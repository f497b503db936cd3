"""flashnext vs the transformers reference: tokens/s of forward and forward+backward, same weights, same run.

Config (issue 2): hidden 256, 8 layers (6 Gated DeltaNet, 2 QSA), 16 experts top-4, PLE on 2 layers, QSA budget
128 / compress 4, vocab 16384 -> ~31M parameters. On CPU with 2 threads (`--threads`), one sequence of each
length, both models in `--dtype` (float32, or bfloat16: both loaded in bf16, the compute of a bf16 training step).

The reference is built with every weight randomised (tests/reference harness) and saved in the official layout;
ours loads that checkpoint through `flashnext.from_pretrained`, so both compute the same function. Their logits
are compared before anything is timed (in bf16: each against the fp32 reference, ours no worse than theirs by more
than 50%). Each figure is the median of `--repeats` runs after `--warmup` untimed runs; ours and the reference
alternate run by run, so other load on the machine falls on both alike (on a shared box it still adds noise: the
load average is printed before and after; run it on an otherwise idle machine).

fwd+bwd is the training step's compute: ours asks for the loss only (`return_logits=False`, the chunked LM head
the trainer uses), the reference computes its loss from full logits as its training does. The limit: model
FLOP/s of our fwd+bwd (3x the analytic forward count of `flashnext.flops`, as the trainer's MFU) against the
measured GEMM peak of the dtype (`train.metrics.measure_peak_flops`, best of 2048^3 matmuls, same threads).

Output, per sequence length n:
    seq=<n> fwd ours=<tok/s> ref=<tok/s> ratio=<x>
    seq=<n> fwd_bwd ours=<tok/s> ref=<tok/s> ratio=<x> gflops=<ours' model GFLOP/s> mfu=<fraction of peak>
and last `fwd_bwd_ratio_<n>=<x> ... mfu_<n>=<y> ...` for every n. Lines starting with `#` are context.

    python benchmarks/model_vs_reference.py                       # seq 1024 and 4096 (minutes: the reference)
    python benchmarks/model_vs_reference.py --dtype bfloat16 --seqs 1024
    python benchmarks/model_vs_reference.py --seqs 256 --repeats 3
    python benchmarks/model_vs_reference.py --dtype bfloat16 --profile 12   # + our fwd+bwd's top ops (shares)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

CONFIG = dict(
    vocab_size=16384,
    hidden_size=256,
    num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["indexed_attention"] + ["linear_attention"] * 3 + ["indexed_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=256,
    hc_count=2,
    hc_lowrank=32,
    ple_layer_ids=[2, 6],
    ple_embed_dim=128,
    ple_conv_kernel_size=4,
    ngram_size=3,
    heads_per_ngram=4,
    ngram_vocab_size_base=20000,
    make_ngram_vocab_size_divisible_by=128,
    split_ngram_parts=8,
    indexer_n_heads=8,
    indexer_kv_heads=1,
    indexer_head_dim=64,
    indexer_budget=128,
    indexer_compress_ratio=4,
    eos_token_id=2,
    max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


def load_harness():
    """The oracle harness of tests/reference (reference construction with every weight randomised)."""
    path = ROOT / "tests" / "reference" / "conftest.py"
    spec = importlib.util.spec_from_file_location("flashnext_reference_harness", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_denormals_arg(parser) -> None:
    """`--keep-denormals`: the benchmarks run with denormals flushed, as `flashnext train` and `serve` do."""
    parser.add_argument(
        "--keep-denormals", action="store_true",
        help="keep IEEE denormal floats (default: flushed to zero, as `flashnext train` and `serve` run)",
    )  # fmt: skip


def set_denormals(args) -> None:
    """The threads' denormal mode as `--keep-denormals` says, after their count is set; printed as context."""
    from flashnext.denormals import flush_denormals

    threads = flush_denormals(not args.keep_denormals)
    print(f"# denormals {'kept' if args.keep_denormals else 'flushed'} on {threads} threads (as train / serve)")


def logits_of(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def median_seconds(fns: dict, repeats: int, warmup: int) -> tuple[dict[str, float], dict[str, object]]:
    """Median wall time of each of `fns` over `repeats` runs, after `warmup` untimed runs of each.

    The runs alternate between the functions, so load from elsewhere on the machine falls on both sides alike.
    Also returns each function's last result.
    """
    results = {}
    for _ in range(warmup):
        for name, fn in fns.items():
            results[name] = fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, results


def forward_fn(model, ids):
    def run():
        with torch.no_grad():
            return logits_of(model(ids))

    return run


def forward_backward_fn(model, ids, loss_only=False):
    def run():
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids, return_logits=False) if loss_only else model(ids, labels=ids)
        out.loss.backward()
        return out.loss.detach()

    return run


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def check_parity(ours, ref, seq: int, vocab: int, tol: float, exact=None) -> float:
    """Logits rel. error of ours vs the reference; in low precision (`exact`: the fp32 reference), ours vs fp32
    must be within 1.5x the reference's own error."""
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    if exact is None:
        err = rel_error(forward_fn(ours, ids)(), forward_fn(ref, ids)())
        if not err <= tol:
            raise SystemExit(f"logits disagree at seq={seq}: rel. error {err:.3e} > {tol:g}; timings meaningless")
        return err
    want = forward_fn(exact, ids)()
    err, ref_err = rel_error(forward_fn(ours, ids)(), want), rel_error(forward_fn(ref, ids)(), want)
    print(f"# low-precision logits rel. error vs fp32: ours={err:.4f} reference={ref_err:.4f}")
    if not err <= 1.5 * ref_err:
        raise SystemExit(f"our low-precision logits are worse than the reference's: {err:.3e} vs {ref_err:.3e}")
    return err


def op_self_times(fn) -> dict[str, float]:
    """One run of `fn` under torch.profiler: every op's self CPU time (us), by op name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.self_cpu_time_total for e in prof.key_averages() if e.self_cpu_time_total > 0}


def profile_shares(fn, seq: int, top: int) -> None:
    """One more run of `fn` under torch.profiler: the `top` ops by self CPU time, as shares of the run's total."""
    times = op_self_times(fn)
    total = sum(times.values())
    ranked = sorted(times.items(), key=lambda kv: kv[1], reverse=True)
    shares = " ".join(f"{key}={t / total:.3f}" for key, t in ranked[:top])
    print(f"# seq={seq} profile ours fwd_bwd ({total / 1e6:.2f} s self CPU) top ops: {shares}", flush=True)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seqs", type=int, nargs="+", default=[1024, 4096], help="sequence lengths (default 1024 4096)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure after a warm-up (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before each figure (default 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    add_denormals_arg(parser)
    parser.add_argument("--check-seq", type=int, default=256, help="sequence length of the parity check (default 256)")
    parser.add_argument("--tol", type=float, default=1e-3, help="max logits rel. error before timing (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens (default 0)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both models' dtype")
    parser.add_argument("--profile", type=int, default=0, help="print the top-N ops of our fwd+bwd (torch.profiler)")
    args = parser.parse_args(argv)
    if args.repeats < 3 or args.warmup < 1:
        parser.error("--repeats must be >= 3 (median of at least 3) and --warmup >= 1")

    import flashnext
    from flashnext.config import TextConfig
    from flashnext.flops import count_flops
    from flashnext.train.metrics import measure_peak_flops

    torch.set_num_threads(args.threads)
    set_denormals(args)
    dtype = getattr(torch, args.dtype)
    print(f"# load average (1/5/15 min) at start: {load_average()}")
    harness = load_harness()
    exact = harness.build_reference(dict(CONFIG), seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="flashnext-bench-") as tmp:
        exact.save_pretrained(tmp)
        ours = flashnext.from_pretrained(tmp, dtype=dtype, device="cpu").eval()
    ref = exact if dtype == torch.float32 else exact.to(dtype)
    exact = None if dtype == torch.float32 else harness.build_reference(dict(CONFIG), seed=args.seed)
    n_ref = sum(p.numel() for p in ref.parameters())
    n_ours = sum(p.numel() for p in ours.parameters())
    print(f"# params: ours={n_ours / 1e6:.2f}M ref={n_ref / 1e6:.2f}M, {args.dtype}, threads={torch.get_num_threads()}")
    err = check_parity(ours, ref, args.check_seq, CONFIG["vocab_size"], args.tol, exact)
    print(f"# parity: logits rel. error {err:.2e} at seq={args.check_seq}")
    del exact
    peak = measure_peak_flops(torch.device("cpu"), dtype, n=2048)
    print(f"# measured GEMM peak ({args.dtype}, 2048^3, {torch.get_num_threads()} threads): {peak / 1e9:.1f} GFLOP/s")
    text_cfg = TextConfig.from_dict(dict(CONFIG))

    gen = torch.Generator().manual_seed(args.seed)
    summary = {}
    for seq in args.seqs:
        ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=gen)
        t, out = median_seconds({"ours": forward_fn(ours, ids), "ref": forward_fn(ref, ids)}, args.repeats, args.warmup)
        print(f"seq={seq} fwd ours={seq / t['ours']:.1f} ref={seq / t['ref']:.1f} ratio={t['ref'] / t['ours']:.2f}")
        print(f"# seq={seq} logits rel. error {rel_error(out['ours'], out['ref']):.2e}", flush=True)
        del out
        fns = {"ours": forward_backward_fn(ours, ids, loss_only=True), "ref": forward_backward_fn(ref, ids)}
        t, _ = median_seconds(fns, args.repeats, args.warmup)
        flops = 3 * count_flops(text_cfg, [seq])["total"] / t["ours"]
        summary[seq] = (t["ref"] / t["ours"], flops / peak)
        print(
            f"seq={seq} fwd_bwd ours={seq / t['ours']:.1f} ref={seq / t['ref']:.1f} ratio={t['ref'] / t['ours']:.2f} "
            f"gflops={flops / 1e9:.1f} mfu={flops / peak:.3f}",
            flush=True,
        )
        if args.profile:
            profile_shares(fns["ours"], seq, args.profile)
    print(f"# load average (1/5/15 min) at end: {load_average()}")
    print(
        " ".join(f"fwd_bwd_ratio_{seq}={r:.2f}" for seq, (r, _) in summary.items())
        + " "
        + " ".join(f"mfu_{seq}={m:.3f}" for seq, (_, m) in summary.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
