"""torch.compile per decoder layer for training on packed streams, with one set of graphs for every packing.

What is compiled: each decoder layer's forward (norms, hyper-connection mixing, projections, PLE with its n-gram
hash and dilated conv, GDN's short conv and gates, router, shared expert) and, optionally, the final stream mixer.
What stays opaque (`torch.compiler.disable` at the op, so it runs eagerly between graphs with its own autograd and
its eager numerics): the pieces whose shapes come from host metadata or data, which a traced graph would specialise
on, recompiling for every packing:

- `ops.deltanet.chunk_gated_delta_rule` (chunk layout, scan step count from the host lengths),
- `model.attention.QSAIndexer.forward` (block starts from the host lengths; no grad, its selection is discrete),
- `ops.qsa.sparse_attention` (block-aligned layout rows, chunk loop),
- `model.moe.Experts._grouped` (the expert slab's capacity is `int(counts.max())`).

They receive the `Segments` object, never its host lists: dynamo guards on a Python list it reads (length and
every element), but not on an object it only passes through, so no guard mentions a sequence length or count.
Why not `torch.library.custom_op`s: their fake impls would be easy (outputs sized by inputs), but three of the four
need a backward, which without hand-written gradients means recomputing the op's forward in `register_autograd`'s
backward, about half of the model's forward again per step, against one graph break each (measured eager on the
benchmark config, 16 packed sequences, T = 1207: the three ops' forwards are about half of the model's forward,
the delta rule alone a third).

Dynamic dims: the token dim T of every layer input (residual, ids, rope, the per-token `Segments` tensors) and
`cu_seqlens` dim 0 are marked *maybe*-dynamic before each call (`torch._dynamo.maybe_mark_dynamic`): the first
compile is already shape-generic, and a dim that the trace does specialise (T == 1, or cu_seqlens of a single
sequence read as size 2) just gets a guard and a graph of its own instead of raising `ConstraintViolationError` as
`mark_dynamic` does. Graph segments after an opaque op see fresh tensors, so they start static and turn dynamic at
their first new T (automatic dynamic shapes): after one single-sequence and one multi-sequence step no packing
recompiles. Those automatic-dynamic dims are made *unbacked* (`automatic_dynamic_shapes_mark_as="unbacked"`,
patched around each compiled call, not globally): with a backed T, inductor's CPU codegen would guard its choice of
accumulator for fp32 sums over > 4096 elements, compiling the token-reducing backward graphs once more when T first
crosses that; unbacked, it decides without a guard.
Layers of equal structure share graphs (dynamo caches per code object), so a model needs about
2 x (distinct layer kinds) entries per code object; the compiled regions get their own `recompile_limit` (16,
`torch.compile`'s per-region argument) instead of changing the global dynamo config. No other knob is needed:
`capture_scalar_outputs` would only matter for the MoE capacity, which stays in an opaque op.

Order with activation checkpointing: `compile_model` first, then `activation_checkpoint.apply_activation_checkpointing`.
The checkpoint then wraps the compiled layer from outside (eager non-reentrant checkpoint; the recompute re-runs
the same compiled graphs). The other order would ask dynamo to trace the checkpoint region as one higher-order op,
which the graph breaks at the opaque ops do not allow; `compile_model` refuses a checkpointed model.
"""

from __future__ import annotations

import torch
from torch import nn

from flashnext.batch import Segments
from flashnext.errors import ConfigError

RECOMPILE_LIMIT = 16  # per code object: static + dynamic graph per distinct layer kind, with margin
AUTOMATIC_DYNAMIC_AS = "unbacked"  # see the module docstring: no size guard once a dim has turned dynamic


def mark_dynamic_batch(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *tensors_T: torch.Tensor | None,
) -> None:
    """Mark a packed batch's token dim, and `cu_seqlens` dim 0, maybe-dynamic for torch.compile.

    *Maybe* keeps dynamo's shape guards: a graph that specialises a dim (one sequence: cu_seqlens of size 2) gets a
    guard instead of a `ConstraintViolationError`.

    Args:
        input_ids: int [T] flat token ids.
        cu_seqlens: int32 [N+1].
        position_ids: int64 [T] or [3, T] (its last dim is the token dim).
        *tensors_T: further per-token tensors whose dim 0 is T (labels, advantages, residual streams...).
    """
    for t in (input_ids, *tensors_T):
        if t is not None and t.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    if cu_seqlens is not None:
        torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
    if position_ids is not None:
        torch._dynamo.maybe_mark_dynamic(position_ids, position_ids.dim() - 1)


def _mark_segments(seg: Segments) -> None:
    mark_dynamic_batch(seg.seq_idx, seg.cu_seqlens, seg.position_ids, seg.seq_start, seg.pos_in_seq)


def _compiled_forward(fn, **compile_kwargs):
    """`fn` compiled, called with maybe-dynamic T on its tensor arguments (and `Segments` fields)."""
    compiled = torch.compile(fn, **compile_kwargs)

    def forward(*args, **kwargs):
        for a in (*args, *kwargs.values()):
            if isinstance(a, Segments):
                _mark_segments(a)
            elif isinstance(a, torch.Tensor):
                mark_dynamic_batch(a)
            elif isinstance(a, tuple):  # rope = (cos, sin)
                mark_dynamic_batch(*(t for t in a if isinstance(t, torch.Tensor)))
        with torch._dynamo.config.patch(automatic_dynamic_shapes_mark_as=AUTOMATIC_DYNAMIC_AS):
            return compiled(*args, **kwargs)

    return forward


def compile_model(
    model: nn.Module,
    *,
    backend: str = "inductor",
    fullgraph: bool = False,
    mode: str | None = None,
    final_mixer: bool = True,
) -> int:
    """Compile every decoder layer of `model` (a `FlashNextForCausalLM`) in place; returns the number compiled.

    Each layer's `forward` is replaced on the instance (as activation checkpointing does), so parameter names and
    the state dict are those of the plain model. Idempotent. Apply before `apply_activation_checkpointing`.

    Args:
        backend: `torch.compile` backend ("inductor"; "aot_eager" traces the same graphs without code generation).
        fullgraph: must stay False with the opaque ops (each is a deliberate graph break); True raises on them.
        mode: `torch.compile` mode (e.g. "max-autotune-no-cudagraphs").
        final_mixer: also compile the final hyper-connection stream mixer before the LM head.
    """
    kwargs = dict(backend=backend, fullgraph=fullgraph, mode=mode, dynamic=None, recompile_limit=RECOMPILE_LIMIT)
    decoder = model.decoder  # the text decoder, of either model
    modules = list(decoder.layers)
    if final_mixer:
        modules.append(decoder.hyper_connection_mixer)
    compiled = 0
    for module in modules:
        if getattr(module, "_flashnext_checkpointed", False):
            raise ConfigError(
                "compile_model must run before apply_activation_checkpointing: a checkpointed layer cannot be "
                "traced as one region (the opaque ops break the graph)"
            )
        if getattr(module, "_flashnext_compiled", False):
            continue
        module.forward = _compiled_forward(module.forward, **kwargs)
        module._flashnext_compiled = True
        compiled += 1
    return compiled
