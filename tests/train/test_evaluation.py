"""The held-out loss: a fixed split by seed, the training loss's definition over the split, no gradient, logged."""

import json
import os
import subprocess
import sys

import pytest
import torch
from test_trainer import _config, _write_pretokenized
from test_trainer import _overrides as _config_args

from flashnext.errors import ConfigError, InputError
from flashnext.train.data import Example
from flashnext.train.loss import count_label_tokens, sft_loss
from flashnext.train.packing import collate
from flashnext.train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _examples(n):
    return [Example([i, i + 1, i + 2], [-100, i + 1, i + 2]) for i in range(n)]


def test_split_is_fixed_by_the_seed_disjoint_and_complete():
    from flashnext.train.evaluation import split_eval

    examples = _examples(50)
    train, held = split_eval(examples, 0.1, seed=3)
    assert len(held) == 5 and len(train) == 45
    assert sorted(ex.input_ids[0] for ex in train + held) == list(range(50))
    assert split_eval(examples, 0.1, seed=3) == (train, held)  # the same examples every time (and on resume)
    assert split_eval(examples, 0.1, seed=4)[1] != held
    assert len(split_eval(examples, 0.001, seed=0)[1]) == 1  # at least one
    with pytest.raises(InputError, match="eval_fraction=0.5 holds out 1 of 1 examples, leaving none"):
        split_eval(_examples(1), 0.5, seed=0)


@pytest.fixture
def trainer(small_config, tmp_path):
    data = _write_pretokenized(tmp_path / "d.jsonl", n=30)
    return Trainer(_config(small_config, tmp_path, data, "--train.steps=5", "--data.eval_fraction=0.2"))


def test_eval_loss_is_the_training_loss_over_the_held_out_split(trainer):
    held = [ex for b in trainer.evaluator.batches for ex in _unpack(b)]
    assert len(held) == 6 and not set(map(_key, held)) & set(map(_key, trainer.loader.examples))
    params = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    rng = torch.get_rng_state()
    got = trainer.eval_loss()
    # the same definition, one example at a time (another packing: a tolerance, not bitwise)
    n = sum(count_label_tokens(torch.tensor(ex.labels), torch.tensor([0, len(ex)])) for ex in held)
    want = 0.0
    with torch.no_grad():
        for ex in held:
            b = collate([ex])
            out = trainer.model(b.input_ids, cu_seqlens=b.cu_seqlens, position_ids=b.position_ids)
            want += float(sft_loss(out.logits, b.labels, b.cu_seqlens, float(n)))
    assert got == pytest.approx(want, rel=1e-5)
    # no gradient, no parameter change, the training RNG untouched, the model back in training mode
    assert all(p.grad is None for p in trainer.model.parameters())
    assert all(torch.equal(p, params[k]) for k, p in trainer.model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng) and trainer.model.training
    assert trainer.eval_loss() == got  # same batches, same kernels: bitwise


def _unpack(b):
    cu = b.cu_seqlens.tolist()
    return [Example(b.input_ids[s:e].tolist(), b.labels[s:e].tolist()) for s, e in zip(cu, cu[1:], strict=False)]


def _key(ex):
    return tuple(ex.input_ids)


def test_eval_loss_is_logged_at_eval_steps_and_the_last(small_config, tmp_path):
    data = _write_pretokenized(tmp_path / "d.jsonl", n=30)
    extra = ["--train.steps=5", "--data.eval_fraction=0.2", "--train.eval_every=2", "--log.every=3"]
    history = Trainer(_config(small_config, tmp_path, data, *extra)).run()
    assert [m["step"] for m in history if "eval_loss" in m] == [2, 4, 5]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], "eval_loss" in m) for m in lines] == [(2, True), (3, False), (4, True), (5, True)]


def test_eval_path_holds_out_a_separate_file(small_config, tmp_path):
    data = _write_pretokenized(tmp_path / "d.jsonl", n=10)
    held = _write_pretokenized(tmp_path / "eval.jsonl", n=4, seed=1)
    tr = Trainer(_config(small_config, tmp_path, data, "--train.steps=1", f"--data.eval_path={json.dumps(str(held))}"))
    assert len(tr.loader.examples) == 10 and tr.evaluator.num_examples == 4
    (m,) = tr.run()
    assert m["eval_loss"] > 0
    with pytest.raises(ConfigError, match="train.loss='rl' needs RL records"):  # its loss is the run's loss
        rl = _write_pretokenized(tmp_path / "rl.jsonl", n=10, rl=True)
        Trainer(_config(small_config, tmp_path, rl, "--train.loss=rl", f"--data.eval_path={json.dumps(str(held))}"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2]}\n{"input_ids": [1, 99]}\n')
    with pytest.raises(InputError, match=r"bad\.jsonl:2: 'input_ids' has id 99"):  # checked like the training file
        Trainer(_config(small_config, tmp_path, data, f"--data.eval_path={json.dumps(str(bad))}"))


def test_torchrun_eval_loss_equals_one_process(small_config, tmp_path):
    """Under a process group the held-out batches are dealt round-robin (an odd count here: one rank runs a
    discarded extra forward so FSDP's collectives pair up); the loss is the one-process loss."""
    from test_failure import _free_port

    data = _write_pretokenized(tmp_path / "d.jsonl", n=40)
    extra = ["--train.steps=2", "--data.eval_fraction=0.25", "--train.activation_checkpointing=true"]
    one = Trainer(_config(small_config, tmp_path / "one", data, *extra, "--data.micro_batches=4"))
    assert len(one.evaluator.batches) % 2 == 1
    expected = one.run()
    args = [a for a in _config_args(small_config, tmp_path / "two", data, *extra) if "micro_batches" not in a]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "flashnext", "train", *args, "--data.micro_batches=2"]  # fmt: skip
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = [json.loads(x) for x in (tmp_path / "two" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert two[-1]["eval_loss"] == pytest.approx(expected[-1]["eval_loss"], rel=1e-5)  # sums in another order
