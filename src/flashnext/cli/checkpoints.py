"""`flashnext convert` (a training checkpoint -> the official layout) and `flashnext quantize` (FP8 n-gram tables,
the official FP8 checkpoint with `--weights fp8`, or int8 / int4 codes with `--weights int8|int4`)."""

from __future__ import annotations

import argparse
import time


def _add_convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a training checkpoint (checkpoints/step_N)")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write the official Hugging Face layout")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory whole")
    p.add_argument(
        "--layer-type-spelling", choices=["full_attention", "indexed_attention"], default=None,
        help="how config.json's layer_types names the QSA layers (default: as the run's model was loaded; "
        "llama.cpp's converter reads only full_attention)",
    )  # fmt: skip


def run_convert(args: argparse.Namespace) -> None:
    from flashnext.checkpoint.convert import convert_checkpoint

    out = convert_checkpoint(
        args.checkpoint, args.out, overwrite=args.overwrite, layer_type_spelling=args.layer_type_spelling
    )
    print(f"wrote {out} (official layout; load with flashnext.from_pretrained or transformers)")


def _add_quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ngram", choices=["fp8"], help="n-gram table format: fp8 (F8_E4M3 + scale); the rest as is")
    p.add_argument("--weights", choices=["fp8", "int8", "int4"], help="fp8: the official FP8 checkpoint (routed "
                   "experts in 128x128 block FP8, n-gram tables FP8, the rest as is, quantization_config in "
                   "config.json); int8: trunk linears and routed experts int8 per output channel; int4: routed "
                   "experts int4 per group over an int8 trunk (codes + scales on disk, loaded without a float "
                   "copy)")  # fmt: skip
    p.add_argument("--trunk", choices=["bf16", "int8"], default=None, help="override --weights for the dense trunk")
    p.add_argument("--experts", choices=["bf16", "int8", "int4"], default=None,
                   help="override --weights for the routed experts")  # fmt: skip
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64, metavar="G",
                   help="int4 experts: input features per scale/zero group, 32, 64 or 128 (default 64)")  # fmt: skip
    p.add_argument("src", metavar="IN", help="checkpoint directory with BF16/F16/F32 weights")
    p.add_argument("dst", metavar="OUT", help="output directory (other tensors and files copied unchanged)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT directory whole")


def run_quantize(args: argparse.Namespace) -> None:
    from flashnext.checkpoint.quantize import quantize_checkpoint
    from flashnext.errors import InputError

    start = time.perf_counter()
    if args.weights and args.ngram:
        raise InputError("quantize: give --weights or --ngram, not both (--weights fp8 puts the n-gram tables in FP8)")
    if (args.trunk or args.experts) and (args.weights == "fp8" or args.ngram):
        raise InputError("quantize: --trunk/--experts go with --weights int8|int4 (fp8 and --ngram set their parts)")
    if args.weights in ("int8", "int4") or (args.weights is None and (args.trunk or args.experts)):
        _run_quantize_int(args, start)
        return
    if args.weights:
        _run_quantize_weights(args, start)
        return
    if not args.ngram:
        raise InputError("quantize: say what to quantise: --weights fp8 or --ngram fp8 (or --weights int8|int4, "
                         "--trunk / --experts)")  # fmt: skip
    scales = quantize_checkpoint(args.src, args.dst, ngram=args.ngram, overwrite=args.overwrite)
    for table, scale in scales.items():
        print(f"{table}: F8_E4M3, weight_scale {scale:.6g}")
    print(f"wrote {args.dst} in {time.perf_counter() - start:.1f}s ({len(scales)} table(s) in FP8)")


def _run_quantize_weights(args: argparse.Namespace, start: float) -> None:
    from flashnext.checkpoint.quantize_weights import quantize_weights

    done = quantize_weights(args.src, args.dst, weights=args.weights, overwrite=args.overwrite)
    for table, scale in done["tables"].items():
        print(f"{table}: F8_E4M3, weight_scale {scale:.6g}")
    print(f"wrote {args.dst} in {time.perf_counter() - start:.1f}s ({done['experts']} expert matrices in 128x128 "
          f"block FP8, {len(done['tables'])} table(s) in FP8)")


def _run_quantize_int(args: argparse.Namespace, start: float) -> None:
    from flashnext.quant.apply import QuantScheme
    from flashnext.quant.int_quantize import quantize_int

    scheme = QuantScheme.from_flags(args.weights or "bf16", args.trunk, args.experts, args.group_size)
    done = quantize_int(args.src, args.dst, scheme, overwrite=args.overwrite)
    parts = ", ".join(f"{len(v)} {k} module(s)" for k, v in done["modules"].items())
    print(f"wrote {args.dst} in {time.perf_counter() - start:.1f}s ({scheme}: {done['matrices']} matrices, {parts})")
