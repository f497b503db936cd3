"""`flashnext demo` (build, save, reload and run the embedded tiny model, with self-checks) and `flashnext flops`."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from flashnext.cli.common import DTYPES as _DTYPES
from flashnext.config import TextConfig, load_config, tiny_config
from flashnext.errors import FlashNextError


class DemoCheckFailed(RuntimeError):
    """The demo's self-check (reload parity, packed vs padded) did not hold."""


# ---- inputs --------------------------------------------------------------------------------------
def demo_lengths(seq_len: int) -> list[int]:
    """Three sequence lengths for the demo batch: the longest, a middle one, and a short one."""
    return [seq_len, min(seq_len, seq_len // 2 + 3), min(5, seq_len)]


def make_sequences(lengths: Sequence[int], vocab_size: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]


def pack(seqs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat ids [T], cu_seqlens int32 [N+1], position_ids int64 [T] (restarting at 0 in each sequence)."""
    lengths = torch.tensor([len(s) for s in seqs])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    pos = torch.cat([torch.arange(n) for n in lengths.tolist()])
    return torch.cat(list(seqs)), cu, pos


def pad(seqs: Sequence[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, S] and attention_mask [B, S] (1 = real token)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids, mask


# ---- helpers -------------------------------------------------------------------------------------
def logits_of(out) -> torch.Tensor:
    """The model returns logits or an object with `.logits` (DESIGN.md, Public API)."""
    return out if isinstance(out, torch.Tensor) else out.logits


def timed(fn: Callable[[], object], repeats: int) -> tuple[object, float]:
    """Run `fn` once to warm up, then `repeats` times; return the last result and the median seconds."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ---- demo ----------------------------------------------------------------------------------------
def run_demo(args: argparse.Namespace) -> None:
    import flashnext

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = _DTYPES[args.dtype]
    cfg = load_config(args.config).text if args.config else tiny_config()
    say = print

    t0 = time.perf_counter()
    model = flashnext.build_model(cfg, seed=args.seed, dtype=dtype, device=args.device)
    n_params = sum(p.numel() for p in model.parameters())
    say(
        f"model: {n_params / 1e6:.3f}M params, {cfg.num_hidden_layers} layers {cfg.layer_types}, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {args.dtype} on {args.device} "
        f"(built in {time.perf_counter() - t0:.2f}s)"
    )

    with tempfile.TemporaryDirectory(prefix="flashnext-demo-") as tmp:
        out_dir = Path(args.out) if args.out else Path(tmp)
        t0 = time.perf_counter()
        flashnext.save_pretrained(model, out_dir, overwrite=args.overwrite)
        t_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        reloaded = flashnext.from_pretrained(out_dir, dtype=dtype, device=args.device).eval()
        t_load = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
        say(f"checkpoint: {out_dir} ({size / 1e6:.2f} MB) saved in {t_save:.2f}s, reloaded in {t_load:.2f}s")
        forward_and_check(model, reloaded, cfg, args, say)
        if args.out:
            say(f"checkpoint kept in {out_dir}")


def forward_and_check(model, reloaded, cfg: TextConfig, args: argparse.Namespace, say) -> None:
    """Packed and padded forwards of the same 3 sequences; checks reload parity and packed == padded."""
    dev = args.device
    seqs = make_sequences(demo_lengths(args.seq_len), cfg.vocab_size, args.seed)
    flat, cu, pos = pack(seqs)
    ids, mask = pad(seqs)
    n_tokens = int(flat.numel())

    with torch.inference_mode():
        packed_fn = lambda m: logits_of(m(flat.to(dev), cu_seqlens=cu.to(dev), position_ids=pos.to(dev)))
        packed, t_packed = timed(lambda: packed_fn(model), args.repeats)
        packed_again = packed_fn(reloaded)
        padded_fn = lambda m: logits_of(m(ids.to(dev), attention_mask=mask.to(dev)))
        padded, t_padded = timed(lambda: padded_fn(model), args.repeats)

    lengths = [len(s) for s in seqs]
    say(f"packed batch: {len(seqs)} sequences of lengths {lengths} -> {n_tokens} tokens")
    say(f"  logits {tuple(packed.shape)} {packed.dtype}")
    say(f"  forward {t_packed * 1e3:.1f} ms (median of {args.repeats}), {n_tokens / t_packed:,.0f} tokens/s")
    n_real = int(mask.sum())
    say(f"padded batch: ids {tuple(ids.shape)} with attention_mask, {n_real} real tokens")
    say(f"  logits {tuple(padded.shape)} {padded.dtype}")
    say(f"  forward {t_padded * 1e3:.1f} ms (median of {args.repeats}), {n_real / t_padded:,.0f} tokens/s")

    if packed.shape != (n_tokens, cfg.vocab_size) or padded.shape != (*ids.shape, cfg.vocab_size):
        raise DemoCheckFailed(f"unexpected logits shapes: packed {tuple(packed.shape)}, padded {tuple(padded.shape)}")
    if not torch.isfinite(packed).all():
        raise DemoCheckFailed("packed logits contain NaN or inf")
    # Saving and loading copies every weight: equal bit for bit. The logits of the two instances are not: GEMM
    # blocking (hence summation order) may follow operand alignment and thread count, so they match to rounding.
    weights = reloaded.state_dict()
    changed = [k for k, t in model.state_dict().items() if not torch.equal(t, weights[k])]
    if changed:
        raise DemoCheckFailed(f"reloaded weights differ from the original's: {changed[:5]}")
    tol = 1e-4 if packed.dtype == torch.float32 else 2e-2
    reload_diff = rel_diff(packed_again, packed)
    if reload_diff > tol:
        raise DemoCheckFailed(f"reloaded model's logits differ from the original's: rel. error {reload_diff:.3e}")
    say(f"check: reloaded weights == original weights (bitwise), logits rel. error {reload_diff:.2e} <= {tol:g}")
    unpadded = padded[mask.bool()]
    diff = rel_diff(unpadded, packed)
    if diff > tol:
        raise DemoCheckFailed(f"padded and packed logits differ: rel. error {diff:.3e} > {tol:g}")
    say(f"check: padded logits == packed logits (rel. error {diff:.2e} <= {tol:g})")


# ---- argument parsing ----------------------------------------------------------------------------
def _add_demo_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add(
        "--config",
        metavar="PATH",
        help="config.json (or a checkpoint dir) instead of the embedded tiny default",
    )
    add(
        "--out",
        metavar="DIR",
        help="save the checkpoint here and keep it (default: a temp dir, deleted after)",
    )
    add("--overwrite", action="store_true", help="replace a non-empty --out directory whole")
    add("--seed", type=int, default=0, help="seed for the random weights and the demo tokens (default 0)")
    add("--seq-len", type=int, default=64, help="length of the longest of the 3 demo sequences (default 64)")
    add(
        "--repeats",
        type=int,
        default=3,
        help="timed forwards per batch after a warm-up; median shown (default 3)",
    )
    add("--dtype", choices=sorted(_DTYPES), default="float32", help="parameter dtype (default float32)")
    add("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    add("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")


def _add_flops_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        "--model",
        metavar="PATH",
        help="config.json, a checkpoint dir, or a run config .toml (its [model]) (default: the tiny model)",
    )
    p.add_argument(
        "--seq-lens",
        default="4096,512,1",
        help="comma-separated lengths of the packed sequences (default 4096,512,1)",
    )
    p.add_argument("--measure", action="store_true", help="also count with FlopCounterMode on the meta device")


def run_flops(args: argparse.Namespace) -> None:
    from flashnext.flops import count_flops, measure_flops_on_meta

    if args.config and args.config.endswith(".toml"):
        from flashnext.train.config import load_run_config
        from flashnext.train.setup import model_text_config

        cfg = model_text_config(load_run_config(args.config))
    else:
        cfg = load_config(args.config).text if args.config else tiny_config()
    try:
        lens = [int(x) for x in args.seq_lens.split(",") if x.strip()]
    except ValueError:
        raise FlashNextError(f"--seq-lens must be comma-separated ints, got {args.seq_lens!r}") from None
    if not lens or min(lens) < 0:
        raise FlashNextError(f"--seq-lens needs non-negative lengths, got {args.seq_lens!r}")
    analytic = count_flops(cfg, lens)
    measured = measure_flops_on_meta(cfg, lens) if args.measure else {}
    print(f"forward FLOPs of a packed batch of {len(lens)} sequences, {sum(lens)} tokens: {lens}")
    for name, value in analytic.items():
        extra = f"   meta={measured[name] / 1e9:12.4f} G" if name in measured else ""
        print(f"  {name:14s} {value / 1e9:12.4f} G{extra}")
