"""Routed experts kept in block-scaled FP8 (the official FP8 checkpoint's layout), dequantised per step on use.

`Fp8Experts` replaces a layer's `Experts` when the checkpoint stores them in FP8 (`use_fp8_experts`, called from
`build.from_pretrained`). It holds the stacked weights as the checkpoint gives them, one byte per value:
`gate_up_proj [E, 2I, D]` and `down_proj [E, D, I]` in float8_e4m3fn, and their 128 x 128 block multipliers
`gate_up_proj_scale_inv [E, 2*gi, gd]` (gate blocks, then up blocks) and `down_proj_scale_inv [E, gd, gi]` (in the
stored scale dtype; gi = ceil(I/128), gd = ceil(D/128)). Buffers, not parameters: nothing trains them, and
model-wide dtype casts (`model.to(torch.bfloat16)`) change only the compute dtype (`self.dtype`), never the stored
bytes; device moves and `to_empty` apply as usual (`_apply`).

A step dequantises only the experts it touches (`ops.fp8_blocks.dequantize_blocks`) into a scratch buffer of the
compute dtype that every FP8 layer of the model shares and reuses (layers run one after another), then runs the
plain `Experts` math over that compact set: `Experts._grouped` with the assignments renumbered. A static serving
step (no shape may depend on the routing) dequantises each assignment's expert instead and runs the gather path.
The reference twin is `reference_experts`: every expert dequantised into a plain `Experts`.

Legend: T tokens, D hidden, E experts, k experts per token, I expert width, A = T*k assignments, n touched experts.
"""

from __future__ import annotations

import torch
from torch import nn

from flashnext.model.moe import Experts
from flashnext.model.state import TRAIN_STEP, Step
from flashnext.ops.fp8_blocks import BLOCK, FP8_DTYPE, dequantize_blocks, quantize_blocks

DEQUANT_CHUNK = 16  # experts dequantised at once (bounds the fp32 temporaries to 16 experts' worth)


