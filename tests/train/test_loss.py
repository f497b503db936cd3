"""SFT and RL losses: micro-batch split invariance, target shifting, a hand-computed RL example, metrics."""

import math

import pydantic
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashnext.batch import make_segments, next_token_targets
from flashnext.errors import InputError
from flashnext.model.heads import causal_lm_loss
from flashnext.train.loss import RLLossConfig, count_label_tokens, rl_loss, sft_loss, token_logprobs

V, D = 11, 6


def _packed_batch(lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    feats = torch.randn(T, D, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.rand(T, generator=g) < 0.3] = -100
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return feats, labels, cu


def test_next_token_targets_stays_in_sequence():
    # Three sequences, the middle one empty; the last token of each sequence has no target.
    labels = torch.tensor([10, 11, 12, -100, 14])
    seg = make_segments(torch.tensor([0, 2, 2, 5], dtype=torch.int32), 5)
    assert next_token_targets(labels, seg).tolist() == [11, -100, -100, 14, -100]
    assert next_token_targets(labels[:1], make_segments(torch.tensor([0, 1], dtype=torch.int32), 1)).tolist() == [-100]


def test_sft_loss_matches_per_sequence_cross_entropy():
    feats, labels, cu = _packed_batch([3, 5, 2, 4])
    logits = nn.Linear(D, V, dtype=torch.float64)(feats)
    n = count_label_tokens(labels, cu)
    expected_sum, expected_n = 0.0, 0
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):  # each sequence alone: no cross-sequence targets
        tgt = labels[a + 1 : b]
        keep = tgt != -100
        expected_sum = expected_sum + F.cross_entropy(logits[a : b - 1][keep], tgt[keep], reduction="sum")
        expected_n += int(keep.sum())
    assert n == expected_n
    loss = sft_loss(logits, labels, cu, n)
    torch.testing.assert_close(loss, (expected_sum / n).float())
    # The model's own loss (mean over its label tokens) is the single-micro-batch case; Segments are accepted too.
    seg = make_segments(cu, labels.shape[0])
    torch.testing.assert_close(loss, causal_lm_loss(logits, labels, seg))
    torch.testing.assert_close(sft_loss(logits, labels, seg, torch.tensor(n)), loss)


def test_sft_loss_is_invariant_to_micro_batch_split():
    lengths = [3, 5, 2, 4]
    feats, labels, cu = _packed_batch(lengths, seed=1)
    head = nn.Linear(D, V, dtype=torch.float64)
    n_step = count_label_tokens(labels, cu)

    full = sft_loss(head(feats), labels, cu, n_step)
    full_grads = torch.autograd.grad(full, list(head.parameters()))

    # The same four sequences as two micro-batches (2 + 2 sequences), each divided by the step's count.
    split = sum(lengths[:2])
    micro = [
        (feats[:split], labels[:split], torch.tensor([0, 3, 8], dtype=torch.int32)),
        (feats[split:], labels[split:], torch.tensor([0, 2, 6], dtype=torch.int32)),
    ]
    assert sum(count_label_tokens(lab, c) for _, lab, c in micro) == n_step
    total = torch.zeros((), dtype=torch.float32)
    grads = [torch.zeros_like(p) for p in head.parameters()]
    for f, lab, c in micro:
        loss = sft_loss(head(f), lab, c, n_step)
        for acc, g in zip(grads, torch.autograd.grad(loss, list(head.parameters())), strict=True):
            acc += g
        total = total + loss.detach()
    torch.testing.assert_close(total, full.detach())
    for g, ref in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(g, ref)


def test_sft_loss_all_ignored_is_zero_and_bad_inputs_raise():
    logits = torch.randn(4, V, requires_grad=True)
    labels = torch.full((4,), -100)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    loss = sft_loss(logits, labels, cu, 0)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.all(logits.grad == 0)
    with pytest.raises(InputError, match="num_label_tokens"):
        sft_loss(logits, labels, cu, -1)
    with pytest.raises(InputError, match="labels"):
        sft_loss(logits, labels[:3], cu, 1)


