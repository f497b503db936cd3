"""Sparse MoE: softmax top-k router, stacked expert weights with sort-based grouped dispatch, gated shared expert.

Serving's static decode step (`model.state.make_decode_step`) cannot read the grouped slab's capacity
(`int(counts.max())`) on the host, so beyond the gather path it runs every expert on every token (`Experts._dense`;
`_reduced` inside a compiled CPU graph in fp32, and in bf16 at few tokens: `Experts.forward` on a static step): at
decode sizes (16 tokens x top-4 of 16 experts, ~99% of experts hit) `_dense` streams the same weights as the
grouped path, with up to E/k times its FLOPs, and measured the same time (2.2 vs 2.1 ms per layer at 1 thread).

Legend: T tokens, D hidden, E experts, k experts per token, I expert width, A = T*k assignments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashnext.config import TextConfig
from flashnext.model.fused import Group, apply_linear, upcasts
from flashnext.model.state import TRAIN_STEP, Step
from flashnext.ops import grouped_experts

SKINNY_EXPERT_ROWS = 16  # at most this many rows per expert: transposed expert GEMMs (see `Experts._swiglu`)
# A serving step gathers its assignments' expert weights when they total at most this many bytes, even for more than
# E/2 assignments: below it the grouped path's dozen extra ops (sort, counts, slab) and its host read of the slab's
# capacity cost more than the copy (a speculative verify step's 2 / 4 tokens x top-2 of 8 experts of 24.6 KB: the
# grouped path 92 / 95 us a layer, the gathered 59 / 82 us; alternated, 1 thread, load ~4.5). Not on a static step.
GATHER_BYTES = 1 << 18
SORTED_ASSIGNMENTS = 2  # `reduced_experts` sorts the assignments by expert from this many per expert on


class Router(nn.Module):
    """Softmax (fp32) over expert logits, top-k, optionally renormalised."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None):
        """x: [T, D] -> (weights [T, k] in x's dtype, experts int64 [T, k]).

        `replay` (int [T, k]) forces the experts (router replay); their softmax scores are gathered and
        renormalised as usual so gradients still reach the router.
        """
        return self.route(F.linear(x, self.weight), replay)

    def route(self, logits: torch.Tensor, replay: torch.Tensor | None = None):
        """As `forward`, from the router logits [T, E]."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        if replay is None:
            top, experts = torch.topk(probs, self.top_k, dim=-1)
        else:
            experts = replay.long()
            top = probs.gather(-1, experts)
        if self.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return top.to(logits.dtype), experts


class Experts(nn.Module):
    """E SwiGLU experts as 3-D weights: gate_up_proj [E, 2I, D] (gate rows, then up rows), down_proj [E, D, I]."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, step: Step = TRAIN_STEP
    ) -> torch.Tensor:
        """x: [T, D]; experts int64 [T, k]; weights [T, k] -> [T, D].

        `step` (`model.state.Step`): a serving step uses serving GEMM layouts (`step.fused`); on a static step
        (`step.static`, `model.state.make_decode_step`) no shape may depend on the routing, so more assignments than
        the gather path takes run every expert (`_dense`), or, inside a compiled graph on CPU, each assignment's
        expert read in place (`_reduced`: fp32, and bf16 / fp16 below 2 assignments per expert, `_sums_pay`).
        """
        fused, static = step.fused, step.static
        T, k = experts.shape
        flat_e = experts.flatten()
        # Few assignments (decode), or the meta device (no routing values to size the slabs): gather path.
        small = fused and not static and self._small(flat_e.numel())  # a verify step's few tokens (`GATHER_BYTES`)
        if flat_e.numel() * 2 < self.num_experts or x.device.type == "meta" or small:
            return self._gathered(x, flat_e, weights, fused)
        # dynamo tracing, not torch.compiler.is_compiling() (process-wide during any compile: see fused._compiling)
        if static and x.device.type == "cpu" and torch.compiler.is_dynamo_compiling() and self._sums_pay(x, flat_e):
            return self._reduced(x, experts, weights)
        if static:
            return self._dense(x, experts, weights)
        return self._grouped(x, flat_e, weights, fused)

    def _sums_pay(self, x: torch.Tensor, flat_e: torch.Tensor) -> bool:
        """Whether a compiled CPU static step's experts run as `_reduced` (else `_dense`): always in fp32; in bf16 /
        fp16 below `SORTED_ASSIGNMENTS` assignments per expert. Measured on the bench config's compiled bf16 step
        (bound, 1 thread, one process, `benchmarks/RESULTS.md`): batch 4 (1 per expert) 4.9 against 8.9 ms with
        `_dense`'s oneDNN batched GEMMs over every expert; batch 16 (4 per expert) 26.8 against 12.9 ms."""
        if x.dtype == torch.float32 or upcasts(x):  # a CPU without bf16 / fp16 instructions sums in fp32 as well
            return True
        return x.dtype in (torch.bfloat16, torch.float16) and flat_e.numel() < SORTED_ASSIGNMENTS * self.num_experts

    def _small(self, assignments: int) -> bool:
        """Whether gathering `assignments` experts' weights copies at most `GATHER_BYTES` (see there)."""
        per = (self.gate_up_proj[0].numel() + self.down_proj[0].numel()) * self.gate_up_proj.element_size()
        return assignments * per <= GATHER_BYTES

    def _reduced(self, x, experts, weights):
        """Each assignment's expert applied to its row, its weights read in place (inside a compiled CPU static
        step): the hand-written kernel `ops.grouped_experts` once loaded (fp32 / bf16 weights), else
        `reduced_experts`, products summed over the input dim, written for inductor.

        `reduced_experts` fuses the weight gather into the reduction, with neither a copy nor the every-expert FLOPs
        of `_dense`: at 16 tokens x top-4 of 16 experts (hidden 256, width 128), 1 thread, 0.37 ms per layer against
        `_dense`'s 1.13 ms (MKL's fp32 batched GEMM); but one accumulator per output (stop 44): the kernel blocks
        rows against weight rows. bf16 / fp16 (fp32 sums) only below 2 assignments per expert (`_sums_pay`).
        """
        gate_up, down = self.gate_up_proj, self.down_proj
        if self._grouped_kernel(experts.numel()):
            return grouped_experts.grouped_experts(x, experts, weights, gate_up, down).to(x.dtype)
        return reduced_experts(x, experts.flatten(), weights, gate_up, down).to(x.dtype)

    def _grouped_kernel(self, assignments: int) -> bool:
        """Whether a traced static step's experts run as `ops.grouped_experts`: loaded, fp32 / bf16 weights, and at
        least `SORTED_ASSIGNMENTS` assignments per expert; with fewer the kernel's fixed cost (the op call, its ATen
        steps: ~50 us a layer) outweighs the blocks it saves. Bench config, fp32, frozen decode graphs: batch 16 (4
        per expert) 11.56 -> 10.55 ms a step, batch 1 2.70 -> 2.80 (`benchmarks/RESULTS.md`, stop 44)."""
        gate_up = self.gate_up_proj
        return (
            grouped_experts.ready()
            and gate_up.dtype in (torch.float32, torch.bfloat16)
            and gate_up.is_contiguous()
            and assignments >= SORTED_ASSIGNMENTS * self.num_experts
        )

    def _dense(self, x, experts, weights):
        """Every expert on every token, outputs summed with the routing weights (0 for an unchosen expert).

        For a decode batch (a few tokens, most experts hit) this streams each expert's weights once, as the
        grouped slab does, with up to E/k times its FLOPs (memory-bound either way at decode sizes), but its
        shapes depend on T alone: no slab capacity read from the routing, no sort.
        """
        E = self.num_experts
        T, D = x.shape
        h = self._swiglu(x.unsqueeze(0).expand(E, T, D), self.gate_up_proj, self.down_proj, fused=True)  # [E, T, D]
        w = torch.zeros(T, E, dtype=h.dtype, device=x.device).scatter(1, experts, weights.to(h.dtype))
        return (h * w.t().unsqueeze(-1)).sum(0)

    # Opaque to torch.compile: the slab's capacity is a data-dependent count (`int(counts.max())`).
    @torch.compiler.disable
    def _grouped(self, x, flat_e, weights, fused=False):
        """Sort assignments by expert, lay each expert's tokens in a [E, cap, D] slab, one batched matmul each.

        Rows move with `index_copy_`/`index_select` on the flattened slab, and each token's k outputs are summed
        in routing order (a weighted sum over `[T, k, D]`), not scattered back with `index_add`.
        """
        E = self.num_experts
        T, k = weights.shape
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=E)
        cap = int(counts.max()) if flat_e.numel() else 0
        starts = torch.cumsum(counts, 0) - counts
        sorted_e = flat_e.index_select(0, order)
        dest = sorted_e * cap + torch.arange(order.numel(), device=x.device) - starts.index_select(0, sorted_e)
        slab = x.new_zeros(E * cap, x.shape[1]).index_copy_(0, dest, x.index_select(0, order // k))
        # fp32 slabs keep the row-major products: MKL's fp32 batched GEMM in the transposed form (`_swiglu`) was
        # 1.3-2.7x slower at 3-15 rows per expert (a 32-token prefill: [16, 256, 256] x [16, 256, 13] 1.0-1.3 ms
        # against 0.45-0.49 ms row-major, 1 thread); bf16 (oneDNN) keeps the transposed form, equal or faster there.
        gate_up, down, skinny = self.gate_up_proj, self.down_proj, fused and x.dtype != torch.float32
        if fused and upcasts(x):  # no bf16 / fp16 instructions on this CPU (`fused.upcasts`): fp32, row-major
            slab, gate_up, down, skinny = slab.float(), gate_up.float(), down.float(), False
        h = self._swiglu(slab.view(E, cap, -1), gate_up, down, skinny).flatten(0, 1).to(x.dtype)  # [E*cap, D]
        row = torch.empty_like(dest).index_copy_(0, order, dest)  # slab row of every assignment, routing order
        out = h.index_select(0, row).view(T, k, -1) * weights.unsqueeze(-1)
        return out.sum(1)

    def _gathered(self, x, flat_e, weights, fused=False):
        """Few assignments (decode): gather each assignment's expert weights instead of touching all experts.

        Assignments are token-major (`experts.flatten()`), so each token's k outputs are summed as a weighted sum
        over `[T, k, D]`, not with `index_add`: on CPU a bf16 `index_add` is a `scatter_add_` that opens a parallel
        region (measured 5 us at 1 thread, 17-240 ms at 2 threads on a loaded 2-core box, once per MoE layer of a
        bf16 decode step), and it rounds to bf16 after every add where the sum accumulates in fp32.
        """
        T, k = weights.shape
        token = torch.arange(flat_e.numel(), device=x.device) // k
        h = self._swiglu(x[token].unsqueeze(1), self.gate_up_proj[flat_e], self.down_proj[flat_e], fused).squeeze(1)
        return (h.view(T, k, x.shape[-1]) * weights.unsqueeze(-1)).sum(1)

    @staticmethod
    def _swiglu(x, gate_up, down, fused=False):
        """x [G, n, D] with weights gate_up [G, 2I, D], down [G, D, I] -> [G, n, D].

        Fused (serving) with few rows per expert (decode) the gate/up product runs transposed, weights times rows
        (`W @ x.T`, as `fused.linear`): on this CPU MKL's batched GEMM with 4-10 rows per expert was ~1.2-1.5x
        faster that way; the down product keeps the row-major form (its transposed form was slower).
        """
        if fused and upcasts(x):  # no bf16 / fp16 instructions on this CPU (`fused.upcasts`): the products in fp32
            return Experts._swiglu(x.float(), gate_up.float(), down.float(), fused).to(x.dtype)
        if fused and x.device.type == "cpu" and x.shape[1] <= SKINNY_EXPERT_ROWS:
            gate, up = torch.bmm(gate_up, x.transpose(1, 2)).chunk(2, dim=1)  # [G, I, n] each
            return torch.bmm((F.silu(gate) * up).transpose(1, 2), down.transpose(1, 2))
        gate, up = torch.bmm(x, gate_up.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, down.transpose(1, 2))


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def reduced_experts(x, flat_e, weights, gate_up, down, gate_up_scale=None, down_scale=None) -> torch.Tensor:
    """`Experts._reduced`'s computation -> [T, D] in fp32 (x's dtype if wider): each assignment's expert rows
    gathered from `gate_up` [E, 2I, D] / `down` [E, D, I] (upcast as they are read) and multiplied into sums over
    the input dim; int8 codes (`quant.int_experts`) come with a row scale per expert output (`[E, 2I]` /
    `[E, D]`, multiplied into the sums).

    With at least `SORTED_ASSIGNMENTS` assignments per expert the assignments run in expert order (a stable sort of
    `flat_e`; their outputs put back in routing order before each token's weighted sum over its k experts, no
    scatter): consecutive sums then read the same expert's rows, from cache after the first. Measured on the bench
    config's compiled fp32 step (1 thread, one-process A/Bs, `benchmarks/RESULTS.md`): batch 16 (4 per expert)
    0.936x the time of routing order, whose first MoE layer had compiled to a scalar loop (its input laid out
    transposed for a GEMM); batch 8 (2 per expert) 1.007x; batch 4 (1 per expert) 1.146x, hence the bound."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    T, k = weights.shape
    w = weights.reshape(-1)
    order = None
    if flat_e.numel() >= SORTED_ASSIGNMENTS * gate_up.shape[0]:
        order = torch.argsort(flat_e, stable=True)  # assignment ids in expert order
        flat_e, w = flat_e.index_select(0, order), w.index_select(0, order)
        token = order // k
    else:
        token = torch.arange(flat_e.numel(), device=x.device) // k
    xa = x.to(dtype).index_select(0, token)  # [A, D]
    gu = (gate_up[flat_e].to(dtype) * xa[:, None, :]).sum(-1)  # [A, 2I]
    if gate_up_scale is not None:
        gu = gu * gate_up_scale[flat_e].to(dtype)
    gate, up = gu.chunk(2, dim=-1)  # [A, I] each
    h = F.silu(gate) * up
    out = (down[flat_e].to(dtype) * h[:, None, :]).sum(-1)  # [A, D]
    if down_scale is not None:
        out = out * down_scale[flat_e].to(dtype)
    out = out * w.to(dtype)[:, None]
    if order is not None:  # back to routing order
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        out = out.index_select(0, back)
    return out.view(T, k, -1).sum(1)  # each token's k experts summed


class SparseMoE(nn.Module):
    """Routed experts plus a sigmoid-gated shared expert."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = SharedExpert(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        shared = self.shared_expert
        self.router_shared = Group(self.gate, shared.gate_proj, shared.up_proj, self.shared_expert_gate)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None, step: Step = TRAIN_STEP):
        """x: [T, D] -> ([T, D], experts int64 [T, k]).

        `step` (`model.state.Step`): a serving step runs the router and the shared expert's projections as one
        prepared GEMM, and the experts as `Experts.forward` says."""
        shared = self.shared_expert
        if step.fused:
            logits, gate, up, shared_gate = self.router_shared(x, fused=True)
            weights, experts = self.gate.route(logits, replay)
            shared_out = apply_linear(shared.down_proj, F.silu(gate) * up, fused=True)
        else:
            weights, experts = self.gate(x, replay)
            shared_gate, shared_out = self.shared_expert_gate(x), shared(x)
        out = self.experts(x, experts, weights, step)
        return out + torch.sigmoid(shared_gate) * shared_out, experts