class ExpertScratch:
    """The compute-dtype buffers the touched experts are dequantised into, shared by every FP8 layer of a model and
    grown on demand (to the largest number of experts one layer touched so far)."""

    def __init__(self):
        self._bufs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def take(self, n: int, gate_up_shape, down_shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Views `[n, 2I, D]` and `[n, D, I]` of the buffers for this shape, dtype and device."""
        key = (tuple(gate_up_shape), tuple(down_shape), dtype, torch.device(device))
        held = self._bufs.get(key)
        if held is None or held[0].shape[0] < n:
            held = (torch.empty(n, *gate_up_shape, dtype=dtype, device=device),
                    torch.empty(n, *down_shape, dtype=dtype, device=device))  # fmt: skip
            self._bufs[key] = held
        return held[0][:n], held[1][:n]


class _Touched:
    """The experts a step touches, dequantised: what `Experts._grouped` reads from `self`."""

    _grouped = Experts._grouped
    _swiglu = staticmethod(Experts._swiglu)

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        self.gate_up_proj, self.down_proj, self.num_experts = gate_up, down, gate_up.shape[0]


class Fp8Experts(nn.Module):
    """E SwiGLU experts stored in block-scaled FP8 (see the module doc), computing in `dtype`.

    Args:
        num_experts, hidden, width: E, D and I.
        dtype: the compute dtype of the dequantised experts (the model's).
        scale_dtype: dtype of the stored block multipliers (BF16 in the official checkpoint).
        scratch: the shared dequantisation buffers (a new one when None).
        device: where the buffers are allocated (`meta` to fill them later from a checkpoint).
    """

    def __init__(self, num_experts, hidden, width, *, dtype, scale_dtype=torch.bfloat16, scratch=None, device=None):
        super().__init__()
        E, D, I = num_experts, hidden, width
        gi, gd = -(-I // BLOCK), -(-D // BLOCK)
        self.num_experts, self.width, self.dtype = E, I, dtype
        self.scratch = scratch if scratch is not None else ExpertScratch()
        self.register_buffer("gate_up_proj", torch.empty(E, 2 * I, D, dtype=FP8_DTYPE, device=device))
        self.register_buffer("down_proj", torch.empty(E, D, I, dtype=FP8_DTYPE, device=device))
        self.register_buffer("gate_up_proj_scale_inv", torch.ones(E, 2 * gi, gd, dtype=scale_dtype, device=device))
        self.register_buffer("down_proj_scale_inv", torch.ones(E, gd, gi, dtype=scale_dtype, device=device))

    requantized = ("gate_up_proj", "down_proj")  # a weight update in a float dtype is requantised into these

    @torch.no_grad()
    def requantize_(self, name: str, start: int, rows: torch.Tensor) -> None:
        """Experts `[start, start + n)` of `name` (`gate_up_proj` rows [n, 2I, D] or `down_proj` [n, D, I]) given in
        a float dtype (a trainer's weights): quantised in place with fresh block scales, gate and up separately."""
        I = self.width
        q_all, s_all = self._buffers[name], self._buffers[f"{name}_scale_inv"]
        halves = 2 if name == "gate_up_proj" else 1
        g = s_all.shape[1] // halves
        for i in range(rows.shape[0]):
            for h in range(halves):
                part = rows[i, h * I : (h + 1) * I] if halves == 2 else rows[i]
                q, s = quantize_blocks(part.to(q_all.device), scale_dtype=s_all.dtype)
                q_all[start + i, h * I : h * I + q.shape[0]] = q
                s_all[start + i, h * g : (h + 1) * g] = s

    def _apply(self, fn, recurse: bool = True):
        # A byte view of each buffer goes through `fn`: moves and to_empty apply, dtype casts do not (the compute
        # dtype follows them instead), as for the stored n-gram tables.
        device = None
        for name, buf in list(self._buffers.items()):
            raw = fn(buf.reshape(-1).view(torch.uint8))
            self._buffers[name] = raw.view(buf.dtype).reshape(buf.shape)
            device = raw.device
        self.dtype = fn(torch.empty(0, dtype=self.dtype, device=device)).dtype
        return self

    @property
    def nbytes(self) -> int:
        """Bytes the stored experts keep in memory (FP8 weights and their scales)."""
        return sum(b.nbytes for b in self._buffers.values())

    def dequantize(self, ids: torch.Tensor, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts `ids` (int [n]) in the compute dtype: (gate_up [n, 2I, D], down [n, D, I]), written into `out`
        (a pair of such tensors) when given, `DEQUANT_CHUNK` experts at a time."""
        I, n = self.width, ids.numel()
        gi = self.gate_up_proj_scale_inv.shape[1] // 2
        if out is None:
            out = (torch.empty(n, *self.gate_up_proj.shape[1:], dtype=self.dtype, device=ids.device),
                   torch.empty(n, *self.down_proj.shape[1:], dtype=self.dtype, device=ids.device))  # fmt: skip
        gate_up, down = out
        for a in range(0, n, DEQUANT_CHUNK):
            e = ids[a : a + DEQUANT_CHUNK]
            gu, s = self.gate_up_proj.index_select(0, e), self.gate_up_proj_scale_inv.index_select(0, e)
            b = a + e.numel()
            # gate and up rows were separate tensors on disk, each with its own grid
            gate_up[a:b, :I] = dequantize_blocks(gu[:, :I], s[:, :gi], self.dtype)
            gate_up[a:b, I:] = dequantize_blocks(gu[:, I:], s[:, gi:], self.dtype)
            dq, ds = self.down_proj.index_select(0, e), self.down_proj_scale_inv.index_select(0, e)
            down[a:b] = dequantize_blocks(dq, ds, self.dtype)
        return gate_up, down

    def forward(self, x, experts, weights, step: Step = TRAIN_STEP) -> torch.Tensor:
        """x: [T, D]; experts int64 [T, k]; weights [T, k] -> [T, D] (as `Experts.forward`)."""
        flat_e = experts.flatten()
        if step.static or x.device.type == "meta":
            return self._per_assignment(x, flat_e, weights, step.fused)
        return self._touched(x, flat_e, weights, step.fused)

    def _per_assignment(self, x, flat_e, weights, fused):
        """Each assignment's expert dequantised, then the gather path (static shapes: nothing read on the host)."""
        k = weights.shape[1]
        token = torch.arange(flat_e.numel(), device=x.device) // k
        gate_up, down = self.dequantize(flat_e)
        h = Experts._swiglu(x[token].unsqueeze(1), gate_up, down, fused).squeeze(1)
        return x.new_zeros(x.shape).index_add(0, token, h * weights.flatten()[:, None])

    @torch.compiler.disable  # the number of touched experts is read on the host
    def _touched(self, x, flat_e, weights, fused):
        """The touched experts dequantised once into the shared scratch, then the grouped path over them."""
        used, local = torch.unique(flat_e, return_inverse=True)
        shapes = (self.gate_up_proj.shape[1:], self.down_proj.shape[1:], self.dtype, x.device)
        if torch.is_grad_enabled() and x.requires_grad:  # autograd keeps the weights: no buffer shared across layers
            out = None
        else:
            out = self.scratch.take(used.numel(), *shapes)
        gate_up, down = self.dequantize(used, out)
        return _Touched(gate_up, down)._grouped(x, local, weights, fused)


def reference_experts(fp8: Fp8Experts) -> Experts:
    """The reference twin: a plain `Experts` holding every expert of `fp8` dequantised to its compute dtype."""
    E, I = fp8.num_experts, fp8.width
    D = fp8.gate_up_proj.shape[-1]
    gate_up, down = fp8.dequantize(torch.arange(E, device=fp8.gate_up_proj.device))
    with torch.device("meta"):
        ref = Experts(_Shape(E, D, I))
    ref.gate_up_proj, ref.down_proj = nn.Parameter(gate_up, False), nn.Parameter(down, False)
    return ref


class _Shape:
    """The three config fields `Experts.__init__` reads."""

    def __init__(self, num_experts, hidden_size, moe_intermediate_size):
        self.num_experts, self.hidden_size, self.moe_intermediate_size = num_experts, hidden_size, moe_intermediate_size


def use_fp8_experts(model: nn.Module, scale_dtypes: dict[str, torch.dtype], dtype: torch.dtype) -> None:
    """Replace the `Experts` modules named in `scale_dtypes` (our module names) by `Fp8Experts` on `meta`, sharing
    one scratch; call on a model still on `meta` (before `to_empty`), like the n-gram storage swap."""
    scratch = ExpertScratch()
    for name, scale_dtype in scale_dtypes.items():
        old = model.get_submodule(name)
        E, two_i, D = old.gate_up_proj.shape
        new = Fp8Experts(E, D, two_i // 2, dtype=dtype, scale_dtype=scale_dtype, scratch=scratch, device="meta")
        model.set_submodule(name, new)
