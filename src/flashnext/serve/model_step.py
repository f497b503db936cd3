"""One model forward over a step's plan, behind one call whichever variant runs it.

`ModelStep(plan)` runs the (request, tokens to feed) pairs `serve.scheduler` planned as one flat stream:
- the decode graph (`serve.decode_graph`), compiled (CPU) / captured (CUDA): a decode-only step without
  speculation, MRoPE or routing, once its batch bucket is ready;
- the prefill graphs (`serve.chunk_graph.ChunkGraph`, CPU): a step holding only one request's plain prompt chunk
  (`prefill_only`), once the lengths that make it up are compiled;
- the speculative step (`serve.speculative.Speculator.forward`): a step where a request carries MTP drafts;
- else the eager `forward_step` (prefill chunks, mixed steps), with the prompt positions whose log-probs were
  asked (`serve.prompt_logprobs`) and the embeddings of image prompts (the vision tower runs once per request).
"""

from __future__ import annotations

import torch

from flashnext.model.state import VERIFY, make_step
from flashnext.serve import prompt_logprobs
from flashnext.serve.cache import StateCache
from flashnext.serve.chunk_graph import ChunkGraph, prefill_only
from flashnext.serve.decode_graph import DecodeGraph, decode_only
from flashnext.serve.request import Request
from flashnext.serve.speculative import Speculator

__all__ = ["ModelStep"]


class ModelStep:
    """The model's forward for a step plan: eager, decode graph or speculative (see the module doc)."""

    def __init__(
        self,
        model,
        cache: StateCache,
        device,
        speculator: Speculator | None,
        decode_graph: DecodeGraph | None,
        chunk_graph: ChunkGraph | None = None,
    ):
        self.model = model
        self.cache = cache
        self.device = device
        self.speculator = speculator
        self.decode_graph = decode_graph
        self.chunk_graph = chunk_graph

    def __call__(self, plan: list[tuple[Request, int]]):
        """One `forward_step` over the plan's stream: logits [entries.., V] of every entry's last token, or, when a
        request of the step speculates, the `SpecForward` (verified rows, residual) `serve.speculative` needs; the
        stream's routed experts [T, L, k] when a request of the plan asked for them (else None); and the prompt
        positions whose log-probs were asked, with their logits (`serve.prompt_logprobs`; None when none). A
        decode-only step without speculation or routing runs as the decode graph, when the engine has one."""
        if self.decode_graph is not None and decode_only(plan) and self.decode_graph.ready_for(len(plan)):
            return self.decode_graph.run(*_decode_inputs(plan)), None, None
        if self.chunk_graph is not None and prefill_only(plan) and self.chunk_graph.ready_for(plan[0][1]):
            req, n = plan[0]
            return self.chunk_graph.prefill(req.pending_ids(n), req.slot, req.num_cached), None, None
        ids, cu, slots, cached = [], [0], [], []
        for req, n in plan:
            chunk = req.pending_ids(n) + req.drafts
            ids.extend(chunk)
            cu.append(cu[-1] + len(chunk))
            slots.append(req.slot)
            cached.append(req.num_cached)
        mrope = [req.mrope for req, _ in plan]
        kind = VERIFY if any(req.drafts for req, _ in plan) else None  # else decode or prefill, by the lengths
        step = make_step(cu, slots, cached, self.cache.scratch_slot, self.device, mrope=mrope, kind=kind)
        scored = prompt_logprobs.prompt_rows(plan, cu)
        extra = prompt_logprobs.stream_rows(scored)
        with torch.inference_mode():
            ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
            embeds = self._prompt_embeds(plan, ids_t, cu)
            routing = any(req.params.return_routed_experts for req, _ in plan)
            if self.speculator is not None and any(req.spec_k for req, _ in plan):
                out, routed, prompt = self.speculator.forward(ids_t, step, embeds, plan, cu, routing, extra)
                return out, routed, (scored, prompt) if scored else None
            kw = {"return_routing": True} if routing else {}
            if scored:  # the usual last-token rows, then the prompt positions to score
                kw["rows"] = torch.tensor([c - 1 for c in cu[1:]] + extra, dtype=torch.long, device=self.device)
            out = self.model.forward_step(ids_t, step, self.cache, inputs_embeds=embeds, **kw)
            logits, routed = out if routing else (out, None)
            if scored:
                return logits[: len(plan)], routed, (scored, logits[len(plan) :])
            return logits, routed, None

    def greedy_run(self, plan: list[tuple[Request, int]], steps: int) -> tuple[list[list[int]], torch.Tensor]:
        """A decode run (`serve.decode_runs`) of `steps` decode-graph steps over a decode-only plan, each fed the
        greedy tokens of the one before: (the early steps' tokens, the last step's logits)."""
        return self.decode_graph.run_greedy(*_decode_inputs(plan), steps)

    def _prompt_embeds(self, plan, ids: torch.Tensor, cu: list[int]) -> torch.Tensor | None:
        """The step's input embeddings when an entry is a chunk of an image prompt, else None (token embeddings).

        An image request's first chunk runs the vision tower once over its images and keeps the whole prompt's
        embeddings (features scattered into the placeholders) until its prefill ends. A chunk that runs past the
        prompt (a recompute) keeps the token embeddings of its generated tokens.
        """
        image_entries = [
            i for i, (req, _) in enumerate(plan) if req.mrope is not None and req.num_cached < len(req.prompt_ids)
        ]
        if not image_entries:
            return None
        for i in image_entries:
            req = plan[i][0]
            if req.prompt_embeds is None:
                pixel_values, grid = req.images
                prompt = torch.tensor(req.prompt_ids, dtype=torch.long, device=self.device)
                req.prompt_embeds = self.model.embed(prompt, pixel_values.to(self.device), grid.to(self.device))
        embeds = self.model.embed(ids, None, None)
        for i in image_entries:
            req, n = plan[i]
            k = min(n, len(req.prompt_ids) - req.num_cached)
            embeds[cu[i] : cu[i] + k] = req.prompt_embeds[req.num_cached : req.num_cached + k]
        return embeds


def _decode_inputs(plan) -> tuple[list[int], list[int], list[int]]:
    """A decode-only plan's (tokens fed, slots, cached lengths) for the decode graph."""
    return [req.pending_ids(1)[0] for req, _ in plan], [req.slot for req, _ in plan], [r.num_cached for r, _ in plan]
