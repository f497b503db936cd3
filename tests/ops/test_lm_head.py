"""The chunked LM head + loss (`ops.lm_head`) == logits materialised (`ops.lm_head_ref`), forward and backward,
and the model's `return_logits=False` path == its logits path (loss, log-probs, gradients)."""

import pytest
import torch

from flashnext.ops import lm_head, lm_head_ref


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", 700)  # 7 rows per chunk at V=100: several chunks, a short last one


def _case(dtype, seed=0, T=37, D=16, V=100):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.3).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    return hidden, weight, targets


# fp32: the sums run in another order (per chunk); bf16: each chunk's weight gradient is rounded to bf16 on its own
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cross_entropy_matches_materialised_logits(small_chunks, dtype):
    hidden, weight, targets = _case(dtype)
    targets[[3, 10, 36]] = -100
    got = lm_head.linear_cross_entropy(hidden, weight, targets)
    want = lm_head_ref.linear_cross_entropy_ref(hidden, weight, targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # same fp32 softmax per row, summed in chunks
    g_got = torch.autograd.grad(got * 0.37, (hidden, weight))
    g_want = torch.autograd.grad(want * 0.37, (hidden, weight))
    for a, b in zip(g_got, g_want, strict=True):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("slab_chunks", [1, 2, 3])
def test_cross_entropy_bf16_weight_gradient_slabs(small_chunks, monkeypatch, slab_chunks):
    """bf16: chunk gradients gathered `slab_chunks` chunks at a time (37 rows of 7-row chunks: full slabs and a short
    last one) before each weight-gradient product; the same gradients as the materialised logits, within TOL."""
    monkeypatch.setattr(lm_head, "WEIGHT_GRAD_ELEMENTS", 700 * slab_chunks)
    hidden, weight, targets = _case(torch.bfloat16, seed=3)
    targets[[0, 20]] = -100
    got = lm_head.linear_cross_entropy(hidden, weight, targets)
    want = lm_head_ref.linear_cross_entropy_ref(hidden, weight, targets)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    g_got = torch.autograd.grad(got * 0.37, (hidden, weight))
    g_want = torch.autograd.grad(want * 0.37, (hidden, weight))
    for a, b in zip(g_got, g_want, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_logprobs_and_entropy_match_materialised_logits(small_chunks, dtype):
    hidden, weight, targets = _case(dtype, seed=1)
    lp, ent = lm_head.linear_logprobs(hidden, weight, targets)
    lp_ref, ent_ref = lm_head_ref.linear_logprobs_ref(hidden, weight, targets)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(2)
    u, v = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    g_got = torch.autograd.grad((lp * u).sum() + (ent * v).sum(), (hidden, weight))
    g_want = torch.autograd.grad((lp_ref * u).sum() + (ent_ref * v).sum(), (hidden, weight))
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, **TOL[dtype])


def test_no_gradient_requested_computes_none(small_chunks):
    hidden, weight, targets = _case(torch.float32)
    with torch.no_grad():
        got = lm_head.linear_cross_entropy(hidden, weight, targets)
    torch.testing.assert_close(got, lm_head_ref.linear_cross_entropy_ref(hidden, weight, targets).detach())
    frozen_head = weight.detach()
    (g,) = torch.autograd.grad(lm_head.linear_cross_entropy(hidden, frozen_head, targets), (hidden,))
    (want,) = torch.autograd.grad(lm_head_ref.linear_cross_entropy_ref(hidden, frozen_head, targets), (hidden,))
    torch.testing.assert_close(g, want, **TOL[torch.float32])


def _model(small_config):
    from flashnext.config import TextConfig
    from flashnext.model.text import FlashNextForCausalLM

    model = FlashNextForCausalLM(TextConfig.from_dict(small_config))
    model.init_weights(seed=0)
    return model


def test_model_loss_without_logits_equals_the_logits_path(small_config, small_chunks):
    """Packed and padded: `return_logits=False` gives the same loss, loss sum and gradients, and no logits."""
    model = _model(small_config)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (30,), generator=g)
    labels = ids.clone()
    labels[:4] = -100
    cu = torch.tensor([0, 11, 30], dtype=torch.int32)
    for args, kwargs in (
        ((ids,), dict(cu_seqlens=cu, labels=labels)),
        ((ids.view(2, 15),), dict(labels=labels.view(2, 15))),
    ):
        results = []
        for return_logits in (True, False):
            model.zero_grad()
            out = model(*args, **kwargs, return_logits=return_logits)
            out.loss.backward()
            assert (out.logits is None) == (not return_logits)
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
            results.append((out.loss.detach(), out.loss_sum.detach(), grads))
        (l1, s1, g1), (l2, s2, g2) = results
        torch.testing.assert_close(l2, l1, rtol=1e-6, atol=0)
        torch.testing.assert_close(s2, s1, rtol=1e-6, atol=0)
        assert g1.keys() == g2.keys()
        for k in g1:
            torch.testing.assert_close(g2[k], g1[k], rtol=1e-5, atol=1e-7, msg=k)


def test_model_logprobs_without_logits_equal_the_logits_path(small_config, small_chunks):
    model = _model(small_config)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    targets = torch.randint(0, 64, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding: per-token outputs come back in the padded layout
    outs = []
    for return_logits in (True, False):
        model.zero_grad()
        out = model(ids, mask, logprob_targets=targets, return_logits=return_logits)
        assert out.logprobs.shape == out.entropy.shape == (2, 12)
        (out.logprobs[mask.bool()].sum() + 0.1 * out.entropy[mask.bool()].sum()).backward()
        outs.append((out.logprobs.detach(), out.entropy.detach(), model.lm_head.weight.grad.clone()))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
