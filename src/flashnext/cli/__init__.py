"""`flashnext` command line.

Commands (`flashnext` alone prints the help; an unknown one is an error with a did-you-mean), one module each:
    serve, generate (`cli/serving.py`): the OpenAI-compatible server for a checkpoint or the tiny default; one
        prompt (text or `--ids`), printing the completion.
    train, plot (`cli/train.py`): `flashnext train --config run.toml [--section.field=value ...]` (its own parser);
        PNG curves of a run's `metrics.jsonl` (needs the `plot` extra).
    rl (`cli/rl.py`): `flashnext rl --config run.toml [--inference-url URL] [--section.field=value ...]`: rollouts,
        rewards, IPO steps and weight sync (its own parser, like train).
    convert, quantize (`cli/checkpoints.py`): a training checkpoint -> the official Hugging Face layout; a
        checkpoint in FP8 (`--weights fp8`: the official FP8 layout; `--ngram fp8`: only the n-gram tables).
    plan (`cli/plan.py`): the bytes of every part of a model from its config.json (+ safetensors headers), and
        whether it fits this machine; `serve` and `train` check the same plan before loading.
    demo, flops (`cli/demo.py`): build, save, reload and run the tiny model with self-checks; forward FLOPs of a
        packed batch per component.
`python -m flashnext ...` is the same command line (the torchrun entry points: `torchrun ... -m flashnext train`,
`torchrun ... -m flashnext rl --inference-url URL`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from flashnext.cli import _env  # noqa: F401  (first: sets OpenMP's wait policy before torch loads)
from flashnext.cli.checkpoints import _add_convert_args, _add_quantize_args, run_convert, run_quantize
from flashnext.cli.demo import DemoCheckFailed, _add_demo_args, _add_flops_args, run_demo, run_flops
from flashnext.cli.plan import _add_plan_args, run_plan
from flashnext.cli.rl import main as _run_rl
from flashnext.cli.serving import _add_generate_args, _add_serve_args, _serve_app, run_generate, run_serve
from flashnext.cli.train import _add_plot_args, run_plot
from flashnext.cli.train import main as _run_train
from flashnext.errors import FlashNextError

__all__ = ["_serve_app", "build_parser", "main"]


def _no_args(p: argparse.ArgumentParser) -> None:
    """`train` parses its own arguments (`--section.field=value` overrides); argparse only lists it."""


_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable]] = {
    "serve": ("OpenAI-compatible HTTP server (default: the tiny model)", _add_serve_args, run_serve),
    "generate": ("generate from one prompt (default: the tiny model)", _add_generate_args, run_generate),
    "train": ("train on packed sequences from a TOML run config (flashnext train --help)", _no_args, _run_train),
    "rl": ("RL: engine rollouts, environment rewards, IPO steps, weight sync (flashnext rl --help)", _no_args, _run_rl),
    "plot": ("PNG curves (loss, eval loss, lr, tokens/s, ...) of a run's metrics.jsonl", _add_plot_args, run_plot),
    "convert": ("write a training checkpoint in the official Hugging Face layout", _add_convert_args, run_convert),
    "demo": ("build, save, reload and run the embedded tiny model (self-checks)", _add_demo_args, run_demo),
    "flops": ("forward FLOPs of a packed batch, per component", _add_flops_args, run_flops),
    "quantize": ("write an FP8 checkpoint (--weights fp8) or FP8 n-gram tables", _add_quantize_args, run_quantize),
    "plan": ("memory plan of a checkpoint or config.json per part, and whether it fits", _add_plan_args, run_plan),
}
_RAW_ARGV = {"train", "rl"}  # commands handed their arguments unparsed


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flashnext")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashnext",
        description="Train and serve Qwen3.8-Flash-Next exactly, on packed token streams.",
        epilog="Try `flashnext demo` (build, save, reload and run the tiny model) or `flashnext serve`. "
        "`flashnext COMMAND --help` describes a command.",
    )
    parser.add_argument("--version", action="version", version=f"flashnext {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_args, _) in _COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text, add_help=name not in _RAW_ARGV))
    return parser


def _unknown_command(word: str) -> str:
    """The error for `flashnext WORD` when WORD is no command (a did-you-mean when one is close)."""
    import difflib

    close = difflib.get_close_matches(word, _COMMANDS, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    if word.startswith("-") and not close:
        hint = f"; options follow a command, e.g. `flashnext demo {word}`"
    return f"flashnext: error: unknown command {word!r}{hint} (commands: {', '.join(_COMMANDS)})"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 0
    if argv[0] in _RAW_ARGV:
        return _COMMANDS[argv[0]][2](argv[1:])
    if argv[0] not in _COMMANDS and argv[0] not in ("-h", "--help", "--version"):
        print(parser.format_usage().rstrip(), file=sys.stderr)
        print(_unknown_command(argv[0]), file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
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
