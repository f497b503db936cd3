"""Continuous-batching inference engine over a `StateCache`.

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
Its logits are the eager step's to float rounding (tested).

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

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from flashnext.errors import ConfigError, InputError
from flashnext.serve import prompt_logprobs
from flashnext.serve.cache import StateCache
from flashnext.serve.decode_graph import DecodeGraph
from flashnext.serve.intake import check_prompt, encode_prompt, image_positions, make_choices
from flashnext.serve.loading import max_token_bytes
from flashnext.serve.model_step import ModelStep
from flashnext.serve.prepare import prepare_for_inference
from flashnext.serve.request import Completion, Request
from flashnext.serve.sampler import Sampler
from flashnext.serve.sampling import FAILED, MAX_SPECULATIVE_TOKENS, FieldError, SamplingParams
from flashnext.serve.scheduler import Scheduler
from flashnext.serve.speculative import SpecForward, Speculator
from flashnext.serve.stats import EngineStats
from flashnext.serve.weight_update import copy_pieces

__all__ = ["Completion", "Engine", "EngineStats", "Request"]

log = logging.getLogger("flashnext.serve")
NO_MTP = "this model has no MTP draft head (mtp.* weights with mtp_num_hidden_layers in its config.json)"


class Engine:
    """Request queue, continuous-batching scheduler and sampler around a model and its state cache.

    Args:
        model: a `FlashNextForCausalLM` or the composite model (prepared here: eval mode, fused serving weights).
        tokenizer: optional; needed for text prompts and stop strings (`encode`, `decode`, `eos_token_id`).
        max_slots: concurrent sequences (cache slots).
        max_model_len: longest prompt + generation.
        max_num_batched_tokens: token budget of one step (decodes first, then prompt chunks).
        num_speculative_tokens: default draft tokens per step for requests that do not set
            `SamplingParams.num_speculative_tokens` (0 = off); needs a model with an MTP head.
        decode_graph: run decode-only steps as the compiled (CPU) / captured (CUDA) fixed-shape step of
            `serve.decode_graph` (prefill and speculative steps stay eager); False: every step eager.
        decode_buckets: the batch sizes decode steps are padded to (default `decode_graph.DEFAULT_BUCKETS`).
        compile_backend: torch.compile backend of the CPU decode graph ("inductor").

    Raises:
        ConfigError: `num_speculative_tokens` > 0 for a model without an MTP head, or out of range.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        max_slots: int = 16,
        max_model_len: int = 2048,
        max_num_batched_tokens: int = 512,
        num_speculative_tokens: int = 0,
        decode_graph: bool = False,
        decode_buckets: Sequence[int] | None = None,
        compile_backend: str = "inductor",
    ):
        k = num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if k and getattr(model, "mtp", None) is None:
            raise ConfigError(f"num_speculative_tokens={k} needs a model with an MTP head: {NO_MTP}")
        self.model = prepare_for_inference(model)
        self.config = model.config
        self.tokenizer = tokenizer
        self.cache = StateCache(model, max_slots, max_model_len)
        self.device = next(model.parameters()).device
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max(1, max_num_batched_tokens)
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.eos_id = eos if eos is not None else self.config.eos_id
        per_token = max_token_bytes(tokenizer) if tokenizer is not None else None
        # A text prompt longer than this cannot fit in max_model_len tokens: refused before tokenizing.
        self.max_prompt_bytes = per_token * max_model_len if per_token is not None else None
        self.scheduler = Scheduler(self.cache)
        self.waiting, self.running = self.scheduler.waiting, self.scheduler.running  # the scheduler's, shared
        self.sampler = Sampler(tokenizer, self.eos_id, max_model_len)
        self._lock = threading.Lock()
        self._incoming: deque[Request] = deque()
        self._aborts: set[str] = set()
        self._finished: list[Request] = []  # finished during the current step
        self._ids = itertools.count()
        self.stats = EngineStats()
        self.admitting = True  # False: finish the running requests, start no queued one (a weight update waits)
        self.weight_version = 0  # bumped by whoever updates the weights; recorded on each admitted request
        self.num_speculative_tokens = k
        has_mtp = getattr(model, "mtp", None) is not None
        self.speculator = Speculator(self.model, self.cache, max_model_len, self.stats) if has_mtp else None
        self.decode_graph = None
        if decode_graph:  # decode-only steps as one compiled / captured graph per batch bucket
            self.decode_graph = DecodeGraph(self.model, self.cache, decode_buckets, compile_backend)
        self.model_step = ModelStep(self.model, self.cache, self.device, self.speculator, self.decode_graph)

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
        params = params or SamplingParams()
        params.validate()
        if params.n > self.cache.max_slots:
            raise FieldError(f"n={params.n} exceeds max_slots={self.cache.max_slots} (the choices run at once)", "n")
        ids = self.encode(prompt)
        check_prompt(ids, params, self.max_model_len, self.config.vocab_size, length_field)
        if params.stop and self.tokenizer is None:
            raise InputError("stop strings need a tokenizer")
        spec_k = self.num_speculative_tokens if params.num_speculative_tokens is None else params.num_speculative_tokens
        if spec_k and self.speculator is None:
            raise FieldError(f"num_speculative_tokens={spec_k}: {NO_MTP}", "num_speculative_tokens")
        if params.return_routed_experts:  # drafts' experts would need trimming on rejection; same tokens without them
            spec_k = 0
        mrope = None
        if pixel_values is not None or image_grid_thw is not None:
            mrope = image_positions(self.model, ids, pixel_values, image_grid_thw)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        images = (pixel_values, image_grid_thw) if mrope is not None else None
        parent = make_choices(rid, ids, params, self.device, on_update, group, mrope, images, spec_k)
        with self._lock:
            self._incoming.append(parent)
        return parent

    def abort(self, request_id: str) -> None:
        """Cancel a request, all its choices (thread-safe); slots are freed at the start of the next step."""
        with self._lock:
            self._aborts.add(request_id)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Prompt ids; a text prompt is checked (valid Unicode, not certainly too long) before tokenizing."""
        return encode_prompt(prompt, self.tokenizer, self.max_prompt_bytes, self.max_model_len)

    def load_weights(self, pieces) -> tuple[int, int]:
        """Copy new weights into the model in place: `(name, tensor[, start row])` pieces by state-dict name
        (`serve.weight_update.copy_pieces`; the fused serving weights rebuild on next use). Call it between steps,
        from the thread that steps the engine or while that thread is parked. Returns (pieces, bytes copied)."""
        return copy_pieces(self.model, pieces)

    def has_unfinished(self) -> bool:
        with self._lock:
            pending = bool(self._incoming)
        return pending or bool(self.waiting) or bool(self.running)

    # ---- the step ------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule, run the model once, sample. Returns the requests (choices) that finished in this step."""
        self._take_incoming()
        plan = self.scheduler.schedule(self.max_num_batched_tokens, self.admitting, self.weight_version)
        if plan:
            t0 = time.perf_counter()
            try:
                out, routing, prompt = self.model_step(plan)
            except Exception as exc:  # see the module doc: recompute the involved requests, end only a culprit
                self._recover(plan, exc)
            else:
                self._advance(plan, out, t0, routing, prompt)
        done, self._finished = self._finished, []
        return done

    def _advance(self, plan: list[tuple[Request, int]], out, t0: float, routing=None, prompt=None):
        """After a successful forward: record asked prompt log-probs, count the fed tokens, fork n-choice prompts,
        sample the due entries (a request with `max_tokens` 0 ends instead), verify drafts and propose new ones
        (speculative steps). `routing`: the stream's routed experts [T, L, k] (requests that asked keep their rows;
        they never carry drafts, see `add_request`); `prompt`: `ModelStep`'s prompt positions and their logits."""
        if prompt is not None:
            for req, why in prompt_logprobs.record(*prompt):  # its own failure, as a non-finite sampled row
                log.error("request %s failed: %s", req.request_id, why)
                self._finish(req, "error", why)
        spec = out if isinstance(out, SpecForward) else None
        logits = out if spec is None else spec.logits
        rows, to_sample, to_verify, cells = [], [], [], []
        prompt_fed = recomputed = offset = 0
        for i, (req, n) in enumerate(plan):
            if req.finished:  # failed on its prompt's log-probs just now (its slot is free; row i stays unread)
                continue
            if req.suspect:
                recomputed += n
            else:
                prompt_fed += max(0, min(n, len(req.prompt_ids) - req.num_cached))
            if req.params.return_routed_experts:
                req.record_routing(routing[offset : offset + n])
            offset += n + len(req.drafts)  # the stream carries each entry's drafts after its tokens
            cells.append((req, i))
            if not self.scheduler.advance(req, n):  # the next token is due once it fed everything known
                continue
            if req.drafts:
                to_verify.append((req, i, n))
                continue
            if req.params.max_tokens == 0:  # the prompt was only to be scored; its choices end with it
                self._finish(req, "length")
                continue
            row = i if spec is None else spec.first_row[i]
            rows.append(row)
            to_sample.append(req)
            for child in self.scheduler.fork(req):  # prompt prefilled: its other choices start from its state
                rows.append(row)
                to_sample.append(child)
                cells.append((child, i))
        emitted = len(to_sample)
        if to_sample:
            self._sample(logits if rows == list(range(logits.shape[0])) else logits[rows], to_sample)
        for req, i, n in to_verify:
            emitted += self._verify(req, i, n, spec)
        if spec is not None:
            self._propose(cells, spec)
        self.stats.step(prompt_fed, time.perf_counter() - t0, emitted, recomputed)

    def _verify(self, req: Request, i: int, n: int, out: SpecForward) -> int:
        """Accept entry i's drafts, roll its slot back past the first rejected one, record the emitted tokens;
        returns how many were emitted."""
        try:
            verdict = self.speculator.verify(req, out, i)
        except Exception as e:  # this request's problem alone, as a failing sampled row
            log.exception("request %s: verifying its drafts failed", req.request_id)
            self._finish(req, "error", f"verifying draft tokens failed: {type(e).__name__}: {e}")
            return 0
        if verdict is None:
            self._finish(req, "error", "the model's logits for this request are not finite (NaN or inf)")
            return 0
        self.speculator.commit(req, i, n, verdict, out)
        self._emit(req, verdict.tokens, verdict.chosen, verdict.top, list(range(len(verdict.tokens))))
        return len(verdict.tokens)

    def _propose(self, cells: list[tuple[Request, int]], out: SpecForward) -> None:
        """New MTP cells and drafts for the step's speculating requests; a failure only turns their speculation
        off (their tokens stay exact: drafts are only ever proposals)."""
        try:
            self.speculator.propose(cells, out)
        except Exception:
            log.exception("the MTP draft head failed; speculation is off for the requests of this step")
            for req, _ in cells:
                req.spec_k, req.drafts = 0, []

    def _recover(self, plan: list[tuple[Request, int]], exc: Exception) -> None:
        """A forward over `plan` raised: end its request if it ran alone, else reset and suspect them all."""
        self.stats.failed_steps += 1
        what = f"{type(exc).__name__}: {exc}"
        if len(plan) == 1:
            req = plan[0][0]
            log.error("model step failed for request %s alone: %s", req.request_id, what, exc_info=exc)
            self._finish(req, "error", f"the model step failed on this request: {what}")
            return
        ids = ", ".join(req.request_id for req, _ in plan)
        log.warning("model step of %d requests failed (%s); recomputing them one at a time: %s", len(plan), what, ids)
        self.scheduler.preempt(plan)

    def _take_incoming(self) -> None:
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
            aborts, self._aborts = self._aborts, set()
        if aborts:
            for req in [r for r in self.scheduler.unfinished() if r.group in aborts or r.request_id in aborts]:
                self._finish(req, "abort", "cancelled")

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """Sample row i of `logits` for `reqs[i]` and record it; a row that cannot be sampled ends its request."""
        tokens, chosen, top, errors = self.sampler.sample(logits, reqs)
        for i, req in enumerate(reqs):
            tok = tokens[i]
            if tok == FAILED:
                msg = errors.get(i, "the model's logits for this request are not finite (NaN or inf)")
                log.error("request %s failed: %s", req.request_id, msg)
                self._finish(req, "error", msg)
                continue
            self._emit(req, [tok], [chosen[i]] if chosen is not None else None, top, [i])

    def _emit(self, req: Request, tokens: list[int], chosen: list[float] | None, top, rows: list[int]) -> None:
        """Record `tokens` in order (log-probs `chosen[j]`, top-n row `rows[j]` of `top`) until one stops the
        request; then finish or notify it. A failure processing them ends this request alone."""
        now = time.perf_counter()
        for j, tok in enumerate(tokens):
            try:
                reason = self.sampler.record(req, tok, chosen[j] if chosen is not None else None, top, rows[j], now)
            except Exception as e:  # e.g. the tokenizer failing on this request's text: its problem alone
                log.exception("request %s failed after sampling", req.request_id)
                self._finish(req, "error", f"processing the sampled token failed: {type(e).__name__}: {e}")
                return
            if reason is not None:
                self._finish(req, reason)
                return
        self._notify(req)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End `req` (idempotent): free its slot, count it, tell its client; pending children share its end."""
        if req.finished:
            return
        req.finish_reason = reason
        req.error = error
        req.finish_time = time.perf_counter()
        req.images = req.prompt_embeds = None
        req.drafts = []
        self.scheduler.release(req)
        forks, req.forks = req.forks, []
        self.stats.finish(req)
        self._finished.append(req)
        self._notify(req)
        for child in forks:  # never forked: they share the parent's prompt, so its fate
            self._finish(child, reason, error)

    def _notify(self, req: Request) -> None:
        if req.on_update is None:
            return
        try:
            req.on_update(req)
        except Exception as e:  # its client is gone or broken: cancel the request, keep serving the others
            log.warning("update callback of %s failed (%s: %s); cancelling it", req.request_id, type(e).__name__, e)
            if not req.finished:
                with self._lock:
                    self._aborts.add(req.group)

    def fail_all(self, reason: str, message: str) -> list[Request]:
        """End every queued, running and incoming request with `reason` ("error" or "abort") and `message`.

        The server's last resort (an exception outside the model step, or shutdown); safe to call when the
        engine's state is inconsistent: a request that cannot be finished cleanly is still marked and notified.
        """
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
        for req in list(self.scheduler.unfinished()):
            try:
                self._finish(req, reason, message)
            except Exception:
                log.exception("could not finish request %s cleanly", req.request_id)
                req.finish_reason, req.error, req.slot = reason, message, None
                self._finished.append(req)
                self._notify(req)
        self.scheduler.clear()
        done, self._finished = self._finished, []
        return done

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
