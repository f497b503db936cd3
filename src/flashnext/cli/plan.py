"""`flashnext plan CHECKPOINT_OR_CONFIG`: the memory plan of a model before loading it (`flashnext.plan`), and the
check `serve` / `generate` run before they load anything (`check_serving_plan`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flashnext.errors import ConfigError
from flashnext.plan import SCHEMES, PlanOptions

_DTYPE_NAMES = {"bfloat16": "bf16", "float32": "fp32"}


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    from flashnext.ngram import DEFAULT_RESIDENT_MB, STORAGES

    p.add_argument("model", metavar="CHECKPOINT_OR_CONFIG", help="a checkpoint directory or a config.json file")
    p.add_argument(
        "--weights", choices=SCHEMES, default=None,
        help="weight scheme: fp32/bf16 everywhere; fp8 routed experts (the official layout; the rest in --dtype); "
        "int8 trunk and experts; int4 experts over an int8 trunk (default: as the checkpoint stores them)",
    )  # fmt: skip
    p.add_argument("--experts", choices=SCHEMES, default=None, help="routed experts' scheme (overrides --weights)")
    p.add_argument("--trunk", choices=("fp32", "bf16", "int8"), default=None, help="dense trunk's scheme")
    p.add_argument(
        "--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
        help="compute dtype (norms, embeddings, state); auto: bfloat16 when config.json says so, else float32",
    )  # fmt: skip
    p.add_argument("--ngram-storage", choices=STORAGES, default="auto", help="as `flashnext serve --ngram-storage`")
    p.add_argument("--ngram-resident-mb", type=float, default=DEFAULT_RESIDENT_MB, metavar="MB")
    p.add_argument("--max-slots", type=int, default=16, help="concurrent sequences (default 16; 0: weights only)")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + generation (default 2048)")
    p.add_argument("--max-batched-tokens", type=int, default=512, help="token budget per step (default 512)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument(
        "--budget", action="append", default=[], metavar="SIZE",
        help="also judge the plan against a machine of SIZE (141GB, 128GiB; repeatable) instead of only this one",
    )  # fmt: skip


def read_raw_config(model: str | None) -> tuple[dict, Path | None]:
    """(the config.json object, the checkpoint directory or None) of a `plan`/`serve` model argument."""
    from flashnext.config import tiny_config_dict

    if model is None:
        return tiny_config_dict(), None
    path = Path(model)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"config file not found: {str(file)!r}")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file}: cannot read a JSON config ({e})") from None
    return raw, (path if path.is_dir() else None)


def build_plan(model: str | None, opts: PlanOptions):
    """(plan, title) of `model` (a checkpoint dir, a config.json, or None: the tiny default) under `opts`."""
    from flashnext.config import parse_config
    from flashnext.plan import make_plan, stored_as

    raw, directory = read_raw_config(model)
    try:
        cfg = parse_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{model}: {e}") from None
    stored = stored_as(directory, raw)
    plan = make_plan(cfg, opts, stored)
    source = "safetensors headers" if stored.headers_read else "config.json only"
    slots = f", {opts.max_slots} slots x {opts.max_model_len} tokens" if opts.max_slots else ""
    title = f"memory plan of {model or 'the tiny default'} ({source}; {opts.dtype} compute on {opts.device}{slots}):"
    return plan, title


def run_plan(args: argparse.Namespace) -> None:
    from flashnext.plan import budget_capacity, format_plan, machine_capacity, parse_bytes, shortfall

    raw, _ = read_raw_config(args.model)
    opts = PlanOptions(
        dtype=_dtype(args.dtype, raw), weights=args.weights, experts=args.experts, trunk=args.trunk,
        ngram_storage=args.ngram_storage, ngram_resident_mb=args.ngram_resident_mb, max_slots=args.max_slots,
        max_model_len=args.max_model_len, max_batched_tokens=args.max_batched_tokens, device=args.device,
    )  # fmt: skip
    plan, title = build_plan(args.model, opts)
    print(format_plan(plan, machine_capacity(args.device), title))
    for text in args.budget:
        why = shortfall(plan, budget_capacity(parse_bytes(text)))
        print(f"  budget {text}: " + ("fits" if why is None else f"does NOT fit ({why})"))


def _dtype(name: str, raw: dict) -> str:
    """`--dtype` as a plan dtype ("bf16"/"fp32"); auto: what config.json names (as `serve --dtype auto`)."""
    if name != "auto":
        return _DTYPE_NAMES[name]
    named = raw.get("dtype", raw.get("torch_dtype")) if isinstance(raw, dict) else None
    return "bf16" if named == "bfloat16" else "fp32"


def check_serving_plan(args: argparse.Namespace, dtype, device) -> None:
    """Print `serve`'s plan on stderr; raise a one-line `ConfigError` when it cannot fit this machine (unless
    `--ignore-memory-plan`)."""
    from flashnext.plan import format_plan, machine_capacity, shortfall
    from flashnext.serve.loading import check_model_dir

    if args.model is not None:
        check_model_dir(Path(args.model))  # a training checkpoint or run directory: say what it is first
    opts = PlanOptions(
        dtype=_DTYPE_NAMES[str(dtype).removeprefix("torch.")], ngram_storage=args.ngram_storage,
        ngram_resident_mb=args.ngram_resident_mb, max_slots=args.max_slots, max_model_len=args.max_model_len,
        max_batched_tokens=args.max_batched_tokens, device=str(device),
        # `--weights bf16` (the default) keeps the checkpoint's own storage; int8 / int4 quantize in memory
        weights=None if args.weights == "bf16" else args.weights, experts=args.experts, trunk=args.trunk,
    )  # fmt: skip
    plan, title = build_plan(args.model, opts)
    cap = machine_capacity(str(device))
    print(format_plan(plan, cap, title), file=sys.stderr, flush=True)
    why = shortfall(plan, cap)
    if why is not None and not args.ignore_memory_plan:
        raise ConfigError(
            f"{args.model or 'the model'} cannot fit: {why} (see the plan above; lower --max-slots / "
            "--max-model-len, choose --ngram-storage mmap, or pass --ignore-memory-plan to load anyway)"
        )
