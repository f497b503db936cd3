"""bf16 compute over fp32 master weights in one process (`train.compute_dtype = "bfloat16"`).

Between steps the model holds its fp32 parameters, the masters: the optimizers (and their fp32 states), gradient
clipping, checkpoints, export and resume see exactly what an fp32 run sees. Inside `compute()` every floating
parameter points at a persistent low-precision copy, refreshed from its master on entry, so forward and backward
run in bf16 like a model loaded in bf16 (the path `tests/reference/test_bf16.py` holds to the reference's own
bf16 error: fp32 where the reference keeps fp32, i.e. norm statistics, router softmax, the delta rule's decay and
state, softmax and loss). Each bf16 gradient is added into an fp32 accumulator as soon as autograd has produced
it (a post-accumulate-grad hook), so gradient accumulation over micro-batches is fp32; on exit the parameters
point at their masters again and carry the fp32 gradients.

Why bf16 copies of the parameters rather than `torch.autocast`: autocast recasts per op, and our kernels decide
their dtypes themselves (fp32 islands, integer tie-breaking keys built from fp32 score bits, custom autograd
functions whose saved operands must agree in dtype): under autocast, `ops.qsa.rank_blocks` reinterpreted bf16
scores as int32 bits, and the delta-rule scan and QSA's hand-written backwards received mixed dtypes; each kernel
would need its own opt-out. Measured on the 31M benchmark config (fwd+bwd, 1024 tokens, 1 thread, with those
opt-outs patched in for the trial): bf16 copies 1.95 s, autocast 2.00 s, fp32 2.47 s, with equal gradient error.
Autocast also keeps activations in fp32, so elementwise passes move twice the bytes.

The masters cost 4 bytes per parameter on top of the 2-byte copy; under FSDP2 on CUDA `parallelize`'s
`MixedPrecisionPolicy` does the same job with sharded masters.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class MixedPrecision:
    """Low-precision compute copies of a model's fp32 parameters (see the module docstring).

    Args:
        model: the model holding fp32 parameters (the masters).
        dtype: the compute dtype (`torch.bfloat16`).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.model, self.dtype = model, dtype
        self.params = [p for p in model.parameters() if p.dtype == torch.float32]
        self.copies: dict[nn.Parameter, torch.Tensor] = {}
        self.masters: dict[nn.Parameter, torch.Tensor] = {}
        self.grads: dict[nn.Parameter, torch.Tensor] = {}
        self.active = False
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._accumulate)

    def _accumulate(self, p: nn.Parameter) -> None:
        if not self.active or p.grad is None:
            return
        acc = self.grads.get(p)
        if acc is None:
            self.grads[p] = p.grad.to(torch.float32)
        else:
            acc.add_(p.grad)
        p.grad = None  # the bf16 gradient is consumed: the next micro-batch starts a fresh one

    @contextmanager
    def compute(self):
        """Forward/backward in the compute dtype; fp32 parameters and accumulated fp32 gradients after."""
        if self.active:
            yield
            return
        tables = _dtype_modules(self.model)
        for p in self.params:
            master = p.data
            copy = self.copies.get(p)
            if copy is None:
                copy = self.copies[p] = torch.empty_like(master, dtype=self.dtype)
            copy.copy_(master)
            self.masters[p] = master
            if p.grad is not None:  # a gradient from before the window: kept, fp32
                self.grads[p] = p.grad
                p.grad = None
            p.data = copy
        for m in tables:
            m._flashnext_dtype, m.dtype = m.dtype, self.dtype
        self.active = True
        try:
            yield
        finally:
            self.active = False
            for m in tables:
                m.dtype = m._flashnext_dtype
            for p in self.params:
                p.data = self.masters.pop(p)
                p.grad = self.grads.pop(p, None)


def _dtype_modules(model: nn.Module) -> list[nn.Module]:
    """Parameterless modules with an output `dtype` attribute (n-gram tables kept in their stored dtype)."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "dtype", None), torch.dtype) and not any(True for _ in m.parameters(recurse=False))
    ]
