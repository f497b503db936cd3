"""flashnext vs the transformers reference: tokens/s of forward and forward+backward, same weights, same run.

Config (issue 2): hidden 256, 8 layers (6 Gated DeltaNet, 2 QSA), 16 experts top-4, PLE on 2 layers, QSA budget
128 / compress 4, vocab 16384 -> ~31M parameters. fp32 on CPU with 2 threads, one sequence of each length.

The reference is built with every weight randomised (tests/reference harness) and saved in the official layout;
ours loads that checkpoint through `flashnext.from_pretrained`, so both compute the same function. Their logits
are compared before anything is timed. Each figure is the median of `--repeats` runs after `--warmup` untimed
runs; ours and the reference alternate run by run, so other load on the machine falls on both alike (on a
shared 2-core box it still adds noise: run it on an otherwise idle machine).

Output, per sequence length n:
    seq=<n> fwd ours=<tok/s> ref=<tok/s> ratio=<x>
    seq=<n> fwd_bwd ours=<tok/s> ref=<tok/s> ratio=<x>
and last `fwd_bwd_ratio_<n>=<x> ...` for every n (default: `fwd_bwd_ratio_1024=<x> fwd_bwd_ratio_4096=<y>`).
Lines starting with `#` are context.

    python benchmarks/model_vs_reference.py                       # seq 1024 and 4096 (minutes: the reference)
    python benchmarks/model_vs_reference.py --seqs 256 --repeats 3
"""

from __future__ import annotations

import argparse
import importlib.util
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


def forward_backward_fn(model, ids):
    def run():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    return run


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def check_parity(ours, ref, seq: int, vocab: int, tol: float) -> float:
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    err = rel_error(forward_fn(ours, ids)(), forward_fn(ref, ids)())
    if not err <= tol:
        raise SystemExit(f"logits disagree at seq={seq}: rel. error {err:.3e} > {tol:g}; timings would be meaningless")
    return err


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seqs", type=int, nargs="+", default=[1024, 4096], help="sequence lengths (default 1024 4096)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure after a warm-up (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before each figure (default 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--check-seq", type=int, default=256, help="sequence length of the parity check (default 256)")
    parser.add_argument("--tol", type=float, default=1e-3, help="max logits rel. error before timing (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens (default 0)")
    args = parser.parse_args(argv)
    if args.repeats < 3 or args.warmup < 1:
        parser.error("--repeats must be >= 3 (median of at least 3) and --warmup >= 1")

    import flashnext

    torch.set_num_threads(args.threads)
    harness = load_harness()
    ref = harness.build_reference(dict(CONFIG), seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="flashnext-bench-") as tmp:
        ref.save_pretrained(tmp)
        ours = flashnext.from_pretrained(tmp, dtype=torch.float32, device="cpu").eval()
    n_ref = sum(p.numel() for p in ref.parameters())
    n_ours = sum(p.numel() for p in ours.parameters())
    print(f"# params: ours={n_ours / 1e6:.2f}M ref={n_ref / 1e6:.2f}M, fp32, threads={torch.get_num_threads()}")
    err = check_parity(ours, ref, args.check_seq, CONFIG["vocab_size"], args.tol)
    print(f"# parity: logits rel. error {err:.2e} at seq={args.check_seq}")

    gen = torch.Generator().manual_seed(args.seed)
    fwd_bwd_ratios = {}
    for seq in args.seqs:
        ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=gen)
        t, out = median_seconds({"ours": forward_fn(ours, ids), "ref": forward_fn(ref, ids)}, args.repeats, args.warmup)
        print(f"seq={seq} fwd ours={seq / t['ours']:.1f} ref={seq / t['ref']:.1f} ratio={t['ref'] / t['ours']:.2f}")
        print(f"# seq={seq} logits rel. error {rel_error(out['ours'], out['ref']):.2e}", flush=True)
        del out
        fns = {"ours": forward_backward_fn(ours, ids), "ref": forward_backward_fn(ref, ids)}
        t, _ = median_seconds(fns, args.repeats, args.warmup)
        fwd_bwd_ratios[seq] = t["ref"] / t["ours"]
        print(
            f"seq={seq} fwd_bwd ours={seq / t['ours']:.1f} ref={seq / t['ref']:.1f} ratio={t['ref'] / t['ours']:.2f}",
            flush=True,
        )
    print(" ".join(f"fwd_bwd_ratio_{seq}={r:.2f}" for seq, r in fwd_bwd_ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
