"""Packing: deterministic cost-balanced plans, budget, stream layout, FLOP cost, resumable position."""

import itertools

import pytest
import torch

from flashnext.config import parse_config
from flashnext.errors import ConfigError, InputError
from flashnext.train.data import Example
from flashnext.train.packing import DataState, PackedLoader, collate, flop_cost, pack, plan_epoch


def quadratic(lens):
    return float(sum(n * n for n in lens))


def _examples(lengths):
    return [Example(list(range(1, n + 1)), [-100] + list(range(2, n + 1))) for n in lengths]


SKEWED = [120] * 8 + [8] * 120  # a few long (costly) sequences among many short ones
MIXED = [(7 * i) % 61 + 1 for i in range(80)]


def test_plan_is_deterministic_per_seed_and_epoch():
    a = plan_epoch(MIXED, 128, quadratic, seed=1, epoch=0)
    assert a == plan_epoch(MIXED, 128, quadratic, seed=1, epoch=0)
    assert a != plan_epoch(MIXED, 128, quadratic, seed=2, epoch=0)
    assert a != plan_epoch(MIXED, 128, quadratic, seed=1, epoch=1)


@pytest.mark.parametrize("balance", [True, False], ids=["balanced", "naive"])
@pytest.mark.parametrize("budget", [61, 128, 500])
def test_every_example_once_and_budget_respected(budget, balance):
    plan = plan_epoch(MIXED, budget, quadratic, seed=3, epoch=0, group_size=4, balance=balance)
    assert sorted(i for mb in plan for i in mb) == list(range(len(MIXED)))
    assert all(mb and sum(MIXED[i] for i in mb) <= budget for mb in plan)


def test_balancing_lowers_the_costliest_micro_batch():
    def max_cost(plan):
        return max(quadratic([SKEWED[i] for i in mb]) for mb in plan)

    ideal = quadratic([120] + [8] * 15)  # one long sequence per micro-batch, the short ones spread evenly
    strictly_better = 0
    for seed in range(5):
        balanced = plan_epoch(SKEWED, 256, quadratic, seed, 0, group_size=8)
        naive = plan_epoch(SKEWED, 256, quadratic, seed, 0, balance=False)
        assert max_cost(balanced) == ideal <= max_cost(naive)
        assert len(balanced) <= len(naive)
        strictly_better += max_cost(balanced) < max_cost(naive)
    assert strictly_better >= 2


def test_collate_layout():
    batch = collate([Example([5, 6, 7], [-100, 6, 7]), Example([8], [8]), Example([9, 10], [-100, 10])])
    assert batch.input_ids.dtype == torch.int64 and batch.input_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert batch.labels.tolist() == [-100, 6, 7, 8, -100, 10]
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert batch.position_ids.dtype == torch.int64 and batch.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert batch.max_seqlen == 3 and batch.lengths == [3, 1, 2] and batch.num_tokens == 6


def test_pack_batches_follow_the_plan():
    examples = _examples(MIXED)
    batches = pack(examples, 128, quadratic, seed=5, epoch=2)
    plan = plan_epoch(MIXED, 128, quadratic, seed=5, epoch=2)
    assert [b.lengths for b in batches] == [[MIXED[i] for i in mb] for mb in plan]
    assert all(b.num_tokens <= 128 and b.cu_seqlens[-1] == b.num_tokens for b in batches)


def test_overlong_examples_error_or_truncate():
    examples = _examples([4, 300, 5])
    with pytest.raises(InputError, match="example 1 has 300 tokens > token_budget=64"):
        pack(examples, 64, quadratic)
    with pytest.warns(UserWarning, match="truncated 1 example"):
        batches = pack(examples, 64, quadratic, truncate=True)
    assert sorted(n for b in batches for n in b.lengths) == [4, 5, 64]


def test_flop_cost_is_additive_and_grows_with_length(small_config):
    cost = flop_cost(parse_config(small_config))
    assert 0 < cost([16]) < cost([64])
    assert cost([16, 64]) == pytest.approx(cost([16]) + cost([64]))
    plan = plan_epoch([16, 64, 8, 40, 33], 80, cost, seed=0, epoch=0)
    assert sorted(i for mb in plan for i in mb) == [0, 1, 2, 3, 4]


def _signature(batch):
    return (batch.input_ids.tolist(), batch.labels.tolist(), batch.cu_seqlens.tolist())


@pytest.mark.parametrize("stop", [0, 3, 7, 11])
def test_resumed_loader_continues_exactly(stop):
    examples = _examples(MIXED[:30])
    n_per_epoch = len(PackedLoader(examples, 100, quadratic, seed=9).plan(0))
    assert 7 < n_per_epoch < 11  # so stops 7 and 11 cross the epoch boundary
    total = 2 * n_per_epoch + 3
    full = [_signature(b) for b in itertools.islice(PackedLoader(examples, 100, quadratic, seed=9), total)]
    first = PackedLoader(examples, 100, quadratic, seed=9)
    head = [_signature(b) for b in itertools.islice(first, stop)]
    state = first.state_dict()
    resumed = PackedLoader(examples, 100, quadratic, seed=9)
    resumed.load_state_dict(state)
    tail = [_signature(b) for b in itertools.islice(resumed, total - stop)]
    assert head + tail == full
    assert full[:n_per_epoch] != full[n_per_epoch : 2 * n_per_epoch]  # a new epoch reshuffles


def test_data_state_round_trip_and_mismatch():
    state = DataState(epoch=2, index=5)
    other = DataState()
    other.load_state_dict(state.state_dict())
    assert other == state
    loader = PackedLoader(_examples([3, 4]), 16, quadratic, seed=1)
    with pytest.raises(ConfigError, match="seed=2"):
        loader.load_state_dict({"epoch": 0, "index": 0, "seed": 2})
