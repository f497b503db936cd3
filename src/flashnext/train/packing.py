"""Pack examples into cost-balanced micro-batches, in a deterministic order, with a resumable position.

Plan of one epoch (`plan_epoch`):
1. Order: `torch.randperm` over the examples with a generator seeded from `(seed, epoch)`.
2. Groups: walk that order taking examples while their tokens fit `group_size * token_budget` (a group is the
   micro-batches that run side by side: one step's accumulation or the data-parallel ranks).
3. Balance: a group gets `ceil(tokens / token_budget)` micro-batches; its examples, by estimated cost descending,
   each go to the cheapest micro-batch that still has token room (greedy LPT). Examples that fit nowhere go back to
   the front of the order and open the next group, so every example lands exactly once per epoch.

Cost: `cost_fn(seq_lens) -> float` is evaluated once per distinct sequence length and a micro-batch's cost is the
sum over its sequences; this is exact for `flop_cost(cfg)` (the analytic FLOP count is a sum over sequences).

Over-long examples (more tokens than `token_budget`) raise `InputError` naming the example, or, with
`truncate=True`, keep their first `token_budget` tokens and emit one warning per epoch plan.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from flashnext.batch import PackedBatch
from flashnext.errors import ConfigError, InputError
from flashnext.train.data import Example

CostFn = Callable[[list[int]], float]


def flop_cost(cfg: Any) -> CostFn:
    """Cost function of a model: analytic forward FLOPs of a packed batch (`flops.count_flops(...)["total"]`).

    Args:
        cfg: a `TextConfig`, or a `ModelConfig` (its text config is used).
    """
    from flashnext.flops import count_flops

    text = getattr(cfg, "text", cfg)

    @lru_cache(maxsize=4096)
    def cost(lens: tuple[int, ...]) -> float:
        return count_flops(text, list(lens))["total"]

    return lambda seq_lens: cost(tuple(seq_lens))


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator of an epoch's order: seeded with `seed * 1_000_003 + epoch` (mod 2**63)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)


def plan_epoch(
    lengths: Sequence[int],
    token_budget: int,
    cost_fn: CostFn,
    seed: int,
    epoch: int,
    group_size: int = 8,
    balance: bool = True,
) -> list[list[int]]:
    """Assign the examples of one epoch to micro-batches (see the module docstring).

    Args:
        lengths: token count of each example; each must be <= `token_budget`.
        token_budget: most tokens in one micro-batch.
        cost_fn: estimated cost of a packed batch of sequence lengths (assumed additive over sequences).
        seed, epoch: determine the order.
        group_size: micro-batches balanced together.
        balance: False gives the naive plan (next-fit in shuffled order), kept as the baseline.

    Returns:
        example indices of each micro-batch, in order; every index appears exactly once.
    """
    if token_budget < 1 or group_size < 1:
        raise ConfigError(f"token_budget and group_size must be >= 1, got {token_budget}, {group_size}")
    too_long = [i for i, n in enumerate(lengths) if n > token_budget]
    if too_long:
        i = too_long[0]
        raise InputError(f"example {i} has {lengths[i]} tokens > token_budget={token_budget}")
    order = torch.randperm(len(lengths), generator=epoch_generator(seed, epoch)).tolist()
    if not balance:
        return _next_fit(order, lengths, token_budget)
    cost_of_len = {n: float(cost_fn([n])) for n in sorted(set(lengths))}
    cost = [cost_of_len[n] for n in lengths]
    pending, plan = deque(order), []
    while pending:
        window, tokens = [], 0
        while pending and (not window or tokens + lengths[pending[0]] <= group_size * token_budget):
            window.append(pending.popleft())
            tokens += lengths[window[-1]]
        bins, spill = _balance(window, lengths, cost, token_budget, max(1, math.ceil(tokens / token_budget)))
        plan.extend(b for b in bins if b)
        pending.extendleft(reversed(spill))
    return plan


def _balance(window, lengths, cost, token_budget, k) -> tuple[list[list[int]], list[int]]:
    """Greedy LPT of `window` into `k` micro-batches with token room; returns the bins and what did not fit."""
    bins: list[list[int]] = [[] for _ in range(k)]
    room, load = [token_budget] * k, [0.0] * k
    spill = []
    rank = {i: r for r, i in enumerate(window)}
    for i in sorted(window, key=lambda i: (-cost[i], rank[i])):
        fits = [b for b in range(k) if room[b] >= lengths[i]]
        if not fits:
            spill.append(i)
            continue
        b = min(fits, key=lambda b: (load[b], b))
        bins[b].append(i)
        room[b] -= lengths[i]
        load[b] += cost[i]
    return bins, sorted(spill, key=rank.__getitem__)


def _next_fit(order: list[int], lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    plan: list[list[int]] = [[]]
    used = 0
    for i in order:
        if plan[-1] and used + lengths[i] > token_budget:
            plan.append([])
            used = 0
        plan[-1].append(i)
        used += lengths[i]
    return plan if plan[0] else []


def fit_to_budget(examples: Sequence[Example], token_budget: int, truncate: bool = False) -> list[Example]:
    """Check every example fits `token_budget`; with `truncate`, cut over-long ones (one warning) instead."""
    out, cut = [], 0
    for i, ex in enumerate(examples):
        if len(ex) > token_budget:
            if not truncate:
                raise InputError(
                    f"example {i} has {len(ex)} tokens > token_budget={token_budget} (pass truncate=True to cut it)"
                )
            ex, cut = ex.truncated(token_budget), cut + 1
        out.append(ex)
    if cut:
        warnings.warn(f"truncated {cut} example(s) to token_budget={token_budget} tokens", stacklevel=2)
    return out


def collate(examples: Sequence[Example]) -> PackedBatch:
    """Pack examples into one `PackedBatch` (flat ids/labels, int32 cu_seqlens, positions restarting at 0).

    RL fields (advantages, inference log-probs, routed experts) are concatenated when every example has them.
    """
    batch = PackedBatch.from_sequences([ex.input_ids for ex in examples], [ex.labels for ex in examples])
    for name, dtype in (("advantages", torch.float32), ("inference_logprobs", torch.float32)):
        values = [getattr(ex, name) for ex in examples]
        if all(v is not None for v in values):
            setattr(batch, name, torch.tensor([x for v in values for x in v], dtype=dtype))
        elif any(v is not None for v in values):
            raise InputError(f"a micro-batch mixes examples with and without {name!r}")
    routed = [ex.routed_experts for ex in examples]
    if all(r is not None for r in routed):
        try:
            batch.routed_experts = torch.tensor([t for r in routed for t in r], dtype=torch.int64)
        except (ValueError, TypeError):
            raise InputError("routed_experts rows must all be [n_moe_layers][top_k]") from None
    elif any(r is not None for r in routed):
        raise InputError("a micro-batch mixes examples with and without 'routed_experts'")
    if any(ex.images is not None for ex in examples):
        _collate_images(batch, examples)
    return batch


def _collate_images(batch: PackedBatch, examples: Sequence[Example]) -> None:
    """Set an image-bearing batch's pixels, grids, token types and 3-D positions; a text row's positions are its
    offsets on all three axes (what `get_rope_index` gives a text-only sequence)."""
    rows = [ex.images for ex in examples if ex.images is not None]
    batch.pixel_values = torch.cat([r.pixel_values for r in rows])
    batch.image_grid_thw = torch.cat([r.image_grid_thw for r in rows])
    positions, types = [], []
    for ex in examples:
        if ex.images is None:
            positions.append(torch.arange(len(ex), dtype=torch.int64).expand(3, len(ex)))
            types.append(torch.zeros(len(ex), dtype=torch.int64))
        else:
            positions.append(ex.images.position_ids)
            types.append(ex.images.mm_token_type_ids)
    batch.position_ids, batch.mm_token_type_ids = torch.cat(positions, 1), torch.cat(types)


def pack(
    examples: Sequence[Example],
    token_budget: int,
    cost_fn: CostFn,
    seed: int = 0,
    epoch: int = 0,
    group_size: int = 8,
    truncate: bool = False,
) -> list[PackedBatch]:
    """The micro-batches of one epoch: `plan_epoch` over the examples' lengths, then `collate` each."""
    examples = fit_to_budget(examples, token_budget, truncate)
    plan = plan_epoch([len(ex) for ex in examples], token_budget, cost_fn, seed, epoch, group_size)
    return [collate([examples[i] for i in idx]) for idx in plan]


