"""Continuous-batching inference engine over a `StateCache`: the wiring of its parts.

`serve.intake` checks and builds requests; `serve.scheduler` queues them, assigns slots, plans each step (chunked
prefill) and preempts; `serve.model_step` runs the plan (eager, decode graph or speculative); `serve.sampler`
samples and checks stops; `serve.outcomes` records each request's tokens, ends it and tells its client;
`serve.speculative` verifies and proposes drafts; `serve.weight_update` copies weights.

Every `step()`:
1. applies cancellations and admits queued requests (thread-safe hand-off from other threads);
2. schedules a flat stream: one decode token for every running request first, then prompt chunks of requests
   still prefilling, then newly admitted requests (each takes a free slot; a request with n choices takes n),
   while the step's token budget `max_num_batched_tokens` lasts, so long prompts are prefilled in chunks;
3. runs `model.forward_step` once on that stream (the same layers as training);
4. samples a token for every entry that reached the end of its known tokens, records log-probs, checks stop
   conditions, and frees a finished request's slot at once (its state is wiped; the slot is reusable next step).

n choices (`SamplingParams.n`): the prompt is prefilled once, in the parent's slot; when its last chunk is done
the parent's state is copied into the n-1 slots its children reserved at admission (`StateCache.copy_slot`) and
every choice samples its first token from the same logits row with its own generator (`choice_seed`).

Speculative decoding (a model with an MTP head; `num_speculative_tokens` per engine or per request): a
speculating request's decode entry also carries the drafts its head proposed, one step verifies them, and a
rejection rolls its slot back; see `serve.speculative` (proposal, acceptance, rollback). Requests with and
without speculation, prompt chunks and decodes share a step.

Decode graph (`decode_graph=True`): a decode-only step (every entry one token past its prefilled prompt, no
MRoPE, no speculating request) runs as `serve.decode_graph.DecodeGraph`'s fixed-shape step, compiled (CPU) or
captured (CUDA) once per batch bucket; every other step (prefill chunks, speculative draft/verify steps) stays
eager, and so does a decode step whose bucket is still compiling in the background (`compile_in_background`).
On CPU, a step holding one request's plain prompt chunk runs as compiled pieces (`ChunkGraph`) once their
lengths are compiled (`engine.chunk_graph.warmup()`, or `serve`'s background compile after the decode buckets).
Their logits are the eager step's to float rounding (tested). With `decode_run=K`, up to K decode-graph steps of
greedy requests run back to back in one `step()` and are recorded as K steps (`serve.decode_runs`).

Failures never end a bystander (one request's fault costs that request alone, finish reason "error"):
- a row whose logits are not finite, or whose sampling or stop check raises, ends that request only;
- a step whose model forward raises may have written part of every involved slot's state (the layers update the
  cache in place, layer by layer), so none of them can continue from its slot. The engine knows each request's
  whole token history (prompt + generated ids), so it resets those slots and recomputes the requests from
  scratch, as vLLM's recompute preemption does, instead of failing them. Which entry made the step fail is
  unknown, so the involved requests become suspects and run one per step (alone) until each has recomputed its
  history and sampled again: one that fails alone is the culprit and ends with "error"; the rest continue as if
  nothing happened (their tokens are those of an undisturbed run, up to float rounding of a different chunking).
  A step of a single request that fails ends that request. Each recovery round gives every suspect one more
  token, so even a failure caused by the batch as a whole (not by one request) cannot loop forever. The common,
  failure-free path pays nothing for this: one try around the forward, and no per-step host work.

Images (a composite model): a request may carry `pixel_values` + `image_grid_thw` for the placeholder spans in its
prompt. Its MRoPE positions (`get_rope_index`) and delta are computed when it is queued; when it is first
scheduled, the vision tower runs once and its features are scattered into the whole prompt's embeddings, which
the prompt's chunks (chunking across an image is fine: the text path is causal) feed to `forward_step` instead of
token embeddings. The embeddings are dropped when the prompt is prefilled; the pixels stay on the request until it
finishes, so a recompute can run the tower again. Decode tokens rotate at `row + delta` on all three axes.

`generate(prompts, params)` is the synchronous API; the HTTP server drives `step()` from a background thread and
streams through each request's `on_update` callback.

RL (`flashnext.rl`): a request can ask for the routed experts of every token the model runs for it
(`return_routed_experts`, recorded from the step's routing) and for log-probs of the distribution it samples
(`logprobs_mode="processed"`). `load_weights` copies a trainer's new weights into the model in place between steps
(the fused serving weights rebuild themselves on next use); with `admitting = False` the engine finishes its running
requests without starting queued ones, which is how a weight update waits for in-flight requests (none is lost,
each runs on one version of the weights: `weight_version`, recorded per request).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from flashnext.errors import ConfigError
from flashnext.serve import decode_runs, frozen, prompt_logprobs
from flashnext.serve.cache import StateCache
from flashnext.serve.chunk_graph import ChunkGraph
from flashnext.serve.decode_graph import DecodeGraph
from flashnext.serve.intake import Intake, check_speculative
from flashnext.serve.model_step import ModelStep
from flashnext.serve.outcomes import Outcomes
from flashnext.serve.prefix_cache import DEFAULT_BLOCK_SIZE, DEFAULT_BUDGET_MB, PrefixCache
from flashnext.serve.prepare import prepare_for_inference
from flashnext.serve.request import Completion, Request
from flashnext.serve.sampler import Sampler
from flashnext.serve.sampling import SamplingParams
from flashnext.serve.scheduler import Scheduler
from flashnext.serve.spec_auto import AutoSpec, is_auto
from flashnext.serve.spec_costs import kept_for
from flashnext.serve.speculative import SpecForward, Speculator
from flashnext.serve.stats import EngineStats
from flashnext.serve.weight_update import copy_pieces

__all__ = ["Completion", "Engine", "EngineStats", "Request"]

log = logging.getLogger("flashnext.serve")


class Engine:
    """Request queue, continuous-batching scheduler and sampler around a model and its state cache.

    Args:
        model: a `FlashNextForCausalLM` or the composite model (prepared here: eval mode, fused serving weights).
        tokenizer: optional; needed for text prompts and stop strings (`encode`, `decode`, `eos_token_id`).
        max_slots: concurrent sequences (cache slots).
        max_model_len: longest prompt + generation.
        max_num_batched_tokens: token budget of one step (decodes first, then prompt chunks).
        num_speculative_tokens: default draft tokens per step for requests that do not set
            `SamplingParams.num_speculative_tokens` (0 = off); needs a model with an MTP head. "auto": each such
            request drafts what pays, 0 when nothing does (`serve.spec_auto`; off for a model without a head).
        decode_graph: run decode-only steps as the compiled (CPU) / captured (CUDA) fixed-shape step of
            `serve.decode_graph` (prefill and speculative steps stay eager); False: every step eager.
        decode_buckets: the batch sizes decode steps are padded to (default `decode_graph.DEFAULT_BUCKETS`).
        prefill_lengths: CPU with `decode_graph`: the piece lengths of the compiled batch-1 prompt chunks
            (`chunk_graph.ChunkGraph`; default `chunk_graph.CHUNK_LENGTHS`; empty: none, prefill stays eager).
        compile_backend: torch.compile backend of the CPU decode graph ("inductor").
        freeze_weights: CPU with `decode_graph`: compile the graphs with the weights frozen into them (faster
            products at 2+ rows; `serve.decode_graph`'s module doc); weight loads are then refused.
        prefix_cache: reuse the state of prompt prefixes seen before (`serve.prefix_cache`); False: prefill every
            prompt whole.
        prefix_cache_mb: the prefix cache's budget in MiB (on the cache's device).
        prefix_block_size: tokens per prefix-cache block (a multiple of the GDN chunk and the QSA block).
        decode_run: with `decode_graph`, up to this many greedy decode steps per `step()` (`serve.decode_runs`).

    Raises:
        ConfigError: `num_speculative_tokens` > 0 for a model without an MTP head, or out of range; bad `decode_run`.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        max_slots: int = 16,
        max_model_len: int = 2048,
        max_num_batched_tokens: int = 512,
        num_speculative_tokens: int | str = 0,
        decode_graph: bool = False,
        decode_buckets: Sequence[int] | None = None,
        prefill_lengths: Sequence[int] | None = None,
        compile_backend: str = "inductor",
        freeze_weights: bool = False,
        prefix_cache: bool = True,
        prefix_cache_mb: float = DEFAULT_BUDGET_MB,
        prefix_block_size: int = DEFAULT_BLOCK_SIZE,
        decode_run: int = 1,
    ):
        k = check_speculative(num_speculative_tokens, model)
        self.decode_run = decode_runs.checked(decode_run, decode_graph)
        self.model = prepare_for_inference(model)
        self.config = model.config
        self.tokenizer = tokenizer
        self.cache = StateCache(model, max_slots, max_model_len)
        self.device = next(model.parameters()).device
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max(1, max_num_batched_tokens)
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.eos_id = eos if eos is not None else self.config.eos_id
        self.prefix_cache = PrefixCache(self.cache, model, prefix_block_size, prefix_cache_mb) if prefix_cache else None
        self._weights_generation = 0  # bumped by every weight load: the prefix cache's blocks of older weights go
        self.scheduler = Scheduler(self.cache, self.prefix_cache)
        self.waiting, self.running = self.scheduler.waiting, self.scheduler.running  # the scheduler's, shared
        self.sampler = Sampler(tokenizer, self.eos_id, max_model_len)
        self.stats = EngineStats()
        self.admitting = True  # False: finish the running requests, start no queued one (a weight update waits)
        self.weight_version = 0  # bumped by whoever updates the weights; recorded on each admitted request
        self.num_speculative_tokens = k
        has_mtp = model.mtp is not None
        self.speculator = Speculator(self.model, self.cache, max_model_len, self.stats) if has_mtp else None
        if self.speculator is not None:
            self.speculator.controls = self.sampler.controls  # one table of token counts per request
        self.spec_auto = None
        if is_auto(num_speculative_tokens) and has_mtp:  # what earlier engines over this model measured, kept
            costs = (str(self.device), next(model.parameters()).dtype, bool(decode_graph), freeze_weights)
            self.spec_auto = AutoSpec(kept=kept_for(self.model, costs))
        if self.spec_auto is not None:
            self.speculator.auto = self.spec_auto
            self.stats.low_acceptance_warned = True  # no "drafting does not pay" warning: auto stops drafting then
        self.frozen = freeze_weights  # weights folded into the graphs: weight loads refused
        self.decode_graph, self.chunk_graph = _graphs(  # decode-only steps, batch-1 prompt chunks (CPU) as graphs
            self.model, self.cache, decode_graph, decode_buckets, prefill_lengths, compile_backend, freeze_weights
        )
        self.intake = Intake(self.model, tokenizer, self.cache.max_slots, max_model_len, k, self.speculator is not None)
        self.max_prompt_bytes = self.intake.max_prompt_bytes  # a longer text prompt is refused before tokenizing
        self.model_step = ModelStep(
            self.model, self.cache, self.device, self.speculator, self.decode_graph, self.chunk_graph
        )
        self.outcomes = Outcomes(self.scheduler, self.sampler, self.stats, self.speculator)  # records, ends, notifies

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        on_update: Callable[[Request], None] | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        group: str | None = None,
        length_field: str | None = None,
    ) -> Request:
        """Validate and queue a request (thread-safe). Raises `InputError` for an impossible request.

        Returns the request (choice 0); with `params.n > 1` its `choices` lists all n (children are
        `<request_id>/<i>`), and `abort(request_id)` cancels them all. `on_update` is called (on the engine
        thread) with the choice that progressed or finished.

        `pixel_values` [sum t*h*w, P] and `image_grid_thw` int [n, 3] (`flashnext.vision_inputs.process_images`)
        give the images of the prompt's placeholder spans, in order (composite models only). `group`: the id
        `abort` cancels it by (default `request_id`; the prompts of one batched HTTP request share one).
        `length_field`: the client's name for `max_tokens`; when given, a prompt + `max_tokens` past
        `max_model_len` is refused naming it (OpenAI semantics) instead of ending early with "length".
        """
        parent = self.intake.request(
            prompt, params, request_id, on_update, pixel_values, image_grid_thw, group, length_field
        )
        self.scheduler.submit(parent)
        return parent

    def abort(self, request_id: str) -> None:
        """Cancel a request, all its choices (thread-safe); slots are freed at the start of the next step."""
        self.scheduler.cancel(request_id)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Prompt ids; a text prompt is checked (valid Unicode, not certainly too long) before tokenizing."""
        return self.intake.encode(prompt)

    def load_weights(self, pieces) -> tuple[int, int]:
        """Copy new weights into the model in place: `(name, tensor[, start row])` pieces by state-dict name
        (`serve.weight_update.copy_pieces`; the fused serving weights rebuild on next use). Call it between steps,
        from the thread that steps the engine or while that thread is parked. Returns (pieces, bytes copied).

        Raises:
            ConfigError: the engine's graphs hold the weights frozen (`freeze_weights`); nothing is copied."""
        if self.frozen:
            raise ConfigError(frozen.REFUSAL)
        self._weights_generation += 1  # even a failed load may have copied some pieces
        return copy_pieces(self.model, pieces)

    @property
    def weight_version(self) -> int:
        """The weights' version, recorded on each admitted request; setting it (a weight update) also makes the
        prefix cache's blocks stale (`serve.prefix_cache`), even when the number does not change."""
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self._weight_version = version
        self._weights_generation = getattr(self, "_weights_generation", 0) + 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule, run the model once, sample. Returns the requests (choices) that finished in this step."""
        self._take_incoming()
        if self.prefix_cache is not None:
            self.prefix_cache.set_weights(self.weight_version, self._weights_generation)
        if self.spec_auto is not None:
            self.spec_auto.before_step(self.running, self.waiting, self.cache.max_slots)
        plan = self.scheduler.schedule(self.max_num_batched_tokens, self.admitting, self.weight_version)
        if plan:
            t0 = time.perf_counter()
            try:
                out, routing, prompt = decode_runs.forward(self, plan)  # the model step (a decode run: its last)
            except Exception as exc:  # see the module doc: recompute the involved requests, end only a culprit
                self._recover(plan, exc)
            else:
                if self.spec_auto is not None:
                    self.spec_auto.record_plan(plan, time.perf_counter() - t0)
                self._advance(plan, out, t0, routing, prompt)
                if self.spec_auto is not None:
                    self.spec_auto.record_step_end(time.perf_counter() - t0)
        return self.outcomes.take()

    def _advance(self, plan: list[tuple[Request, int]], out, t0: float, routing=None, prompt=None):
        """After a successful forward: record asked prompt log-probs, count the fed tokens (`Scheduler.advance`),
        sample the due entries (a request with `max_tokens` 0 ends instead), verify drafts and propose new ones
        (speculative steps). `routing`, `prompt`: `ModelStep`'s routed experts, prompt positions and logits."""
        if prompt is not None:
            for req, why in prompt_logprobs.record(*prompt):  # its own failure, as a non-finite sampled row
                log.error("request %s failed: %s", req.request_id, why)
                self.outcomes.finish(req, "error", why)
        spec = out if isinstance(out, SpecForward) else None
        logits = out if spec is None else spec.logits
        fed = self.scheduler.advance(plan, routing, None if spec is None else spec.first_row)
        if self.prefix_cache is not None:  # snapshots due now, before sampling may end a request
            self.prefix_cache.after_forward(plan, spec)
        for req in fed.scored_only:
            self.outcomes.finish(req, "length")
        emitted = len(fed.to_sample)
        if fed.to_sample:
            rows = fed.rows
            self.outcomes.sample(logits if rows == list(range(logits.shape[0])) else logits[rows], fed.to_sample)
        for req, i, n in fed.to_verify:
            emitted += self.outcomes.verify(req, i, n, spec)
        if spec is not None:
            t1 = time.perf_counter()
            self.speculator.propose_or_stop(fed.cells, spec)
            if self.spec_auto is not None:
                self.spec_auto.record_proposal(len(plan), fed.cells, time.perf_counter() - t1)
        if self.prefix_cache is not None:  # the prefilled blocks (and the head's cells just proposed)
            for req, _ in plan:
                if not req.finished:
                    self.prefix_cache.collect(req)
        self.stats.step(fed.prompt_fed, time.perf_counter() - t0, emitted, fed.recomputed)

    def _recover(self, plan: list[tuple[Request, int]], exc: Exception) -> None:
        """A forward over `plan` raised: end its request if it ran alone, else preempt them all (they become
        suspects, `Scheduler.preempt`)."""
        self.stats.failed_steps += 1
        what = f"{type(exc).__name__}: {exc}"
        if len(plan) > 1:
            self.scheduler.preempt(plan, what)
            return
        req = plan[0][0]
        log.error("model step failed for request %s alone: %s", req.request_id, what, exc_info=exc)
        self.outcomes.finish(req, "error", f"the model step failed on this request: {what}")

    def _take_incoming(self) -> None:
        aborts = self.scheduler.take_incoming()
        if aborts:
            for req in [r for r in self.scheduler.unfinished() if r.group in aborts or r.request_id in aborts]:
                self.outcomes.finish(req, "abort", "cancelled")

    def fail_all(self, reason: str, message: str) -> list[Request]:
        """End every queued, running and incoming request with `reason` ("error" or "abort") and `message`.

        The server's last resort (an exception outside the model step, or shutdown); safe to call when the
        engine's state is inconsistent: a request that cannot be finished cleanly is still marked and notified.
        """
        return self.outcomes.fail_all(reason, message)

    # ---- synchronous API -----------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """Run prompts to completion (continuous batching among them).

        Returns one `Completion` per prompt and choice, in order (a prompt whose params have n > 1 gives its n
        choices one after another, `Completion.index` 0..n-1).
        """
        params_list = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        choices = [c for r in reqs for c in r.choices]
        while not all(c.finished for c in choices):
            self.step()
        return [c.completion(self.tokenizer is not None) for c in choices]


def _graphs(model, cache, decode_graph, buckets, prefill_lengths, backend, freeze) -> tuple:
    """The engine's compiled (captured) step graphs: (`DecodeGraph` | None, `ChunkGraph` | None); prompt chunks
    only on CPU, each length used once compiled (warmup / background)."""
    if freeze and not decode_graph:
        raise ConfigError("freeze_weights freezes the weights into the decode graph: it needs decode_graph=True")
    if not decode_graph:
        return None, None
    graph = DecodeGraph(model, cache, buckets, backend, freeze)
    if graph.device.type != "cpu" or (prefill_lengths is not None and len(prefill_lengths) == 0):
        return graph, None
    return graph, ChunkGraph(model, cache, prefill_lengths, backend, freeze)
