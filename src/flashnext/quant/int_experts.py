"""Weight-only int8 / int4 routed experts for CPU serving, per expert through torch's packed CPU kernels.

`QuantExperts` replaces `model.moe.Experts` (same forward signature). Its weights, per expert e:
- int8: `gate_up_q` int8 [E, 2I, D], `gate_up_s` [E, 2I]; `down_q` int8 [E, D, I], `down_s` [E, D]
  (symmetric per output row, `int_linear.quantize_int8`), multiplied by `_weight_int8pack_mm`;
- int4: asymmetric per group of `group_size` input features (32, 64 or 128: the down projection's K = I must be a
  multiple; the released model's I = 640 rules out 256), `w ~= (q - 8) * scale + zero` with q in [0, 15]; the
  codes packed by `_convert_weight_to_int4pack_for_cpu` into `gate_up_q` uint8 [E, 2I, D/2] / `down_q`
  [E, D, I/2] (output rows in multiples of 16, packed per expert: the packing interleaves rows), scales and zeros
  `gate_up_sz` [E, D/g, 2I, 2] / `down_sz` [E, I/g, D, 2], multiplied by `_weight_int4pack_mm_for_cpu`.

The kernels take one 2-D weight, so the experts run one at a time, with three paths as `Experts.forward` has:
- few assignments (decode: A = T*k, 2A < E): each assignment's expert gathered (`index_select` of its packed rows)
  and applied to its token; shapes depend on A alone, so a compiled decode step keeps it;
- a static step (the decode graph) with more assignments: every expert on every token, weighted by the routing
  (0 for an unchosen expert), as `Experts._dense`: no shape depends on the routing;
- otherwise (prefill, eager decode of a batch): the experts the step hits, each on its tokens (host counts; opaque
  to torch.compile).
int8 inside a compiled static step on CPU (the decode graph) takes neither: `_reduced` gathers each assignment's
int8 rows and upcasts them inside an fp32 product that inductor fuses into one loop (no kernel call per expert).
`experts_ref` is the plain twin: every assignment with its expert dequantised to fp32.

Legend: T tokens, D hidden, E experts, k experts per token, I expert width, A = T*k assignments, g group size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashnext.errors import ConfigError
from flashnext.model.moe import reduced_experts
from flashnext.model.state import TRAIN_STEP, Step
from flashnext.quant.int_linear import compute_dtype, dequantize_int8, int8_linear, quantize_int8, use_reference

INT4_GROUPS = (32, 64, 128)


@torch.no_grad()
def quantize_int4(w: torch.Tensor, group: int, dtype: torch.dtype = torch.bfloat16):
    """w [N, K] -> (codes int32 [N, K] in [0, 15], scale_zero [K/g, N, 2] in `dtype`): asymmetric per group.

    Scale and zero are rounded to `dtype` before the codes are chosen, so `dequantize_int4` is what the kernel
    multiplies by.
    """
    N, K = w.shape
    wg = w.float().view(N, K // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12).to(dtype)
    zero = (lo + 8 * scale.float()).to(dtype)
    q = torch.round((wg - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1) + 8).clamp_(0, 15)
    return q.to(torch.int32).view(N, K), torch.stack([scale, zero], -1).transpose(0, 1).contiguous()


def dequantize_int4(codes: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in [0, 15], scale_zero [K/g, N, 2] -> fp32 [N, K]."""
    N, K = codes.shape
    G = scale_zero.shape[0]
    sz = scale_zero.float().transpose(0, 1)  # [N, K/g, 2]
    w = (codes.float().view(N, G, K // G) - 8) * sz[..., :1] + sz[..., 1:]
    return w.view(N, K)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes int32 [N, K] -> the CPU kernel's packed uint8 [N, K/2]."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)


def check_group(group: int, D: int, I: int) -> None:
    """Raise `ConfigError` unless int4 groups of `group` fit experts of hidden D and width I (the kernel also packs
    output rows in blocks of 16)."""
    if D % 16 or I % 8:
        raise ConfigError(f"int4 experts need output rows in multiples of 16: hidden {D}, 2 x width {2 * I}")
    if group not in INT4_GROUPS:
        raise ConfigError(f"int4 group size must be one of {list(INT4_GROUPS)}, got {group}")
    bad = [k for k in (D, I) if k % group]
    if bad:
        raise ConfigError(f"int4 group size {group} does not divide the expert input width {bad[0]} (try 32)")


class QuantExperts(nn.Module):
    """Routed experts with int8 or int4 weights (see the module docstring); `Experts.forward`'s signature."""

    PARTS = ("gate_up", "down")

    def __init__(self, scheme: str, E: int, D: int, I: int, dtype: torch.dtype, weight_dtype, group: int = 64):
        super().__init__()
        if scheme not in ("int8", "int4"):
            raise ConfigError(f"expert quantization must be int8 or int4, got {scheme!r}")
        if scheme == "int4":
            check_group(group, D, I)
        self.scheme, self.num_experts, self.group = scheme, E, group
        self.hidden, self.width = D, I
        self.weight_dtype = weight_dtype  # the float experts' dtype (what a weight update must be sent in)
        if scheme == "int8":
            self.register_buffer("gate_up_q", torch.zeros(E, 2 * I, D, dtype=torch.int8))
            self.register_buffer("gate_up_s", torch.zeros(E, 2 * I, dtype=dtype))
            self.register_buffer("down_q", torch.zeros(E, D, I, dtype=torch.int8))
            self.register_buffer("down_s", torch.zeros(E, D, dtype=dtype))
        else:
            self.register_buffer("gate_up_q", torch.zeros(E, 2 * I, D // 2, dtype=torch.uint8))
            self.register_buffer("gate_up_s", torch.zeros(E, D // group, 2 * I, 2, dtype=dtype))
            self.register_buffer("down_q", torch.zeros(E, D, I // 2, dtype=torch.uint8))
            self.register_buffer("down_s", torch.zeros(E, I // group, D, 2, dtype=dtype))

    @classmethod
    @torch.no_grad()
    def from_float(cls, experts: nn.Module, scheme: str, group: int = 64) -> QuantExperts:
        """Quantize an `Experts` module expert by expert (its float tensors are left to the caller to drop)."""
        E, two_i, D = experts.gate_up_proj.shape
        dtype = experts.gate_up_proj.dtype
        q = cls(scheme, E, D, two_i // 2, compute_dtype(dtype), dtype, group)
        q.write_experts("gate_up", 0, experts.gate_up_proj)
        q.write_experts("down", 0, experts.down_proj)
        return q

    @torch.no_grad()
    def write_experts(self, which: str, start: int, w: torch.Tensor) -> None:
        """Requantize experts `[start, start + w.shape[0])` of `which` ("gate_up" [n, 2I, D] / "down" [n, D, I])."""
        qt, st = getattr(self, f"{which}_q"), getattr(self, f"{which}_s")
        for i in range(w.shape[0]):
            if self.scheme == "int8":
                q, s = quantize_int8(w[i], st.dtype)
            else:
                codes, s = quantize_int4(w[i], self.group, st.dtype)
                q = pack_int4(codes)
            qt[start + i].copy_(q)
            st[start + i].copy_(s)

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, D], down [D, I]) dequantised, fp32 (the reference's weights)."""
        if self.scheme == "int8":
            return tuple(dequantize_int8(getattr(self, f"{w}_q")[e], getattr(self, f"{w}_s")[e]) for w in self.PARTS)
        return tuple(
            dequantize_int4(self._codes(getattr(self, f"{w}_q")[e]), getattr(self, f"{w}_s")[e]) for w in self.PARTS
        )

    @staticmethod
    def _codes(packed: torch.Tensor) -> torch.Tensor:
        """The int4 codes [N, K] of a packed [N, K/2] weight (read back through the kernel: identity input)."""
        N, K = packed.shape[0], packed.shape[1] * 2
        eye = torch.eye(K, dtype=torch.bfloat16)
        G = K // INT4_GROUPS[0]
        sz = torch.stack([torch.ones(G, N), torch.full((G, N), 8.0)], -1).to(torch.bfloat16)  # scale 1, zero 8
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, INT4_GROUPS[0], sz).t().round().to(torch.int32)

    # ---- the products ------------------------------------------------------------------------------
    def _mm(self, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """x [n, K] (compute dtype) by one expert's packed weight q / its scales s -> [n, N]."""
        if self.scheme == "int8":  # `int8_linear`: the packed kernel, or dequantised where K % 16 != 0 (it crashes)
            return int8_linear(x, q, s)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, q, self.group, s)

    def _swiglu(self, x: torch.Tensor, gu_q, gu_s, d_q, d_s) -> torch.Tensor:
        """One expert on rows x [n, D] (compute dtype) -> [n, D]."""
        gate, up = self._mm(x, gu_q, gu_s).chunk(2, dim=-1)
        return self._mm(F.silu(gate) * up, d_q, d_s)

    def _expert(self, x: torch.Tensor, e) -> torch.Tensor:
        """Expert e (an int, or a 1-element int64 tensor: gathered) on rows x [n, D] -> [n, D]."""
        if isinstance(e, torch.Tensor):
            pick = lambda t: t.index_select(0, e).squeeze(0)  # noqa: E731
        else:
            pick = lambda t: t[e]  # noqa: E731
        return self._swiglu(x, pick(self.gate_up_q), pick(self.gate_up_s), pick(self.down_q), pick(self.down_s))

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, step: Step = TRAIN_STEP
    ) -> torch.Tensor:
        """x: [T, D]; experts int64 [T, k]; weights [T, k] -> [T, D] (x's dtype); `step`: a `model.state.Step`."""
        if use_reference():
            return experts_ref(self, x, experts, weights)
        T, k = experts.shape
        flat_e = experts.flatten()
        if step.static and self._fuses_dequant(x):
            return self._reduced(x, flat_e, weights).to(x.dtype)
        xc = x.to(self.gate_up_s.dtype)
        if flat_e.numel() * 2 < self.num_experts:
            out = self._gathered(xc, flat_e, weights)
        elif step.static:
            out = self._dense(xc, experts, weights)
        else:
            out = self._grouped(xc, flat_e, weights)
        return out.to(x.dtype)

    def _fuses_dequant(self, x: torch.Tensor) -> bool:
        """Whether a static step runs `_reduced`: int8, on CPU, while dynamo traces (not
        `torch.compiler.is_compiling()`, process-wide during any compile: see `model.fused._compiling`)."""
        return self.scheme == "int8" and x.device.type == "cpu" and torch.compiler.is_dynamo_compiling()

    def _reduced(self, x: torch.Tensor, flat_e: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each assignment's int8 expert gathered, upcast and scaled inside the product (fp32), as
        `Experts._reduced` for float weights -> fp32 [T, D].

        Written for inductor (a compiled static step on CPU): gather, int8 -> fp32 conversion, multiply and sum over
        the input dim fuse into one reduction loop reading each assignment's int8 rows where they lie (no copy, no
        dequantised weight in memory), the row scale applied to the sums. Measured at the bench config's experts
        (16 tokens x top-4 of 16, hidden 256, width 128, 2 threads, best of 30 under load 12-15): 0.29 ms per
        layer against 3.2 ms for `_dense`'s 32 `_weight_int8pack_mm` calls; 1 token: 0.056 against 0.18 ms
        (`benchmarks/RESULTS.md`). All in fp32, x as given (`experts_ref(..., exact_input=True)`): inductor keeps a
        fused `x.to(bf16)` in fp32 anyway (no rounding), and no kernel here needs bf16. Run eagerly (or by a
        backend without code generation) it materialises [A, 2I, D] fp32 products: only the compiled step calls it.
        """
        return reduced_experts(x, flat_e, weights, self.gate_up_q, self.down_q, self.gate_up_s, self.down_s)

    def _gathered(self, x, flat_e, weights):
        k = weights.shape[1]
        rows = [self._expert(x[a // k : a // k + 1], flat_e[a : a + 1]) for a in range(flat_e.numel())]
        if not rows:
            return torch.zeros_like(x)
        h = torch.cat(rows) * weights.reshape(-1, 1).to(x.dtype)  # [A, D]
        return h.view(-1, k, x.shape[1]).sum(1)

    def _dense(self, x, experts, weights):
        T = x.shape[0]
        w = torch.zeros(T, self.num_experts, dtype=x.dtype, device=x.device)
        w = w.scatter(1, experts, weights.to(x.dtype))
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            out = out + self._expert(x, e) * w[:, e : e + 1]
        return out

    @torch.compiler.disable  # host counts of the routing: opaque to torch.compile
    def _grouped(self, x, flat_e, weights):
        k = weights.shape[1]
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=self.num_experts).tolist()
        token = order // k
        h = torch.empty(order.numel(), x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                idx = order[start : start + n]
                h[idx] = self._expert(x.index_select(0, token[start : start + n]), e)
                start += n
        h = h * weights.reshape(-1, 1).to(x.dtype)
        return h.view(-1, k, x.shape[1]).sum(1)

    def extra_repr(self) -> str:
        g = f", group {self.group}" if self.scheme == "int4" else ""
        return f"{self.num_experts} experts, hidden {self.hidden}, width {self.width}, {self.scheme}{g}"


def experts_ref(
    mod: QuantExperts, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, exact_input: bool = False
) -> torch.Tensor:
    """The spec of `QuantExperts.forward`: each assignment's expert dequantised, fp32, summed with its weight
    (x rounded to the compute dtype first, as the kernels read it; as given with `exact_input`, as `_reduced`)."""
    xf = x.float() if exact_input else x.to(mod.gate_up_s.dtype).float()
    out = torch.zeros_like(xf)
    for e in experts.unique().tolist():
        gu, down = mod.expert_weights(e)
        tok, slot = (experts == e).nonzero(as_tuple=True)
        gate, up = (xf[tok] @ gu.t()).chunk(2, dim=-1)
        out.index_add_(0, tok, ((F.silu(gate) * up) @ down.t()) * weights[tok, slot].float().unsqueeze(-1))
    return out.to(x.dtype)
