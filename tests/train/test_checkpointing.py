"""Activation checkpointing changes memory, not math: same loss and gradients, same parameter names."""

import torch

from flashnext.config import TextConfig
from flashnext.model.text import FlashNextForCausalLM
from flashnext.train.checkpointing import apply_activation_checkpointing


def _model(cfg):
    torch.manual_seed(0)
    m = FlashNextForCausalLM(TextConfig.from_dict(cfg))
    m.init_weights(seed=0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or "conv" in name:
                p.normal_(0, 0.2)
    return m


def test_checkpointed_layers_give_identical_loss_and_grads(small_config):
    plain, ckpt = _model(small_config), _model(small_config)
    assert apply_activation_checkpointing(ckpt) == len(ckpt.model.layers)
    assert apply_activation_checkpointing(ckpt) == 0  # idempotent
    assert list(plain.state_dict()) == list(ckpt.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 64, (40,), generator=g)
    cu = torch.tensor([0, 7, 30, 40], dtype=torch.int32)
    losses = []
    for m in (plain, ckpt):
        out = m(ids, cu_seqlens=cu, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
    # Two model instances (same init): not bitwise by construction (GEMM blocking may follow operand alignment).
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-7)
    grads_plain = dict(plain.named_parameters())
    for name, p in ckpt.named_parameters():
        q = grads_plain[name]
        if q.grad is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
    with torch.no_grad():  # no checkpoint region without grad
        torch.testing.assert_close(ckpt(ids, cu_seqlens=cu).logits, plain(ids, cu_seqlens=cu).logits)
