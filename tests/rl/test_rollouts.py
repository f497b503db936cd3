"""Advantages against hand-computed numbers, the zero-advantage filter, and what a packed sample carries where:
loss, advantages and engine log-probs on completion tokens only, the engine's routed experts (the last token
padded), MRoPE positions and placeholder types for an image sample."""

from __future__ import annotations

import pytest
import torch

from flashnext.batch import make_segments, next_token_targets
from flashnext.errors import InputError
from flashnext.rl.rollouts import Sample, assign_advantages, empty_like, group_advantages, pack_samples


def _sample(group: int, reward: float, prompt=(5, 6, 7), completion=(8, 9), routed=None) -> Sample:
    return Sample({"i": group}, group, list(prompt), list(completion), [-0.5 - 0.1 * i for i in range(len(completion))],
                  reward, policy_step=0, routed=routed)  # fmt: skip


def test_group_advantages_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.5, 0.5], [0.2, 0.2, 0.2, 1.0]])
    # means 0.5 and 0.4; population variances (0.25 + 0.25) / 4 = 0.125 and (3 * 0.04 + 0.36) / 4 = 0.12
    want = torch.tensor([[0.5, -0.5, 0.0, 0.0], [-0.2, -0.2, -0.2, 0.6]], dtype=torch.float64)
    torch.testing.assert_close(group_advantages(r), want, rtol=0, atol=1e-7)
    std = torch.tensor([[0.125**0.5], [0.12**0.5]], dtype=torch.float64)
    torch.testing.assert_close(group_advantages(r, std_normalize=True), want / (std + 1e-6), rtol=1e-6, atol=1e-7)
    assert group_advantages(r, std_normalize=True)[0, 0].item() == pytest.approx(1.41421, abs=1e-4)


def test_zero_advantage_groups_dropped_and_counted():
    groups = [
        [_sample(0, 1.0), _sample(0, 0.0), _sample(0, 0.5)],  # mean 0.5
        [_sample(1, 0.3), _sample(1, 0.3), _sample(1, 0.3)],  # all equal: advantage 0
        [_sample(2, 0.0), _sample(2, 0.0)],  # all equal at 0
        [_sample(3, 0.25), _sample(3, 0.75)],
    ]
    kept, dropped = assign_advantages(groups)
    assert dropped == 2
    assert [s.group for s in kept] == [0, 0, 0, 3, 3]
    assert [round(s.advantage, 9) for s in kept] == [0.5, -0.5, 0.0, -0.25, 0.25]
    kept_all, dropped_none = assign_advantages(groups, drop_zero=False)
    assert dropped_none == 0 and len(kept_all) == 10
    assert all(s.advantage == 0 for s in kept_all if s.group in (1, 2))


def test_advantages_only_on_completion_tokens():
    L, k = 3, 2
    routed = torch.arange(4 * L * k, dtype=torch.int64).view(4, L, k).to(torch.uint16)  # P + C - 1 = 4 tokens run
    samples = [_sample(0, 1.0, routed=routed), _sample(0, 0.0, routed=routed), _sample(1, 0.2, (1, 2), (3, 4, 5),
                                                                                    routed=routed)]  # fmt: skip
    kept, _ = assign_advantages([samples[:2], samples[2:] + [_sample(1, 0.6, (1, 2), (3, 4, 5), routed=routed)]])
    (b,) = pack_samples(kept, token_budget=100, num_layers=L, top_k=k)
    assert b.cu_seqlens.tolist() == [0, 5, 10, 15, 20]
    first = slice(0, 5)
    assert b.input_ids[first].tolist() == [5, 6, 7, 8, 9]
    assert b.labels[first].tolist() == [-100, -100, -100, 8, 9]
    assert b.advantages[first].tolist() == [0.0, 0.0, 0.0, 0.5, 0.5]
    assert b.inference_logprobs[first].tolist() == pytest.approx([0, 0, 0, -0.5, -0.6])
    assert b.advantages[10:15].tolist() == [0.0, 0.0, pytest.approx(-0.2), pytest.approx(-0.2), pytest.approx(-0.2)]
    # the trainer's view (targets shifted to the token that predicts them): loss and advantage only where a
    # completion token is predicted, including the first completion token (predicted by the prompt's last token)
    seg = make_segments(b.cu_seqlens, b.num_tokens, b.position_ids)
    targets = next_token_targets(b.labels, seg)
    adv = next_token_targets(b.advantages, seg, 0.0)
    assert (targets[first] != -100).tolist() == [False, False, True, True, False]
    assert adv[first].tolist() == [0.0, 0.0, 0.5, 0.5, 0.0]
    # routed experts: the engine's rows, then the last (never run) token padded with 0..k-1
    assert torch.equal(b.routed_experts[0:4], routed.long())
    assert b.routed_experts[4].tolist() == [[0, 1]] * L
    assert b.routed_experts.dtype == torch.int64


def test_packing_budget_and_loss_free_stand_in():
    samples = [_sample(i, float(i)) for i in range(5)]  # 5 tokens each
    for s in samples:
        s.advantage = 1.0
    batches = pack_samples(samples, token_budget=11)
    assert [b.lengths for b in batches] == [[5, 5], [5, 5], [5]]
    alone = pack_samples([_sample(0, 1.0, completion=tuple(range(20)))], token_budget=8)
    assert [b.lengths for b in alone] == [[23]]  # longer than the budget: trains alone, never cut
    stand_in = empty_like(batches[0])
    assert (stand_in.labels == -100).all() and (stand_in.advantages == 0).all()
    assert torch.equal(stand_in.input_ids, batches[0].input_ids)


def test_bad_samples_refused():
    s = _sample(0, 1.0)
    s.logprobs = s.logprobs[:1]
    with pytest.raises(InputError, match="2 completion tokens but 1 log-probs"):
        pack_samples([s], 100)
    wrong = _sample(0, 1.0, routed=torch.zeros(4, 2, 2, dtype=torch.uint16))
    with pytest.raises(InputError, match="routed experts"):
        pack_samples([wrong], 100, num_layers=3, top_k=2)