def test_token_logprobs_matches_direct_computation():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, V, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, V, (5,), generator=g)
    lp, ent = token_logprobs(logits, targets)
    assert lp.dtype == ent.dtype == torch.float32
    x = logits.double()
    p = x.exp() / x.exp().sum(-1, keepdim=True)
    torch.testing.assert_close(lp.double(), p[torch.arange(5), targets].log(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent.double(), -(p * p.log()).sum(-1), rtol=1e-6, atol=1e-6)


# Four tokens: 0 and 2 are kept, 1 is masked by the eps rule (|0.3 - 0.5| = 0.2 > 0.1), 3 is not a loss token.
P_TRAIN = [0.5, 0.3, 0.9, 0.2]
P_INFER = [0.45, 0.5, 0.85, 0.2]
ADV = [1.0, 2.0, -0.5, 3.0]
MASK = [True, True, True, False]
N_STEP = 6  # loss tokens across the whole step (other micro-batches hold the rest)


def _rl_inputs():
    lp_train = torch.tensor([math.log(p) for p in P_TRAIN], dtype=torch.float64, requires_grad=True)
    lp_infer = torch.tensor([math.log(p) for p in P_INFER], dtype=torch.float64)
    return lp_train, lp_infer, torch.tensor(ADV), torch.tensor(MASK)


def test_rl_loss_hand_computed():
    lp_train, lp_infer, adv, mask = _rl_inputs()
    loss, metrics = rl_loss(lp_train, lp_infer, adv, mask, N_STEP)

    r0, r2 = 0.5 / 0.45, 0.9 / 0.85
    expected = (-1.0 * 1.0 * r0 + 1e-3 * math.log(r0) ** 2 - 1.0 * (-0.5) * r2 + 1e-3 * math.log(r2) ** 2) / N_STEP
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected, rel=1e-6)

    # d loss / d lp_train[t] = (-adv_tau * A * r + 2 * kl_tau * log r) / N on kept tokens, 0 elsewhere.
    (grad,) = torch.autograd.grad(loss, lp_train)
    g0 = (-1.0 * r0 + 2e-3 * math.log(r0)) / N_STEP
    g2 = (0.5 * r2 + 2e-3 * math.log(r2)) / N_STEP
    assert grad[0].item() < 0  # positive advantage: raising the token's log-prob lowers the loss
    assert grad[2].item() > 0  # negative advantage: the opposite
    torch.testing.assert_close(grad, torch.tensor([g0, 0.0, g2, 0.0], dtype=torch.float64), rtol=1e-6, atol=1e-9)

    def kl(r):
        return r - math.log(r) - 1

    r1 = 0.3 / 0.5
    assert metrics["mismatch_kl"].item() == pytest.approx((kl(r0) + kl(r1) + kl(r2)) / 3, rel=1e-5)
    assert metrics["mismatch_kl_masked"].item() == pytest.approx(kl(r1), rel=1e-5)
    assert metrics["mismatch_kl_unmasked"].item() == pytest.approx((kl(r0) + kl(r2)) / 2, rel=1e-5)
    err = (abs(math.log(r0)) + abs(math.log(r1)) + abs(math.log(r2))) / 3
    assert metrics["logprob_abs_error"].item() == pytest.approx(err, rel=1e-5)
    assert metrics["masked_fraction"].item() == pytest.approx(1 / 3)
    assert (metrics["loss_tokens"].item(), metrics["masked_tokens"].item()) == (3, 1)
    assert "entropy" not in metrics
    assert all(not m.requires_grad for m in metrics.values())


def test_rl_loss_config_and_entropy():
    lp_train, lp_infer, adv, mask = _rl_inputs()
    # Without the penalty and a wider eps, token 1 is kept too: the loss is -adv_tau * sum(A * r) / N.
    cfg = RLLossConfig(eps=0.25, adv_tau=2.0, kl_tau=0.0)
    loss, metrics = rl_loss(lp_train, lp_infer, adv, mask, torch.tensor(N_STEP), cfg)
    ratios = [pt / pi for pt, pi in zip(P_TRAIN, P_INFER, strict=True)]
    expected = -2.0 * sum(a * r for a, r, m in zip(ADV, ratios, MASK, strict=True) if m) / N_STEP
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["masked_fraction"].item() == 0.0

    entropy = torch.tensor([1.0, 2.0, 3.0, 100.0])  # the non-loss token's entropy is left out
    _, metrics = rl_loss(lp_train, lp_infer, adv, mask, N_STEP, entropy=entropy)
    assert metrics["entropy"].item() == pytest.approx(2.0)
    logits = torch.randn(4, V)
    _, metrics = rl_loss(lp_train, lp_infer, adv, mask, N_STEP, logits=logits)
    _, ent = token_logprobs(logits, torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(metrics["entropy"], ent[:3].mean())


def test_rl_loss_extreme_ratio_off_the_kept_tokens_keeps_gradients_finite():
    lp_train, lp_infer, adv, mask = _rl_inputs()
    lp_infer = lp_infer.clone()
    lp_infer[3] = -1e4  # a prompt token the engine never scored: exp(lp_train - lp_infer) overflows
    loss, _ = rl_loss(lp_train, lp_infer, adv, mask, N_STEP)
    (grad,) = torch.autograd.grad(loss, lp_train)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_rl_loss_config_validation_and_docs():
    with pytest.raises(pydantic.ValidationError):
        RLLossConfig(epsilon=0.2)
    with pytest.raises(pydantic.ValidationError):
        RLLossConfig(eps=-1.0)
    for name, field in RLLossConfig.model_fields.items():
        assert field.description, name
    lp_train, lp_infer, adv, mask = _rl_inputs()
    with pytest.raises(InputError, match="advantages"):
        rl_loss(lp_train, lp_infer, adv[:3], mask, N_STEP)
