"""The compiled prefill chunks of one request (CPU): a batch-1 prompt chunk as a few fixed-shape graphs.

See `ChunkGraph`. The graphs are `serve.decode_graph.DecodeGraph`'s machinery (one compiled step per size, bound
calls, the layout check, weights as graph inputs, the background compile) over another static step,
`model.state.make_chunk_step`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashnext.errors import ConfigError
from flashnext.model.state import make_chunk_step
from flashnext.serve.decode_graph import DecodeGraph, plain

CHUNK_LENGTHS = (1, 2, 4, 8, 16, 32, 64)  # `ChunkGraph`'s piece lengths: any prompt chunk is a sum of them


def prefill_only(plan) -> bool:
    """Whether an engine plan is one request's prompt chunk the prefill graphs can run: one entry, tokens of its
    prompt still to prefill, the request `decode_graph.plain`, and no prompt log-probs (they need every row)."""
    if len(plan) != 1:
        return False
    req, n = plan[0]
    return n >= 1 and req.num_cached < len(req.prompt_ids) and plain(req) and req.prompt_logprobs is None


class ChunkGraph(DecodeGraph):
    """The compiled (CPU) prompt chunks of one request: a batch-1 prefill as a few fixed-shape graphs.

    A prefill step holding one request's prompt chunk of n tokens (`prefill_only`) is cut into pieces whose lengths
    are compiled sizes, largest first (`pieces`: 45 tokens are 32 + 8 + 4 + 1 with the default `CHUNK_LENGTHS`),
    and each piece runs as the static step of that length (`model.state.make_chunk_step`: one entry of L tokens,
    device metadata only) compiled once per length, with everything `DecodeGraph` does for its buckets (bound
    calls, the layout check, weights as graph inputs, a background compile). Each piece continues the state the
    one before it left, as the engine's own chunked prefill does, so the logits are the eager step's up to
    summation order (inductor's fused reductions; the GDN chunk size is fitted to each piece).

    Unlike decode buckets, a length never compiles on a step: only `warmup` or `compile_in_background` make it
    ready (`ready`), and a prefill whose pieces are not all ready runs eager (a minute of compiling per length on a
    2-core CPU would otherwise stall the step that first needed it). CPU only (on CUDA prefill stays eager).

    Measured (bench config of `benchmarks/vs_llamacpp.py`, fp32, a 32-token prompt, 1 thread, CPU time): 23.4 ms
    compiled against 41.0 ms eager (`benchmarks/RESULTS.md`); at batch 1 its prefill went from 0.47-0.64x of
    llama.cpp's to 1.04-1.28x.
    """

    NAME, UNIT = "prefill", "length"

    def __init__(
        self, model, cache, lengths: Sequence[int] | None = None, backend: str = "inductor", frozen: bool = False
    ):
        if next(model.parameters()).device.type != "cpu":
            raise ConfigError("the compiled prefill chunks are CPU graphs (on CUDA, prefill runs eager)")
        super().__init__(model, cache, lengths, backend, frozen)

    @staticmethod
    def _sizes(lengths: Sequence[int] | None, max_slots: int) -> list[int]:
        chosen = CHUNK_LENGTHS if lengths is None else lengths
        if not chosen or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in chosen):
            raise ConfigError(f"prefill chunk lengths must be positive ints, got {list(chosen)}")
        return sorted(set(chosen))

    def _step(self, ids: torch.Tensor, slots: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        """The static chunk step: ids int64 [L], slots / cached int64 [1] -> logits [1, V] of the last token."""
        step = make_chunk_step(slots, cached, ids.shape[0], self.cache.scratch_slot)
        return self.model.forward_step(ids, step, self.cache)

    def _inputs(self, ids: list[int], slots: list[int], cached: list[int], N: int) -> tuple[torch.Tensor, ...]:
        """One entry of N tokens; without ids (a warm-up), N zeros into the scratch slot."""
        if not ids:
            ids, slots, cached = [0] * N, [self.cache.scratch_slot], [0]
        dev = self.device
        return tuple(torch.tensor(x, dtype=torch.long, device=dev) for x in (ids, slots, cached))

    def pieces(self, n: int) -> list[int] | None:
        """The piece lengths of an n-token chunk (compiled lengths, largest first), or None when the ready
        lengths cannot make up n."""
        out, ready = [], sorted(self.ready, reverse=True)
        for L in ready:
            while n >= L:
                out.append(L)
                n -= L
        return out if n == 0 and out else None

    def ready_for(self, n: int) -> bool:
        self._retire_if_changed()
        return not self.thawed and self.pieces(n) is not None

    def prefill(self, ids: list[int], slot: int, cached: int) -> torch.Tensor:
        """Feed `ids` to `slot` after `cached` tokens, piece by piece -> logits [1, V] of the last token (a view
        into the last graph's output, valid until the next call). Call only when `ready_for(len(ids))`."""
        lengths = self.pieces(len(ids))
        if lengths is None:
            raise RuntimeError(f"no compiled prefill lengths make up {len(ids)} tokens (ready: {sorted(self.ready)})")
        with torch.inference_mode():
            self._changed()
            if self.thawed:
                raise RuntimeError("the frozen prefill graphs were retired (the weights changed): run this chunk eager")
            start = 0
            for L in lengths:
                logits = self._call(L, *self._inputs(ids[start : start + L], [slot], [cached + start], L))
                start += L
        return logits
