"""Weight-only int8 linears for CPU serving: per-output-channel symmetric int8, torch's packed CPU kernel.

`Int8Linear` replaces an `nn.Linear` (or the router's weight) of the dense trunk; `Int8Group` replaces a
`model.fused.Group` (same-input projections) with ONE int8 weight of the members' rows, the members becoming
`Int8Linear`s whose tensors are row views of it (no second copy, and a requantization of a member in place is seen by
the group at once).

Numbers: `w ~= q * scale[:, None]`, q int8 in [-127, 127], scale = rowmax|w| / 127 rounded to the compute dtype
first (q is computed against the rounded scale, so dequantising is exact). The product runs through
`torch.ops.aten._weight_int8pack_mm(x, q, scale)` (= `F.linear(x, q.to(x.dtype)) * scale`), which has a fast
AVX-512/AVX2 CPU kernel for bf16/fp16 activations only (fp32 activations ran 10-30x slower than a bf16 GEMM
here), so the compute dtype is bf16 unless the model is fp16: fp32 inputs are cast to it and the output back.
`torch.compile` handles the op (it has a meta kernel and an inductor lowering), so the decode graph keeps it. The
kernel needs K a multiple of 16 (it crashed on K = 8, 24 in torch 2.13); a narrower or odd K (none in the released
model; the tests' tiny PLE width 8) multiplies by the weight dequantised in the compute dtype instead.

Inside a compiled graph (the CPU decode step) a product of fp32 activations of at most `REDUCED_ROWS` rows is
written instead as a reduction over the codes (`model.fused.reduced_linear` with the row scales: int8 upcast as
read, fp32 products summed over K, the row scale applied to the sums), which inductor generates as one vectorised
loop streaming the int8 rows: no kernel call, no bf16 casts of the input and output, no dequantised weight.
bf16 / fp16 activations keep the kernel: it reads them natively (no casts to save), and inside inductor's fused
kernels the reduction's fp32 sums would reach their consumers unrounded (inductor drops intermediate bf16
roundings), moving a bf16 graph's greedy tokens off the eager step's (seen at token 6 of
`tests/quant/test_apply.py::test_quantized_decode_graph_equals_eager[inductor]`, a 0.4 logit gap: not a tie).

The plain twin `int8_linear_ref` dequantises and multiplies in fp32 (the spec); `FLASHNEXT_QUANT_REFERENCE=1`
routes every quantized module through its twin.

Legend: M rows of input, K input features, N output features.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from flashnext.model.fused import REDUCED_ROWS, Group, _compiling, reduced_linear

QMAX = 127
PACKED_K = 16  # `_weight_int8pack_mm` needs K % 16 == 0 (other K segfaulted in torch 2.13); those dequantise


def use_reference() -> bool:
    """Whether `FLASHNEXT_QUANT_REFERENCE=1` forces the dequantise-then-matmul twins."""
    return os.environ.get("FLASHNEXT_QUANT_REFERENCE", "") == "1"


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activation dtype of the packed kernels for a model in `dtype`: fp16 stays, anything else is bf16."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


@torch.no_grad()
def quantize_int8(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (q int8 [..., N, K], scale [..., N] in `dtype`), symmetric per output row."""
    scale = (w.float().abs().amax(-1) / QMAX).clamp_min(1e-12).to(dtype)
    q = torch.round(w.float() / scale.float().unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q int8 [..., N, K], scale [..., N] -> fp32 [..., N, K]."""
    return q.float() * scale.float().unsqueeze(-1)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    """x [..., K] @ dequant(q [N, K], scale [N]).T (+ bias) -> [..., N] in x's dtype, by the packed kernel."""
    if use_reference():
        return int8_linear_ref(x, q, scale, bias)
    lead, K = x.shape[:-1], x.shape[-1]
    if x.dtype == torch.float32 and x.device.type == "cpu" and math.prod(lead) <= REDUCED_ROWS and _compiling():
        return reduced_linear(x.reshape(-1, K), q, bias, scale).reshape(*lead, q.shape[0])
    xc = x.reshape(-1, K).to(scale.dtype).contiguous()
    if K % PACKED_K:  # the kernel crashes (not raises) on other widths: dequantise in the compute dtype
        y = F.linear(xc, q.to(scale.dtype)) * scale
    else:
        y = torch.ops.aten._weight_int8pack_mm(xc, q, scale)
    y = y.to(x.dtype).reshape(*lead, q.shape[0])
    return y if bias is None else y + bias


def int8_linear_ref(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, exact_input: bool = False
):
    """The spec of `int8_linear`: dequantise in fp32 and multiply in fp32 (x rounded to the compute dtype first,
    as the kernel reads it; as given with `exact_input`, as the compiled reduction reads it)."""
    xf = x.float() if exact_input else x.to(scale.dtype).float()
    y = F.linear(xf, dequantize_int8(q, scale)).to(x.dtype)
    return y if bias is None else y + bias


class Int8Linear(nn.Module):
    """`nn.Linear` with an int8 weight: buffers `qweight` int8 [N, K], `scale` [N] (compute dtype), `bias` [N].

    `weight_dtype` is the dtype the float weight had (what a weight update of this module must be sent in).
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, weight_dtype):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self.weight_dtype = weight_dtype

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        q, s = quantize_int8(weight, compute_dtype(weight.dtype))
        return cls(q, s, None if bias is None else bias.detach().clone(), weight.dtype)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.qweight, self.scale, self.bias)

    @torch.no_grad()
    def write_rows(self, start: int, w: torch.Tensor) -> None:
        """Requantize output rows `[start, start + w.shape[0])` from float rows w [n, K], in place."""
        q, s = quantize_int8(w, self.scale.dtype)
        self.qweight[start : start + w.shape[0]].copy_(q)
        self.scale[start : start + w.shape[0]].copy_(s)

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] this module multiplies by, fp32."""
        return dequantize_int8(self.qweight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


class Int8Router(nn.Module):
    """`model.moe.Router` with an int8 weight: the same `route` (softmax in fp32, top-k, renormalised)."""

    def __init__(self, router: nn.Module, proj: Int8Linear):
        super().__init__()
        self.top_k, self.norm_topk_prob = router.top_k, router.norm_topk_prob
        self.proj = proj

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None):
        return self.route(self.proj(x), replay)

    def route(self, logits: torch.Tensor, replay: torch.Tensor | None = None):
        from flashnext.model.moe import Router

        return Router.route(self, logits, replay)


class Int8Group(Group):
    """A `Group` of int8 members: one `_weight_int8pack_mm` over their rows, split per member.

    The members' `qweight` / `scale` are row views of the group's, so nothing needs rebuilding (`build` and
    `refresh` are no-ops: a member requantized in place writes the group's tensors).
    """

    def __init__(self, members: list[Int8Linear], qweight, scale, bias):
        self.members = tuple(members)
        self.qweight, self.scale, self.bias = qweight, scale, bias
        self.sizes = [m.out_features for m in members]
        self._built = True

    @classmethod
    def from_group(cls, group: Group) -> tuple[Int8Group, list[Int8Linear]]:
        """Quantize a float `Group`'s members into one int8 weight -> (the group, its members in order). Rows are
        quantized one by one (`quantize_int8` is per output row), so member by member is the same as all at once."""
        members = [Int8Linear.from_float(m.weight.detach(), getattr(m, "bias", None)) for m in group.members]
        return cls.from_members(members), members

    @classmethod
    def from_members(cls, members: list[Int8Linear]) -> Int8Group:
        """Join int8 members (loaded from an int8 checkpoint) into one group: their rows concatenated once, each
        member's tensors then row views of the group's (as `from_group` leaves them)."""
        q, s = torch.cat([m.qweight for m in members]), torch.cat([m.scale for m in members])
        bias = None
        if any(m.bias is not None for m in members):
            like = next(m.bias for m in members if m.bias is not None)
            bias = torch.cat([m.bias if m.bias is not None else like.new_zeros(m.out_features) for m in members])
        row = 0
        for m in members:
            n = m.out_features
            m.qweight, m.scale = q[row : row + n], s[row : row + n]
            m.bias = None if m.bias is None else bias[row : row + n]
            row += n
        return cls(members, q, s, bias)

    def __call__(self, x: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, ...]:
        return torch.split(int8_linear(x, self.qweight, self.scale, self.bias), self.sizes, dim=-1)

    def build(self) -> None:
        pass

    def refresh(self) -> bool:
        return False

    def weights(self):
        raise RuntimeError("an Int8Group has no float weights (it multiplies by its int8 rows)")