@dataclass
class DataState:
    """Position in the dataset: `index` micro-batches of epoch `epoch` have been handed out."""

    epoch: int = 0
    index: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


class PackedLoader:
    """Endless iterator of packed micro-batches, epoch after epoch, resumable from its `state_dict()`.

    The plan of an epoch depends only on (examples, token_budget, cost_fn, seed, epoch, group_size), so a loader
    restored from a state continues with exactly the micro-batches the interrupted one would have produced. The
    state advances when a micro-batch is handed out, so a checkpoint taken after consuming k batches resumes at k.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        token_budget: int,
        cost_fn: CostFn,
        seed: int = 0,
        group_size: int = 8,
        truncate: bool = False,
    ):
        if not examples:
            raise InputError("PackedLoader needs at least one example")
        self.examples = fit_to_budget(examples, token_budget, truncate)
        self.token_budget, self.cost_fn, self.seed, self.group_size = token_budget, cost_fn, seed, group_size
        self.state = DataState()
        self._plans: dict[int, list[list[int]]] = {}

    def plan(self, epoch: int) -> list[list[int]]:
        """Example indices of each micro-batch of `epoch` (computed once, cached for the current epoch)."""
        if epoch not in self._plans:
            lengths = [len(ex) for ex in self.examples]
            self._plans = {
                epoch: plan_epoch(lengths, self.token_budget, self.cost_fn, self.seed, epoch, self.group_size)
            }
        return self._plans[epoch]

    def __iter__(self) -> Iterator[PackedBatch]:
        while True:
            plan = self.plan(self.state.epoch)
            while self.state.index < len(plan):
                idx = plan[self.state.index]
                self.state.index += 1
                yield collate([self.examples[i] for i in idx])
            self.state = DataState(self.state.epoch + 1, 0)

    def state_dict(self) -> dict[str, int]:
        """The data position plus what it is only valid for (seed, budget, dataset size)."""
        return {
            **self.state.state_dict(),
            "seed": self.seed,
            "token_budget": self.token_budget,
            "num_examples": len(self.examples),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from `state`; raises `ConfigError` if it was saved with another seed, budget or dataset size."""
        mine = self.state_dict()
        for key in ("seed", "token_budget", "num_examples"):
            if key in state and state[key] != mine[key]:
                raise ConfigError(f"data state has {key}={state[key]}, this loader has {key}={mine[key]}")
        self.state.load_state_dict(state)
