"""`flashnext convert` (a training checkpoint -> the official layout) and `flashnext quantize` (FP8 n-gram tables)."""

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
    p.add_argument("--ngram", choices=["fp8"], required=True, help="n-gram table format: fp8 (F8_E4M3 + scale)")
    p.add_argument("src", metavar="IN", help="checkpoint directory with BF16/F16/F32 n-gram tables")
    p.add_argument("dst", metavar="OUT", help="output directory (other tensors and files copied unchanged)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT directory whole")


def run_quantize(args: argparse.Namespace) -> None:
    from flashnext.checkpoint.quantize import quantize_checkpoint

    start = time.perf_counter()
    scales = quantize_checkpoint(args.src, args.dst, ngram=args.ngram, overwrite=args.overwrite)
    for table, scale in scales.items():
        print(f"{table}: F8_E4M3, weight_scale {scale:.6g}")
    print(f"wrote {args.dst} in {time.perf_counter() - start:.1f}s ({len(scales)} table(s) in FP8)")
