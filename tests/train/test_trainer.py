"""The training loop: run config and CLI, exact resume, micro-batch split invariance, RL steps, atomic checkpoints."""

import json
import os
import re

import pytest
import torch

import flashnext
from flashnext.checkpoint import training
from flashnext.cli.train import main
from flashnext.errors import CheckpointError, ConfigError
from flashnext.train.config import load_run_config, parse_override, toml_literal
from flashnext.train.loss import count_label_tokens, sft_loss
from flashnext.train.packing import collate
from flashnext.train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _write_pretokenized(path, n=40, vocab=64, seed=0, rl=False):
    gen = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            length = int(torch.randint(3, 20, (1,), generator=gen))
            ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
            labels = [-100] * (length // 3) + ids[length // 3 :]
            rec = {"input_ids": ids, "labels": labels}
            if rl:
                rec["advantages"] = float(torch.randn((), generator=gen))
                rec["inference_logprobs"] = [0.0] * length
            f.write(json.dumps(rec) + "\n")
    return path


def _overrides(small_config, tmp_path, data, *extra):
    return [
        f"--out_dir={json.dumps(str(tmp_path / 'run'))}",
        f"--data.path={json.dumps(str(data))}",
        "--model.overrides=" + toml_literal(small_config),
        "--data.token_budget=48",
        "--data.micro_batches=2",
        "--optim.warmup_steps=1",
        "--log.progress=false",
        "--log.peak_flops=1e9",
        "--checkpoint.export=false",
        *extra,
    ]


def _config(small_config, tmp_path, data, *extra):
    return load_run_config(None, _overrides(small_config, tmp_path, data, *extra))


# ---- run config ------------------------------------------------------------------------------------------
def test_run_config_file_overrides_and_errors(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('out_dir = "x"\n[train]\nsteps = 7\n[optim]\nlr = 1e-3\n')
    cfg = load_run_config(toml, ["--train.steps=9", "--optim.betas=[0.8, 0.9]", "--model.path=some/dir"])
    assert (cfg.out_dir, cfg.train.steps, cfg.optim.lr, cfg.optim.betas) == ("x", 9, 1e-3, (0.8, 0.9))
    assert cfg.model.path == "some/dir"  # not TOML: kept as a string
    assert cfg.optim.total_steps == 9  # the schedule spans the run unless set
    assert load_run_config(None, ["--optim.total_steps=50"]).optim.total_steps == 50
    assert parse_override("--a.b=3") == (["a", "b"], 3)

    with pytest.raises(ConfigError, match=r"train\.stepz: unknown key"):
        load_run_config(None, ["--train.stepz=3"])
    with pytest.raises(ConfigError, match=r"train\.steps: .*greater than or equal to 1.*-1"):
        load_run_config(None, ["--train.steps=-1"])
    with pytest.raises(ConfigError, match=r"optim\.lr.*'fast'"):
        load_run_config(None, ["--optim.lr=fast"])
    with pytest.raises(ConfigError, match="must look like"):
        load_run_config(None, ["--=3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_run_config(bad)


@pytest.mark.parametrize(
    "toml, overrides, expected",
    [
        # the shipped config's warmup (file) against a step count from the command line: both fields, both origins
        ("[optim]\nwarmup_steps = 5\n", ["--train.steps=4"],
         r"optim\.warmup_steps=5 exceeds train\.steps=4, the length of the lr schedule.*"
         r"\(optim\.warmup_steps from RUN; train\.steps from --train\.steps=4 on the command line\)"),
        ("[train]\nsteps = 4\n", ["--optim.warmup_steps=5"],
         r"optim\.warmup_steps from --optim\.warmup_steps=5 on the command line; train\.steps from RUN\)"),
        ("", ["--optim.warmup_steps=101"], r"train\.steps the default\)"),
        ("[optim]\ntotal_steps = 3\nwarmup_steps = 4\n", [],
         r"optim: warmup_steps=4 exceeds total_steps=3 \(optim\.warmup_steps from RUN; optim\.total_steps from RUN\)"),
        ("", ["--train.steps=0"], r"train\.steps: Input should be greater than or equal to 1 \(got 0, from "
         r"--train\.steps=0 on the command line\)"),
        ("[train]\nsteps = 0\n", [], r"train\.steps: .*greater than or equal to 1 \(got 0, from RUN\)"),
        ("[train]\nstepz = 3\n", [], r"train\.stepz: unknown key \(from RUN\)"),
        ("", ['--train={steps = "x"}'], r"train\.steps: .*\(got 'x', from --train=\{steps = \"x\"\} on the command"),
        ("[train]\neval_every = 5\n", [], r"train\.eval_every=5 needs a held-out split.*train\.eval_every from RUN; "
         r"data\.eval_fraction the default"),
        ("", ["--data.eval_fraction=0.1", "--data.eval_path=x.jsonl"], r"data: give one held-out split"),
        ("", ["--train.overwrite=true", "--checkpoint.resume=latest"], r"train\.overwrite=true deletes the"),
    ],
    ids=["warmup-cli-steps", "warmup-cli-warmup", "warmup-default", "total", "steps0-cli", "steps0-file", "unknown",
         "section-override", "eval-every", "two-evals", "overwrite-resume"],
)  # fmt: skip
def test_config_errors_name_the_fields_and_where_their_values_came_from(tmp_path, toml, overrides, expected):
    run = tmp_path / "run.toml"
    run.write_text(toml)
    with pytest.raises(ConfigError, match=expected.replace("RUN", re.escape(str(run)))):
        load_run_config(run, overrides)


def test_every_config_field_is_documented():
    from flashnext.train.config import RunConfig

    def walk(model):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                yield from walk(ann)
            elif model is not RunConfig:
                yield f"{model.__name__}.{name}", field.description

    missing = [name for name, doc in walk(RunConfig) if not doc]
    assert not missing, f"fields without a docstring: {missing}"


def test_cli_errors_name_the_bad_argument(capsys):
    assert main(["--train.nope=1"]) == 1
    assert "train.nope: unknown key" in capsys.readouterr().err
    assert main(["positional"]) == 1
    assert "unknown argument 'positional'" in capsys.readouterr().err


# ---- training ----------------------------------------------------------------------------------------------
def test_resume_repeats_the_uninterrupted_run_bit_for_bit(small_config, tmp_path):
    data = _write_pretokenized(tmp_path / "d.jsonl")
    full = Trainer(
        _config(
            small_config, tmp_path / "a", data, "--train.steps=5", "--checkpoint.every=2", "--checkpoint.keep_last=3"
        )
    )
    history = full.run()
    assert [m["step"] for m in history] == [1, 2, 3, 4, 5]
    ckpts = training.list_checkpoints(tmp_path / "a" / "run" / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000002", "step_00000004", "step_00000005"]

    resumed = Trainer(
        _config(
            small_config, tmp_path / "b", data, "--train.steps=5", f"--checkpoint.resume={json.dumps(str(ckpts[0]))}"
        )
    )
    rest = resumed.run()
    assert [m["step"] for m in rest] == [3, 4, 5]
    assert [m["loss"] for m in rest] == [m["loss"] for m in history[2:]]
    assert [m["grad_norm"] for m in rest] == [m["grad_norm"] for m in history[2:]]
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # the metrics file of the resumed run holds its own steps
    lines = [json.loads(x) for x in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [3, 4, 5]


def test_loss_falls_and_export_loads(small_config, tmp_path):
    data = _write_pretokenized(tmp_path / "d.jsonl", n=12)
    cfg = _config(small_config, tmp_path, data, "--train.steps=12", "--checkpoint.export=true", "--optim.lr=3e-3")
    tr = Trainer(cfg)
    history = tr.run()
    assert history[-1]["loss"] < history[0]["loss"] - 0.1
    # mfu is the achieved rate over the configured peak (1 GFLOP/s here, not a measured one: a fast box exceeds it)
    for m in history:
        assert m["tokens"] > 0 and m["mfu"] > 0 and m["mfu"] == pytest.approx(m["model_flops_per_s"] / 1e9)
    reloaded = flashnext.from_pretrained(tmp_path / "run" / "final")
    ids = torch.arange(10) % 64
    # Two model instances: GEMM blocking (hence fp32 summation order) may differ with operand alignment and
    # thread count, so the logits agree to rounding; the weights themselves are compared bitwise elsewhere.
    torch.testing.assert_close(reloaded(ids).logits, tr.model.eval()(ids).logits, rtol=1e-5, atol=1e-6)


def test_micro_batch_split_gives_the_same_loss_and_gradients(small_config, tmp_path):
    data = _write_pretokenized(tmp_path / "d.jsonl", n=6)
    tr = Trainer(_config(small_config, tmp_path, data, "--train.steps=1"))
    examples = tr.loader.examples
    model = tr.model

    def loss_and_grads(batches):
        n = sum(count_label_tokens(b.labels, b.cu_seqlens) for b in batches)
        model.zero_grad()
        total = 0.0
        for b in batches:
            out = model(b.input_ids, cu_seqlens=b.cu_seqlens, position_ids=b.position_ids)
            loss = sft_loss(out.logits, b.labels, b.cu_seqlens, n)
            loss.backward()
            total += float(loss)
        return total, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    one, g_one = loss_and_grads([collate(examples)])
    three, g_three = loss_and_grads([collate(examples[:1]), collate(examples[1:4]), collate(examples[4:])])
    assert one == pytest.approx(three, rel=1e-6)
    assert g_one.keys() == g_three.keys()
    for k in g_one:
        torch.testing.assert_close(g_three[k], g_one[k], rtol=1e-4, atol=1e-6, msg=k)


def test_router_replay_of_the_routers_own_choice_equals_normal_routing(small_config, tmp_path):
    data = _write_pretokenized(tmp_path / "d.jsonl", n=4)
    model = Trainer(_config(small_config, tmp_path, data, "--train.steps=1")).model
    b = collate(Trainer(_config(small_config, tmp_path, data, "--train.steps=1")).loader.examples)
    free = model(b.input_ids, cu_seqlens=b.cu_seqlens)
    free.logits.square().mean().backward()
    g_free = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    replayed = model(b.input_ids, cu_seqlens=b.cu_seqlens, routed_experts=free.routed_experts)
    replayed.logits.square().mean().backward()
    assert torch.equal(replayed.routed_experts, free.routed_experts)
    torch.testing.assert_close(replayed.logits, free.logits, rtol=0, atol=0)
    routers = [k for k in g_free if k.endswith("mlp.gate.weight")]
    assert routers and all(g_free[k].abs().sum() > 0 for k in routers)
    for k, g in g_free.items():
        torch.testing.assert_close(model.get_parameter(k).grad, g, rtol=1e-6, atol=1e-9, msg=k)


def test_rl_step_with_the_models_own_logprobs_has_no_mismatch(small_config, tmp_path):
    """RL records carrying the model's own log-probs and routing: ratio 1, nothing masked, replay applied."""
    sft_data = _write_pretokenized(tmp_path / "d.jsonl", n=6)
    model = Trainer(_config(small_config, tmp_path, sft_data, "--train.steps=1")).model
    rl_data = tmp_path / "rl.jsonl"
    with open(sft_data) as f, open(rl_data, "w") as out, torch.no_grad():
        for i, line in enumerate(f):
            rec = json.loads(line)
            ids = torch.tensor(rec["input_ids"])
            o = model(ids)
            lp = torch.log_softmax(o.logits.float(), -1)[:-1].gather(-1, ids[1:, None])[:, 0]
            rec["inference_logprobs"] = [0.0] + lp.tolist()  # entry t: log p(ids[t] | ids[:t])
            rec["advantages"] = 1.0 if i % 2 else -0.5
            rec["routed_experts"] = o.routed_experts.tolist()
            out.write(json.dumps(rec) + "\n")
    tr = Trainer(_config(small_config, tmp_path, rl_data, "--train.steps=1", "--train.loss=rl"))
    (m,) = tr.run()
    assert m["rl/mismatch_kl"] < 1e-6 and m["rl/logprob_abs_error"] < 1e-5
    assert m["rl/masked_fraction"] == 0.0 and m["rl/entropy"] > 0
    with pytest.raises(ConfigError, match="needs RL records"):
        Trainer(_config(small_config, tmp_path, sft_data, "--train.loss=rl"))


# ---- checkpoints ------------------------------------------------------------------------------------------
def test_checkpoints_are_atomic_and_pruned(tmp_path):
    root = tmp_path / "ck"
    (root / ".tmp-step_00000009-1").mkdir(parents=True)  # a save cut short by a crash
    (root / "step_00000007").mkdir()  # no meta.json: incomplete, never listed
    for step in (1, 2, 3):
        training.save(root, step, {"w": torch.full((2,), float(step))}, {"step": step}, keep_last=2)
    assert [p.name for p in training.list_checkpoints(root)] == ["step_00000002", "step_00000003"]
    assert not list(root.glob(".tmp-*"))
    assert torch.equal(training.load(training.latest(root))["w"], torch.full((2,), 3.0))
    with pytest.raises(CheckpointError, match="not a complete training checkpoint"):
        training.load(root / "step_00000007")


def test_cli_trains_resumes_and_converts(small_config, tmp_path, capsys):
    data = _write_pretokenized(tmp_path / "d.jsonl", n=8)
    args = _overrides(small_config, tmp_path, data, "--train.steps=2")
    assert main(args) == 0
    assert main([*args[:-1], "--train.steps=3", "--resume"]) == 0
    err = capsys.readouterr()
    assert "resumed from" in err.out and "step_00000002" in err.out
    ckpt = training.latest(tmp_path / "run" / "checkpoints")
    assert ckpt.name == "step_00000003"

    from flashnext.cli import main as cli_main

    out = tmp_path / "hf"
    assert cli_main(["convert", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    model = flashnext.from_pretrained(out)
    state = training.load(ckpt)["model"]
    for k, v in model.state_dict().items():
        if k in state:
            assert torch.equal(v, state[k]), k
    assert os.path.exists(out / "config.json")
    # a second convert into the now non-empty --out is refused (one line naming it and --overwrite); with
    # --overwrite the directory is replaced whole: a file that was not part of the conversion is gone
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    capsys.readouterr()
    assert cli_main(["convert", "--checkpoint", str(ckpt), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err and "--overwrite" in err, err
    assert cli_main(["convert", "--checkpoint", str(ckpt), "--out", str(out), "--overwrite"]) == 0
    assert not (out / "model-00001-of-00002.safetensors").exists() and (out / "model.safetensors").is_file()


def test_shipped_run_config_is_valid():
    from pathlib import Path

    from flashnext.train.setup import model_text_config

    cfg = load_run_config(Path(__file__).parents[2] / "configs" / "tiny-sft.toml")
    assert cfg.data.path is None and cfg.model.config == "tiny" and cfg.optim.total_steps == cfg.train.steps
    assert model_text_config(cfg).vocab_size == 512
