"""`serve.graph_calls.BoundStep` on a small inductor-compiled step: bound calls reach inductor's compiled graph
directly (past AOTAutograd's runtime wrapper) and equal calls through dynamo's entry, outputs, in-place state
writes and version counters alike.

The step is a toy with the decode step's shape of work (a state buffer written in place at some rows, a product
read out), compiled as `serve.decode_graph` compiles its buckets (inductor with `INDUCTOR_PATCHES`, the C++
wrapper among them): inductor's code generation for the whole model takes minutes on 2 cores, this toy seconds.
Bitwise comparisons: the same compiled graph on the same inputs, by construction.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch

from flashnext.serve.decode_graph import INDUCTOR_PATCHES, _tensor_guards
from flashnext.serve.graph_calls import BoundStep


class _Toy:
    """A state [4, 8] read and written at `slots`, a weight [16, 8]: logits [n, 16] of the updated rows."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(16, 8, generator=gen), requires_grad=False)
        self.state = torch.randn(4, 8, generator=gen)

    def _step(self, ids, slots, cached):
        rows = self.state.index_select(0, slots) * 0.5 + self.weight[ids] + cached[:, None].float()
        self.state.index_copy_(0, slots, rows)
        return rows @ self.weight.T


@pytest.fixture(scope="module")
def compiled():
    from torch._inductor.compile_fx import compile_fx

    toy = _Toy()
    code = _Toy._step.__code__.replace(co_name="toy_bound_step")
    step = types.FunctionType(code, _Toy._step.__globals__, "toy_bound_step").__get__(toy)
    fn = torch.compile(
        step, backend=functools.partial(compile_fx, config_patches=INDUCTOR_PATCHES), fullgraph=True,
        dynamic=False, options={"guard_filter_fn": _tensor_guards},
    )  # fmt: skip
    return toy, code, fn


def _inputs(ids):
    return torch.tensor(ids), torch.tensor([2, 0]), torch.tensor([3, 1])


def test_a_bound_step_calls_inductors_graph_directly_and_equals_dynamos_call(compiled, monkeypatch):
    from torch._inductor.output_code import CompiledFxGraph

    toy, code, fn = compiled
    with torch.inference_mode():
        fn(*_inputs([1, 2]))  # compiles
        bound, logits = BoundStep.bind(code, toy, 0, *_inputs([3, 4]))
        assert bound is not None and logits is not None and bound.direct
        start, version = toy.state.clone(), toy.state._version
        via_dynamo = fn(*_inputs([5, 6]))
        after_dynamo, bumps = toy.state.clone(), toy.state._version - version  # the wrapper's, of the mutated state
        toy.state.copy_(start)
        version = toy.state._version

        def refuse(self, inputs):
            raise AssertionError("a bound step went through CompiledFxGraph.__call__")

        monkeypatch.setattr(CompiledFxGraph, "__call__", refuse)
        got = bound(*_inputs([5, 6]))
    assert torch.equal(got, via_dynamo) and torch.equal(toy.state, after_dynamo)
    assert bumps >= 1 and toy.state._version - version == bumps
