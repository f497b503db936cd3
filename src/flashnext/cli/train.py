"""`flashnext train` (also `python -m flashnext train`, and under torchrun `torchrun ... -m flashnext train`):
arguments, start-up checks, exit status; and `flashnext plot RUN_DIR`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from flashnext.errors import ConfigError, FlashNextError

if TYPE_CHECKING:
    from flashnext.train.config import RunConfig

USAGE = """usage: flashnext train [--config RUN.toml] [--resume [latest|DIR] | --overwrite] [--print-config]
                       [--SECTION.FIELD=V ...]

Train on packed sequences as the run config says (defaults: the embedded tiny model on the bundled corpus).
  --config PATH        TOML run config (sections model, data, optim, rl, train, parallel, checkpoint, log)
  --resume [WHERE]     continue from the newest readable checkpoint in <out_dir>/checkpoints, or from WHERE
  --overwrite          start over in an out_dir holding a previous run: delete its metrics.jsonl, checkpoints/,
                       final/ and plots/ first (train.overwrite=true); without it such an out_dir is refused
  --print-config       print the resolved config as JSON and exit
  --section.field=V    override one field; V is a TOML literal or a bare string (e.g. --train.steps=20)
Ctrl-C (SIGINT) or SIGTERM finishes the step in flight, saves a checkpoint and exits 130/143 (twice: at once); a
failure inside the loop saves the last completed step first. Both say where; --resume continues.
"""


def flag_value(argv: list[str], i: int, what: str) -> tuple[str, int]:
    """The value of the flag at `argv[i]` (`--flag=V` or `--flag V`) and the index of its last argument;
    `ConfigError` naming the flag and `what` it needs when the value is missing."""
    flag, eq, value = argv[i].partition("=")
    if eq:
        return value, i
    if i + 1 < len(argv):
        return argv[i + 1], i + 1
    raise ConfigError(f"{flag} needs {what}")


def parse_args(
    argv: list[str],
    cls: type[RunConfig] | None = None,
    aliases: dict[str, tuple[str, str]] | None = None,
    usage: str = USAGE,
) -> tuple[RunConfig, bool]:
    """`flashnext train` arguments -> (run config, print_config). Another command (`flashnext rl`) passes its config
    class `cls`, its `usage` text and `aliases`: flag -> (the field it sets, what value it takes), e.g.
    `--env NAME` for `--env.name="NAME"`."""
    from flashnext.train.config import RunConfig, load_run_config

    config_path, overrides, print_config = None, [], False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(usage)
            raise SystemExit(0)
        if (alias := (aliases or {}).get(arg.partition("=")[0])) is not None:
            field, what = alias
            value, i = flag_value(argv, i, what)
            overrides.append(f"--{field}={json.dumps(value)}")
        elif arg == "--config" or arg.startswith("--config="):
            config_path, i = flag_value(argv, i, "a path")
        elif arg == "--resume" or arg.startswith("--resume="):
            where = "latest"
            if "=" in arg:
                where = arg.split("=", 1)[1]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                where, i = argv[i + 1], i + 1
            overrides.append(f"--checkpoint.resume={json.dumps(where)}")
        elif arg == "--overwrite":
            overrides.append("--train.overwrite=true")
        elif arg == "--print-config":
            print_config = True
        elif arg.startswith("--") and "=" in arg:
            overrides.append(arg)
        else:
            raise ConfigError(
                f"unknown argument {arg!r}: overrides take the form --section.field=value (--help lists the options)"
            )
        i += 1
    return load_run_config(config_path, overrides, cls or RunConfig), print_config


def main(argv: list[str] | None = None) -> int:
    """Entry point of `flashnext train` and `python -m flashnext train` (also under torchrun)."""

    def train(cfg, ctx) -> None:
        from flashnext.train.trainer import Trainer

        Trainer(cfg, ctx).run()

    return run_training_command(argv, parse_args, train, "flashnext train")


def run_training_command(argv: list[str] | None, parse, run, prog: str, debug: bool = False) -> int:
    """The body every training command shares (`flashnext train`, `flashnext rl`): parse the arguments, print the
    config or check the run directory, start the process group, `run(cfg, ctx)`, end the group. `prog` names the
    command in error lines; `debug` prints an error's traceback before its line.

    Every flashnext error (config, data, checkpoint, environment), a missing file and a non-finite loss end the run
    with one line on stderr (once per job under torchrun: `failure.report_fatal`) and exit status 1, no traceback;
    the line carries the error's notes (where the checkpoint saved after the failure is: `train/interrupt.py`). A
    run stopped by SIGINT/SIGTERM says where its checkpoint is and exits 130/143.
    """
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        cfg, print_config = parse(argv)
        if print_config:
            print(json.dumps(cfg.model_dump(mode="json"), indent=2))
            return 0
        from flashnext.parallel.dist import destroy_distributed, init_distributed  # the trainer's imports: only here
        from flashnext.train import run_dir
        from flashnext.train.setup import resolve_device

        # before any process-group work, so every rank refuses alike and nobody waits in a rendezvous
        run_dir.check_out_dir(cfg.out_dir, cfg.checkpoint.resume, cfg.train.overwrite)
        # under torchrun: one process group over every rank (gloo on CPU, NCCL on CUDA); else a single process
        device = None if cfg.train.device == "auto" else resolve_device(cfg.train.device)
        ctx = init_distributed(device=device)
        run(cfg, ctx)
        destroy_distributed(ctx)  # not on an error: its barrier would pair with a peer's unrelated collective
        return 0

    return run_reporting_errors(body, prog, debug)


def run_reporting_errors(body, prog: str, debug: bool = False) -> int:
    """`body()`'s exit status; a flashnext error, a missing file or a non-finite loss is one line (its notes
    appended) and status 1, an interrupted run its line and 128 + the signal, a bare Ctrl-C (outside a run's steps,
    or the second one) one line and 130. `debug`: the traceback first."""
    import traceback

    from flashnext.train.failure import _rank, report_fatal
    from flashnext.train.interrupt import RunInterrupted

    try:
        return body()
    except RunInterrupted as e:
        if _rank() == 0:
            print(f"{prog}: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        if _rank() == 0:
            print(f"{prog}: interrupted (no checkpoint saved)", file=sys.stderr, flush=True)
        return 130
    except (FlashNextError, OSError, FloatingPointError) as e:
        if debug:
            traceback.print_exc()
        report_fatal("; ".join([str(e), *getattr(e, "__notes__", ())]), prog)
        return 1


def _add_plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run's out_dir (holding metrics.jsonl)")
    p.add_argument("--out", metavar="DIR", help="where the PNGs go (default: RUN_DIR/plots)")


def run_plot(args: argparse.Namespace) -> None:
    from flashnext.train.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(f"wrote {path}")
