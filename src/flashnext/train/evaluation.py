"""The held-out loss: a fixed eval split and its loss, computed like the training loss but without gradients.

Split: `data.eval_path` gives the held-out examples directly; otherwise `data.eval_fraction` of the training file's
examples (at least one) is drawn once with a generator seeded from `data.seed` (not the run's RNG, so a resumed run
holds out the same examples and its training RNG is untouched). The held-out examples never train.

Loss: the eval examples are packed once into `data.token_budget` micro-batches (a fixed plan); `eval_loss` is the
run's own loss (`train.loss`: SFT cross-entropy or the RL loss) summed over every held-out loss token and divided
by their count, i.e. the training loss's definition over the whole split as one step. Under a process group the
micro-batches are dealt round-robin; a rank short of one runs the first batch again and discards it, so every
rank issues the same number of forwards (FSDP's collectives pair up).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from flashnext.batch import PackedBatch
from flashnext.errors import InputError
from flashnext.train.data import Example
from flashnext.train.loss import count_label_tokens
from flashnext.train.packing import CostFn, pack

_SPLIT_SALT = 0x5EED_E7A1  # the split's generator differs from every epoch order drawn from the same seed


def split_eval(examples: Sequence[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held-out): `ceil(fraction * n)` examples drawn by a generator seeded from `seed`; order kept.

    Raises:
        InputError: the split would leave no training example.
    """
    n = len(examples)
    k = max(1, math.ceil(fraction * n))
    if k >= n:
        raise InputError(f"data.eval_fraction={fraction} holds out {k} of {n} examples, leaving none to train on")
    gen = torch.Generator().manual_seed((seed * 1_000_003 + _SPLIT_SALT) % 2**63)
    held = set(torch.randperm(n, generator=gen)[:k].tolist())
    return [ex for i, ex in enumerate(examples) if i not in held], [ex for i, ex in enumerate(examples) if i in held]


class Evaluator:
    """The held-out micro-batches of a run and their loss.

    Args:
        examples: the held-out examples.
        token_budget: most tokens per micro-batch (the run's `data.token_budget`).
        cost_fn: the packing's cost function.
        truncate: cut over-long examples instead of failing (the run's `data.truncate`).
    """

    def __init__(self, examples: Sequence[Example], token_budget: int, cost_fn: CostFn, truncate: bool = False):
        self.batches: list[PackedBatch] = pack(examples, token_budget, cost_fn, seed=0, group_size=1, truncate=truncate)
        self.num_examples = len(examples)
        self.loss_tokens = sum(int(count_label_tokens(b.labels, b.cu_seqlens)) for b in self.batches)
        if self.loss_tokens == 0:
            raise InputError(f"the held-out split ({len(examples)} examples) has no loss tokens")

    @torch.no_grad()
    def loss(
        self,
        model: torch.nn.Module,
        forward_loss: Callable[[PackedBatch, float], tuple],
        rank: int = 0,
        world_size: int = 1,
        all_reduce_sum: Callable[[list[float]], list[float]] = lambda v: v,
    ) -> float:
        """Mean loss per held-out loss token (`forward_loss(batch, 1.0)` returns a batch's loss sum)."""
        was_training = model.training
        model.eval()
        total = 0.0
        try:
            for k in range(math.ceil(len(self.batches) / world_size)):
                i = k * world_size + rank
                loss = forward_loss(self.batches[i if i < len(self.batches) else 0], 1.0)[0]
                total += float(loss) if i < len(self.batches) else 0.0
        finally:
            model.train(was_training)
        (total,) = all_reduce_sum([total])
        return total / self.loss_tokens
