"""The RL loop end to end in one process: synchronous steps keep the mismatch KL at fp32 rounding; an RL run
stopped after step k and resumed repeats the uninterrupted run's step k+1 (also with rollouts sampled ahead); the
off-policy pipeline records its staleness and drops (and counts) batches staler than the bound; config errors."""

from __future__ import annotations

import json

import pytest
import torch

from flashnext.errors import ConfigError
from flashnext.rl.config import load_rl_config
from flashnext.rl.loop import RLTrainer
from flashnext.train.config import toml_literal

# A smaller model than the tiny default (same tokenizer): the loop's behaviour, not the model's, is under test.
SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
         "ple_layer_ids": [1], "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
         "hc_lowrank": 8, "ple_embed_dim": 16}  # fmt: skip
TIMING = ("seconds", "per_s", "time", "flops")


def _fields(tmp_path, name="run", **fields) -> dict:
    """The run config fields of a small RL run in `tmp_path / name` (`fields` added or replaced)."""
    overrides = {
        "out_dir": str(tmp_path / name), "model.overrides": SMALL, "train.steps": 3, "optim.total_steps": 3,
        "optim.warmup_steps": 0, "optim.lr": 3e-3, "orchestrator.batch_size": 2, "orchestrator.group_size": 4,
        "orchestrator.eval_tasks": 2, "orchestrator.max_off_policy_steps": 0, "orchestrator.seed": 5,
        "env.max_tokens": 6, "inference.max_slots": 8, "inference.max_model_len": 64, "log.progress": False,
        "rl.temperature": 1.0, "checkpoint.export": False,
    }  # fmt: skip
    overrides.update(fields)
    return overrides


def _args(tmp_path, name="run", **fields) -> list[str]:
    """The same run as `flashnext rl` arguments."""
    return [f"--{k}={toml_literal(v)}" for k, v in _fields(tmp_path, name, **fields).items()]


def _cfg(tmp_path, name="run", **fields):
    return load_rl_config(None, _args(tmp_path, name, **fields))


def _run(cfg):
    torch.set_num_threads(2)
    return RLTrainer(cfg, say=lambda *a: None).run()


def _steps(history):
    return {int(m["step"]): {k: v for k, v in m.items() if not any(t in k for t in TIMING)} for m in history}


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        # Same ops on the same shapes in one process, but the resumed run's engine is a new model instance, whose
        # tensors may sit at other alignments (MKL's blocking can follow them): equal to rounding, not bitwise.
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7, nan_ok=True), k


def test_synchronous_run_metrics_and_resume(tmp_path):
    full = _steps(_run(_cfg(tmp_path, "full")))
    assert sorted(full) == [0, 1, 2, 3]
    assert "reward/eval_mean" in full[0] and "reward/eval_mean" in full[3]
    for step in (1, 2, 3):
        m = full[step]
        assert m["rl/mismatch_kl"] <= 1e-6 and m["rl/masked_fraction"] == 0
        assert m["off_policy/staleness_max"] == 0 and m["off_policy/dropped"] == 0
        assert m["rollout/samples"] == 8 and 0 <= m["reward/mean"] <= 1
        assert m["sync/tensors"] > 0 and m["sync/peak_extra_bytes"] == 0
    lines = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    _run(_cfg(tmp_path, "cut", **{"train.steps": 2}))
    resumed = _steps(_run(_cfg(tmp_path, "cut", **{"checkpoint.resume": "latest"})))
    assert sorted(resumed) == [3]
    _assert_same(resumed[3], full[3])


def test_sampling_temperature_is_the_trainers(tmp_path):
    """At rl.temperature 0.7 the engine samples from, and reports log-probs of, softmax(logits / 0.7); the trainer's
    recomputed log-probs are of the same distribution (not T = 1's), so the mismatch KL stays at fp32 rounding."""
    hist = _steps(
        _run(_cfg(tmp_path, "t07", **{"train.steps": 1, "rl.temperature": 0.7, "orchestrator.eval_tasks": 0}))
    )
    assert hist[1]["rl/mismatch_kl"] <= 1e-6


def test_off_policy_pipeline_resume_and_stale_drop(tmp_path):
    """max_off_policy_steps = 1: step s trains on rollouts of policy s - 2 (step 1: policy 0); the rollouts sampled
    ahead are checkpointed, so a resumed run repeats step 3; resumed with the bound lowered to 0 they are too stale:
    dropped, counted, and the step's rollouts sampled afresh."""
    k1 = {"orchestrator.max_off_policy_steps": 1}
    full = _steps(_run(_cfg(tmp_path, "full", **k1)))
    assert [full[s]["off_policy/staleness_max"] for s in (1, 2, 3)] == [0, 1, 1]
    _run(_cfg(tmp_path, "cut", **k1, **{"train.steps": 2}))
    resumed = _steps(_run(_cfg(tmp_path, "cut", **k1, **{"checkpoint.resume": "latest"})))
    _assert_same(resumed[3], full[3])
    _run(_cfg(tmp_path, "lowered", **k1, **{"train.steps": 2}))
    lowered = _steps(_run(_cfg(tmp_path, "lowered", **{"checkpoint.resume": "latest",
                                                        "orchestrator.max_off_policy_steps": 0})))  # fmt: skip
    kept = full[3]["rollout/kept"]  # the pending batch of step 3 (sampled by policy 1), too stale at bound 0
    assert lowered[3]["off_policy/dropped"] == kept > 0 and lowered[3]["off_policy/dropped_total"] == kept
    assert lowered[3]["off_policy/staleness_max"] == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"data.path": "x.jsonl"}, r"data are its environment's tasks"),
        ({"train.loss": "sft"}, r"trains with loss 'rl'"),
        ({"train.eval_every": 2}, r"orchestrator\.eval_every"),
        ({"orchestrator.group_size": 16, "inference.max_slots": 8}, r"group_size=16 needs as many engine slots"),
        ({"warm_start": "configs/tiny-sft.toml", "model.path": None}, r"warm_start .* set model\.path"),
        ({"orchestrator.batch_size": 0}, r"orchestrator\.batch_size"),
    ],
)
def test_config_errors_name_the_fields(tmp_path, fields, message):
    fields = {k: v for k, v in fields.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        _cfg(tmp_path, **fields)


def test_every_rl_config_field_is_documented():
    from flashnext.rl.config import RLRunConfig

    def walk(model):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                yield from walk(ann)
            else:
                yield f"{model.__name__}.{name}", field.description

    missing = [name for name, doc in walk(RLRunConfig) if not doc]
    assert not missing, f"fields without a docstring: {missing}"
