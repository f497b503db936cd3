"""Training with frozen n-gram tables (`model.freeze_ngram`), FP8 tables kept in FP8 or upcast, on-disk tables."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

import flashnext
from flashnext import save_pretrained
from flashnext.checkpoint.quantize import quantize_checkpoint
from flashnext.config import parse_config
from flashnext.errors import ConfigError
from flashnext.model.text import FlashNextForCausalLM
from flashnext.ngram.ondisk import OnDiskNGramTable
from flashnext.ngram.stored import StoredNGramTable
from flashnext.train.config import load_run_config, toml_literal
from flashnext.train.optim import FROZEN
from flashnext.train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TABLE = "model.layers.1.ple.ple_embedding.ngram_embedding"


def _data(path, n=24, vocab=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ids = torch.randint(0, vocab, (int(torch.randint(5, 20, (1,), generator=gen)),), generator=gen).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")
    return path


def _trainer(tmp_path, name, *overrides, small_config=None, path=None) -> Trainer:
    data = tmp_path / "d.jsonl"
    if not data.exists():
        _data(data)
    args = [
        f"--out_dir={json.dumps(str(tmp_path / name))}",
        f"--data.path={json.dumps(str(data))}",
        "--data.token_budget=48",
        "--optim.warmup_steps=1",
        "--log.progress=false",
        "--log.peak_flops=1e9",
        "--checkpoint.export=false",
        *overrides,
    ]
    args.append(f"--model.path={json.dumps(str(path))}" if path else "--model.overrides=" + toml_literal(small_config))
    return Trainer(load_run_config(None, args))


def _table(model) -> nn.Module:
    return model.model.layers[1].ple.ple_embedding.ngram_embedding


def _grads(trainer: Trainer) -> tuple[float, dict[str, torch.Tensor]]:
    b = next(iter(trainer.loader))
    loss = trainer._forward_loss(b, float(b.labels.ne(-100).sum()))[0]
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_frozen_table_has_no_grad_no_state_and_leaves_the_rest_unchanged(tmp_path, small_config):
    free = _trainer(tmp_path, "free", "--train.steps=1", small_config=small_config)
    frozen = _trainer(tmp_path, "frozen", "--train.steps=1", "--model.freeze_ngram=true", small_config=small_config)
    table = _table(frozen.model).weight
    assert not table.requires_grad and frozen.param_groups[f"{TABLE}.weight"] == FROZEN
    assert free.param_groups[f"{TABLE}.weight"] == "adamw_decay"

    loss_free, grads_free = _grads(free)
    loss_frozen, grads_frozen = _grads(frozen)
    assert table.grad is None and f"{TABLE}.weight" not in grads_frozen
    assert set(grads_free) - set(grads_frozen) == {f"{TABLE}.weight"}
    # Two model instances (same init seed): equal up to fp32 rounding, not asserted bitwise.
    assert loss_frozen == pytest.approx(loss_free, rel=1e-6)
    for name, g in grads_frozen.items():
        torch.testing.assert_close(g, grads_free[name], rtol=1e-5, atol=1e-7, msg=name)

    before = table.detach().clone()
    for opt in frozen.optimizers.values():
        opt.zero_grad(set_to_none=True)
    frozen.train_step(frozen.next_micro_batches())
    assert torch.equal(table, before)  # no decay, no update
    assert all(table not in opt.state for opt in frozen.optimizers.values())
    assert all(p is not table for opt in frozen.optimizers.values() for g in opt.param_groups for p in g["params"])


@pytest.fixture
def fp8_checkpoint(tmp_path, small_config):
    model = FlashNextForCausalLM(parse_config(dict(small_config, split_ngram_parts=3)).text)
    model.init_weights(0)
    save_pretrained(model.to(torch.bfloat16), tmp_path / "bf16")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "fp8")
    return tmp_path / "fp8"


def test_frozen_fp8_table_stays_fp8_through_training_and_export(tmp_path, fp8_checkpoint):
    tr = _trainer(tmp_path, "run", "--train.steps=2", "--model.freeze_ngram=true", "--checkpoint.export=true",
                  path=fp8_checkpoint)  # fmt: skip
    table = _table(tr.model)
    assert isinstance(table, StoredNGramTable) and table.weight.dtype == torch.float8_e4m3fn
    assert not any("ngram_embedding" in n for n, _ in tr.model.named_parameters())
    history = tr.run()
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(m["loss"])) for m in history)
    with (
        safe_open(fp8_checkpoint / "model.safetensors", "pt") as a,
        safe_open(tmp_path / "run/final/model.safetensors", "pt") as b,
    ):
        keys = [k for k in a.keys() if ".ngram_embedding." in k]
        assert len(keys) == 4  # 3 FP8 shards and the scale, written back unchanged
        for k in keys:
            x, y = a.get_tensor(k), b.get_tensor(k)
            assert x.dtype == y.dtype and torch.equal(
                x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)
            ), k


def test_trainable_table_from_fp8_is_upcast_at_load(tmp_path, fp8_checkpoint):
    tr = _trainer(tmp_path, "run", "--train.steps=1", path=fp8_checkpoint)
    table = _table(tr.model)
    assert isinstance(table, nn.Embedding) and table.weight.dtype == torch.float32 and table.weight.requires_grad
    stored = _table(flashnext.from_pretrained(fp8_checkpoint))  # FP8 in memory
    ids = torch.arange(table.num_embeddings)
    assert torch.equal(table(ids), stored(ids))  # upcast per shard == dequantised after the gather
    tr.run()
    assert not torch.equal(table(ids), stored(ids))  # it trained


def test_ondisk_frozen_table_trains_like_the_stored_one(tmp_path, fp8_checkpoint):
    stored = _trainer(tmp_path, "a", "--train.steps=2", "--model.freeze_ngram=true", path=fp8_checkpoint)
    ondisk = _trainer(tmp_path, "b", "--train.steps=2", "--model.freeze_ngram=true", "--model.ngram_storage=mmap",
                      "--model.ngram_resident_mb=1", path=fp8_checkpoint)  # fmt: skip
    assert isinstance(_table(ondisk.model), OnDiskNGramTable)
    a, b = stored.run(), ondisk.run()
    # Two model instances: the same rows reach the same math; losses equal up to fp32 rounding.
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-6)


def test_frozen_nf4_table_trains(tmp_path, fp8_checkpoint):
    tr = _trainer(tmp_path, "run", "--train.steps=2", "--model.freeze_ngram=true", "--model.ngram_storage=nf4",
                  path=fp8_checkpoint)  # fmt: skip
    assert type(_table(tr.model)).__name__ == "NF4NGramTable"
    assert not any("ngram_embedding" in n for n, _ in tr.model.named_parameters())
    history = tr.run()
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(m["loss"])) for m in history)


def test_frozen_storage_options_are_validated(tmp_path):
    with pytest.raises(ConfigError, match=r"model: .*ngram_storage='mmap' keeps the tables frozen: set freeze_ngram"):
        load_run_config(None, ["--model.ngram_storage=mmap", "--model.path=x"])
    with pytest.raises(ConfigError, match=r"ngram_storage='stored' reads a checkpoint's tables: set model.path"):
        load_run_config(None, ["--model.ngram_storage=stored", "--model.freeze_ngram=true"])
    with pytest.raises(ConfigError, match=r"ngram_storage='nf4' keeps the tables frozen"):
        load_run_config(None, ["--model.ngram_storage=nf4", "--model.path=x"])
