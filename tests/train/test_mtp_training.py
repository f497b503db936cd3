"""Training the MTP head: its loss (next-next token within each packed sequence), its optimizer group, the
trainer option that adds it, and its refusal on a model without a head."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from flashnext.config import parse_config
from flashnext.errors import ConfigError
from flashnext.model.text import FlashNextForCausalLM
from flashnext.train.config import load_run_config, toml_literal
from flashnext.train.loss import count_mtp_tokens, mtp_loss
from flashnext.train.optim import MTP_DECAY, MTP_NO_DECAY, OptimConfig, build_optimizer
from flashnext.train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_mtp_loss_targets_the_token_after_next_within_each_sequence(small_config):
    model = FlashNextForCausalLM(parse_config({**small_config, "mtp_num_hidden_layers": 1}).text)
    model.init_weights(0)
    ids = torch.randint(0, 64, (13,), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:2] = -100
    labels[10] = -100
    cu = torch.tensor([0, 8, 13], dtype=torch.int32)
    out = model(ids, cu_seqlens=cu, labels=labels, return_mtp=True)
    # By hand: position t of a sequence [s, e) predicts labels[t + 2] while t + 2 < e.
    terms = [
        F.cross_entropy(out.mtp_logits[t].float(), labels[t + 2])
        for s, e in ((0, 8), (8, 13))
        for t in range(s, e - 2)
        if labels[t + 2] != -100
    ]
    assert count_mtp_tokens(labels, cu) == len(terms) == 6 + 2  # labels[:2] are never a t + 2 target; labels[10] is
    want = torch.stack(terms).mean()
    torch.testing.assert_close(out.mtp_loss, want)
    torch.testing.assert_close(mtp_loss(out.mtp_logits, labels, cu, len(terms)), want)
    assert float(mtp_loss(out.mtp_logits, labels, cu, 2 * len(terms))) == pytest.approx(float(want) / 2)


def test_mtp_parameters_get_their_own_optimizer(small_config):
    model = FlashNextForCausalLM(parse_config({**small_config, "mtp_num_hidden_layers": 1}).text)
    optimizers, report = build_optimizer(model, OptimConfig(lr=1e-3, mtp_lr=5e-3))
    mtp = {k: g for k, g in report.items() if k.startswith("mtp.")}
    assert mtp["mtp.layers.0.self_attn.indexer.index_qk_proj.weight"] == "frozen"
    assert mtp["mtp.fc_hidden.weight"] == MTP_DECAY and mtp["mtp.pre_fc_norm_hidden.weight"] == MTP_NO_DECAY
    assert mtp["mtp.layers.0.mlp.experts.gate_up_proj"] == MTP_DECAY
    assert not any(g.startswith("mtp") for k, g in report.items() if not k.startswith("mtp."))
    in_mtp = {id(p) for g in optimizers["mtp"].param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert in_mtp == {id(named[k]) for k, g in mtp.items() if g != "frozen"}
    assert [g["lr"] for g in optimizers["mtp"].param_groups] == [5e-3, 5e-3]


def _write_data(path, n=48, vocab=64):
    """Counting runs (each token one more than the last, mod 60, offset 4): the token after next is a function
    of the next token, which the head reads directly, so its loss falls within a few steps."""
    gen = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for _ in range(n):
            start, length = (int(x) for x in torch.randint(12, 60, (2,), generator=gen))
            ids = [4 + (start + j) % 60 for j in range(length // 2)]
            f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")
    return path


def _trainer(small_config, tmp_path, *extra, mtp_layers=1):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = _write_data(tmp_path / "data.jsonl")
    overrides = [
        f"--out_dir={json.dumps(str(tmp_path / 'run'))}",
        f"--data.path={json.dumps(str(data))}",
        "--model.overrides=" + toml_literal({**small_config, "mtp_num_hidden_layers": mtp_layers}),
        "--data.token_budget=96",
        "--log.progress=false",
        "--log.peak_flops=1e9",
        "--checkpoint.export=false",
        "--optim.lr=3e-3",
        *extra,
    ]
    return Trainer(load_run_config(None, overrides), say=lambda *a, **k: None)


def test_trainer_option_trains_the_head(small_config, tmp_path):
    """With `train.mtp_loss_weight` the head's loss is reported and falls (on a held batch); without it the head is
    untouched (no gradient reaches it, so its AdamW neither steps nor decays it)."""
    off = _trainer(small_config, tmp_path / "off")
    before = {k: v.clone() for k, v in off.model.state_dict().items() if k.startswith("mtp.")}
    metrics = off.train_step(off.next_micro_batches())
    assert "mtp_loss" not in metrics
    assert all(torch.equal(v, off.model.state_dict()[k]) for k, v in before.items())

    on = _trainer(
        small_config, tmp_path / "on", "--train.mtp_loss_weight=1.0", "--optim.mtp_lr=3e-2", "--optim.lr=1e-2"
    )
    held = on.next_micro_batches()[0]

    def held_loss() -> float:
        with torch.no_grad():
            out = on.model(held.input_ids, cu_seqlens=held.cu_seqlens, labels=held.labels, return_mtp=True)
        return float(out.mtp_loss)

    first = held_loss()
    reported = [on.train_step(on.next_micro_batches())["mtp_loss"] for _ in range(8)]
    assert held_loss() < first - 0.3, (first, held_loss(), reported)
    assert all(0 < x < 5 for x in reported)


def test_mtp_weight_without_a_head_is_refused(small_config, tmp_path):
    with pytest.raises(ConfigError, match=r"train\.mtp_loss_weight=0\.5 but the model has no MTP head"):
        _trainer(small_config, tmp_path, "--train.mtp_loss_weight=0.5", mtp_layers=0)


def test_chunked_mtp_loss_equals_the_logits_path(small_config):
    """`return_logits=False` (the trainer's path: the draft head's CE in row chunks, `ops.lm_head`) gives the MTP
    loss and gradients of the materialised draft logits, to fp32 rounding (different summation order)."""
    model = FlashNextForCausalLM(parse_config({**small_config, "mtp_num_hidden_layers": 1}).text)
    model.init_weights(0)
    ids = torch.randint(0, 64, (21,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 12, 21], dtype=torch.int32)
    grads = []
    for return_logits in (True, False):
        model.zero_grad(set_to_none=True)
        out = model(ids, cu_seqlens=cu, labels=ids, return_mtp=True, return_logits=return_logits)
        assert (out.mtp_logits is None) == (not return_logits)
        (out.loss + out.mtp_loss).backward()
        grads.append(
            (out.mtp_loss.detach(), out.mtp_loss_sum.detach(), {k: p.grad for k, p in model.named_parameters()})
        )
    (loss_a, sum_a, ga), (loss_b, sum_b, gb) = grads
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sum_b, sum_a, rtol=1e-5, atol=1e-5)
    assert any(k.startswith("mtp.") and g is not None for k, g in gb.items())
    for k, g in ga.items():
        assert (g is None) == (gb[k] is None), k
        if g is not None:
            torch.testing.assert_close(gb[k], g, rtol=1e-4, atol=1e-6, msg=k)
