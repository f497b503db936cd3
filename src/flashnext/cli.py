"""`flashnext` command line.

Subcommands:
    demo (the default): build the embedded tiny model, save it in the official layout, reload it, run a packed
        and a padded forward, print shapes and timings, and check the reloaded model computes the same logits.

    flops: forward FLOPs of one packed batch per component (analytic; `--measure` adds torch's count on meta).

    train: `flashnext train --config run.toml [--section.field=value ...]` (see `flashnext.train.trainer`).

    convert: a training checkpoint -> the official Hugging Face layout.

    serve: OpenAI-compatible HTTP server (`flashnext.serve.server`) for a checkpoint or the tiny default.

    generate: one-off generation from a prompt (text or `--ids`), printing the completion.
"""

from __future__ import annotations

import argparse
import errno
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from flashnext.config import TextConfig, load_config, tiny_config
from flashnext.errors import ConfigError, FlashNextError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
        model.save_pretrained(out_dir)
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
        from flashnext.train.trainer import model_text_config

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


def _add_convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a training checkpoint (checkpoints/step_N)")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write the official Hugging Face layout")


def run_convert(args: argparse.Namespace) -> None:
    from flashnext.train.trainer import convert_checkpoint

    out = convert_checkpoint(args.checkpoint, args.out)
    print(f"wrote {out} (official layout; load with flashnext.from_pretrained or transformers)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="checkpoint dir (default: the tiny model, seeded random weights)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="parameter dtype (default float32)")
    p.add_argument("--seed", type=int, default=0, help="weight seed of the tiny default model (default 0)")
    p.add_argument("--max-slots", type=int, default=16, help="concurrent sequences (default 16)")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + generation (default 2048)")
    p.add_argument("--max-batched-tokens", type=int, default=512, help="token budget per step (default 512)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        metavar="K",
        help="draft tokens the model's MTP head proposes per step, verified in one step (default 0: off); "
        "requests may set num_speculative_tokens themselves",
    )


def _build_engine(args: argparse.Namespace):
    from flashnext.serve.engine import Engine
    from flashnext.serve.loading import load_for_serving

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model, tokenizer, name = load_for_serving(args.model, _DTYPES[args.dtype], args.seed)
    k = args.speculative_tokens
    if k and getattr(model, "mtp", None) is None:
        raise ConfigError(
            f"--speculative-tokens {k}: {args.model or 'the model'} has no MTP draft head (no mtp.* weights, or no "
            "mtp_num_hidden_layers in its config.json); serve it without --speculative-tokens"
        )
    try:
        engine = Engine(model, tokenizer, args.max_slots, args.max_model_len, args.max_batched_tokens, k)
    except ConfigError as e:
        raise ConfigError(f"--speculative-tokens {k}: {e}") from None
    return engine, name


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from flashnext.serve.http_limits import DEFAULT_MAX_REQUEST_BYTES

    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model id clients send and /v1/models lists (default: the --model dir's name, or flashnext-tiny)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"larger request bodies get 413 (default {DEFAULT_MAX_REQUEST_BYTES} = 8 MiB)",
    )


def _listen_socket(host: str, port: int):
    """A socket bound to host:port (before anything is announced); `FlashNextError` naming them if it cannot be."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise FlashNextError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT at once
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = " (is another server running there? choose one with --port)" if e.errno == errno.EADDRINUSE else ""
        raise FlashNextError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    return sock


def _serve_app(args: argparse.Namespace):
    """(FastAPI app, served model name, engine) for `flashnext serve`'s arguments."""
    from flashnext.serve.server import build_app

    if args.max_request_bytes < 1:
        raise FlashNextError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    engine, name = _build_engine(args)
    name = args.served_model_name or name
    app = build_app(engine, name, args.api_key, model_dir=args.model, max_request_bytes=args.max_request_bytes)
    return app, name, engine


def run_serve(args: argparse.Namespace) -> None:
    import logging

    import uvicorn

    sock = _listen_socket(args.host, args.port)  # a port in use fails here, before any "serving" line
    try:
        app, name, engine = _serve_app(args)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        port = sock.getsockname()[1]  # the one bound (--port 0: a free one)
        print(f"serving {name!r} on http://{args.host}:{port}/v1 (max_slots={engine.cache.max_slots})", flush=True)
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        sock.close()


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--prompt", default="Hello", help="prompt text (default 'Hello')")
    p.add_argument("--ids", default=None, help="comma-separated prompt token ids instead of --prompt")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message (chat template); stop at <|im_end|>"
    )
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None, help="seed of the sampler")


def run_generate(args: argparse.Namespace) -> None:
    from flashnext.serve.loading import end_of_turn_ids
    from flashnext.serve.sampling import SamplingParams

    engine, _ = _build_engine(args)
    tok = engine.tokenizer
    stop_ids = []
    if args.ids is not None:
        try:
            prompt = [int(x) for x in args.ids.split(",") if x.strip()]
        except ValueError:
            raise FlashNextError(f"--ids must be comma-separated ints, got {args.ids!r}") from None
    elif args.chat:
        if tok is None:
            raise FlashNextError("--chat needs a tokenizer in the checkpoint")
        prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        stop_ids = end_of_turn_ids(tok)  # the assistant's turn ends there, as on the server's chat endpoint
    else:
        prompt = args.prompt
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sample_seed, stop_token_ids=stop_ids,
    )  # fmt: skip
    start = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    seconds = time.perf_counter() - start
    print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
    spec = ""
    if out.num_verify_steps:
        spec = f", drafts accepted {out.num_accepted_tokens}/{out.num_draft_tokens} in {out.num_verify_steps} steps"
    print(
        f"# {len(out.token_ids)} tokens in {seconds:.2f}s, finish_reason={out.finish_reason}{spec}, "
        f"ids={out.token_ids}",
        file=sys.stderr,
    )


_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable]] = {
    "demo": ("build, save, reload and run the embedded tiny model", _add_demo_args, run_demo),
    "flops": ("forward FLOPs of a packed batch, per component", _add_flops_args, run_flops),
    "convert": ("write a training checkpoint in the official Hugging Face layout", _add_convert_args, run_convert),
    "serve": ("OpenAI-compatible HTTP server (default: the tiny model)", _add_serve_args, run_serve),
    "generate": ("generate from one prompt (default: the tiny model)", _add_generate_args, run_generate),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashnext",
        description="Train and serve Qwen3.8-Flash-Next exactly, on packed token streams. "
        "Without a subcommand, runs `demo`.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_args, _) in _COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # its own parser: --section.field=value overrides of the run config
        from flashnext.train.trainer import main as train_main

        return train_main(argv[1:])
    if not argv or (argv[0] not in _COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["demo", *argv]  # demo is the default subcommand, its flags may follow directly
    args = build_parser().parse_args(argv)
    if getattr(args, "seq_len", 1) < 1 or getattr(args, "repeats", 1) < 1:
        print("flashnext: error: --seq-len and --repeats must be >= 1", file=sys.stderr)
        return 2
    try:
        _COMMANDS[args.command][2](args)
    except (FlashNextError, DemoCheckFailed, OSError) as e:
        print(f"flashnext {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
