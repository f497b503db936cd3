"""`flashnext rl` (also `python -m flashnext rl` / `python -m flashnext.rl`, and under torchrun
`torchrun ... -m flashnext rl --inference-url URL`): arguments, the SFT warm start, exit status."""

from __future__ import annotations

import json
from pathlib import Path

from flashnext.errors import ConfigError

USAGE = """usage: flashnext rl [--config RUN.toml] [--env NAME] [--inference-url URL] [--resume [latest|DIR] |
                    --overwrite] [--eval-only CHECKPOINT [--eval-tasks N]] [--debug] [--print-config]
                    [--SECTION.FIELD=V ...]

RL: rollouts from an inference engine, environment rewards, IPO steps, weight sync (default: the tiny model on
the `reverse` task, everything in this process).
  --config PATH        TOML run config (sections model, optim, rl, train, checkpoint, log, orchestrator, env,
                       inference; see flashnext/rl/config.py)
  --env NAME           the environment (env.name): reverse, arith, color, module:Class, or verifiers:NAME (an
                       installed verifiers taskset; pip install 'flashnext[verifiers]')
  --inference-url URL  sample from a running `flashnext serve --admin-key KEY` (key in $FLASHNEXT_ADMIN_KEY) and
                       send it the new weights (what a torchrun trainer uses)
  --resume [WHERE]     continue from the newest readable checkpoint in <out_dir>/checkpoints, or from WHERE
  --overwrite          start over in an out_dir holding a previous run
  --eval-only CKPT     no training: score the held-out split with CKPT's weights (a checkpoints/step_N or an
                       exported final/), one completion per task at orchestrator.eval_temperature; prints mean ±
                       stderr, writes <out_dir>/eval/<CKPT path>.json (pass the run's --config)
  --eval-tasks N       held-out tasks of --eval-only (default 512: stderr <= 0.022 for rewards in [0, 1])
  --debug              print an error's traceback (an environment's own, for its errors) before its line
  --print-config       print the resolved config as JSON and exit
  --section.field=V    override one field (e.g. --orchestrator.group_size=8)
Ctrl-C (SIGINT) or SIGTERM finishes the step in flight, saves a checkpoint and exits 130/143 (twice: at once); a
failure inside the loop saves the last completed step first. Both say where; --resume continues.
"""


_ALIASES = {"--inference-url": ("inference.url", "a URL"), "--env": ("env.name", "an environment name")}


def parse_args(argv: list[str]):
    """`flashnext rl` arguments -> (RL run config, print_config): `train`'s parser with the RL config class and
    the `--inference-url` / `--env` shorthands."""
    from flashnext.cli.train import parse_args as parse_train_args
    from flashnext.rl.config import RLRunConfig

    return parse_train_args(argv, cls=RLRunConfig, aliases=_ALIASES, usage=USAGE)


def warm_start(cfg, say=print) -> None:
    """Train the `warm_start` SFT run when `model.path` does not exist yet (its `final/` must be `model.path`)."""
    if cfg.warm_start is None or Path(cfg.model.path).exists():
        return
    from flashnext.train.config import load_run_config
    from flashnext.train.trainer import Trainer

    sft = load_run_config(cfg.warm_start)
    final = Path(sft.out_dir) / "final"
    if final.resolve() != Path(cfg.model.path).resolve():
        raise ConfigError(
            f"warm_start={cfg.warm_start!r} writes {final}, but model.path={cfg.model.path!r}: make them the same"
        )
    say(f"warm start: {cfg.model.path} does not exist; training {cfg.warm_start} first")
    resume = "latest" if (Path(sft.out_dir) / "checkpoints").exists() else None
    Trainer(sft.model_copy(update={"checkpoint": sft.checkpoint.model_copy(update={"resume": resume})})).run()


def own_flags(argv: list[str]) -> tuple[dict, list[str]]:
    """Take `--debug`, `--eval-only CHECKPOINT` and `--eval-tasks N` out of `argv`: (their values, the rest)."""
    from flashnext.cli.train import flag_value
    from flashnext.rl.evaluate import DEFAULT_TASKS

    flags: dict = {"debug": False, "eval_only": None, "eval_tasks": DEFAULT_TASKS}
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--debug":
            flags["debug"] = True
        elif arg == "--eval-only" or arg.startswith("--eval-only="):
            flags["eval_only"], i = flag_value(argv, i, "a checkpoint directory")
        elif arg == "--eval-tasks" or arg.startswith("--eval-tasks="):
            value, i = flag_value(argv, i, "a number of tasks")
            if not value.isdigit():
                raise ConfigError(f"--eval-tasks needs a whole number of tasks, got {value!r}")
            flags["eval_tasks"] = int(value)
        else:
            rest.append(arg)
        i += 1
    if flags["eval_only"] is None and any(a.startswith("--eval-tasks") for a in argv):
        raise ConfigError("--eval-tasks goes with --eval-only CHECKPOINT")
    return flags, rest


def eval_only(argv: list[str], checkpoint: str, tasks: int) -> int:
    """`flashnext rl --eval-only CHECKPOINT`: the held-out reward, no training (`rl/evaluate.py`)."""
    import os
    import sys

    from flashnext.rl.evaluate import evaluate_checkpoint

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("--eval-only runs in one process (an engine of its own), not under torchrun")
    cfg, print_config = parse_args(argv)
    if print_config:
        print(json.dumps(cfg.model_dump(mode="json"), indent=2))
        return 0
    evaluate_checkpoint(cfg, checkpoint, tasks, warn=lambda line: print(f"flashnext rl: {line}", file=sys.stderr))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `flashnext rl`. Every flashnext error ends the run with one line on stderr and status 1
    (`--debug`: its traceback first); SIGINT/SIGTERM save a checkpoint and exit 130/143."""
    import sys

    from flashnext.cli.train import run_reporting_errors, run_training_command

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        flags, argv = own_flags(argv)
    except ConfigError as e:
        from flashnext.train.failure import report_fatal

        report_fatal(str(e), "flashnext rl")
        return 1
    if flags["eval_only"] is not None:
        return run_reporting_errors(lambda: eval_only(argv, flags["eval_only"], flags["eval_tasks"]), "flashnext rl",
                                    flags["debug"])  # fmt: skip

    def rl(cfg, ctx) -> None:
        from flashnext.rl.loop import rl_trainer

        if cfg.warm_start is not None and not Path(cfg.model.path).exists():
            if ctx.distributed:
                raise ConfigError(f"model.path={cfg.model.path!r} does not exist: run the warm-start SFT "
                                  f"({cfg.warm_start}) first, in one process")  # fmt: skip
            warm_start(cfg)
        rl_trainer(cfg, ctx).run()

    return run_training_command(argv, parse_args, rl, "flashnext rl", flags["debug"])
