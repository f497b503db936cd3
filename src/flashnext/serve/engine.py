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
from collections.abc import Callable, Iterator, Sequence

import torch

from flashnext.errors import ConfigError, InputError
from flashnext.model.multimodal import get_rope_index
from flashnext.model.state import make_step
from flashnext.serve import prompt_logprobs
from flashnext.serve.cache import StateCache
from flashnext.serve.decode_graph import DecodeGraph, decode_only
from flashnext.serve.loading import max_token_bytes
from flashnext.serve.prepare import prepare_for_inference
from flashnext.serve.request import Completion, Request
from flashnext.serve.sampling import (
    FAILED,
    MAX_SPECULATIVE_TOKENS,
    FieldError,
    SamplingParams,
    check_text,
    choice_seed,
    random_seed,
    sample,
)
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
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # holding a slot, in admission order
        self._suspects: list[Request] = []  # in a failed step, to recompute one at a time
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
        if not ids:
            raise FieldError("prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:
            msg = f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room"
            raise FieldError(msg, "prompt")
        if length_field is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise FieldError(
                f"{length_field}={params.max_tokens} plus the prompt's {len(ids)} tokens is "
                f"{len(ids) + params.max_tokens}, more than this model's context of {self.max_model_len} tokens "
                f"(max_model_len); ask for at most {self.max_model_len - len(ids)}",
                length_field,
            )
        vocab = self.config.vocab_size
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise FieldError(f"prompt token {bad} = {ids[bad]} is outside the vocabulary [0, {vocab})", "prompt")
        if params.stop and self.tokenizer is None:
            raise InputError("stop strings need a tokenizer")
        spec_k = self.num_speculative_tokens if params.num_speculative_tokens is None else params.num_speculative_tokens
        if spec_k and self.speculator is None:
            raise FieldError(f"num_speculative_tokens={spec_k}: {NO_MTP}", "num_speculative_tokens")
        if params.return_routed_experts:  # drafts' experts would need trimming on rejection; same tokens without them
            spec_k = 0
        mrope = None
        if pixel_values is not None or image_grid_thw is not None:
            mrope = self._image_positions(ids, pixel_values, image_grid_thw)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else random_seed()
        images = (pixel_values, image_grid_thw) if mrope is not None else None
        choices = [
            Request(
                rid if i == 0 else f"{rid}/{i}",
                ids,
                params,
                on_update=on_update,
                index=i,
                group=group or rid,
                generator=torch.Generator(device=self.device).manual_seed(choice_seed(seed, i)),
                mrope=mrope,
                images=images,
                spec_k=spec_k,
            )  # fmt: skip
            for i in range(params.n)
        ]
        if params.prompt_logprobs is not None:  # one table for all choices: they share the prompt
            table, tops = [None] * len(ids), [[] for _ in ids]
            for choice in choices:
                choice.prompt_logprobs, choice.prompt_top_logprobs = table, tops
        parent = choices[0]
        parent.choices, parent.forks = choices, choices[1:]
        with self._lock:
            self._incoming.append(parent)
        return parent

    def _image_positions(self, ids: list[int], pixel_values, grid) -> tuple[torch.Tensor, int]:
        """Check a request's images against the model and its placeholders; (MRoPE table [3, L], delta)."""
        visual = getattr(self.model, "visual", None)
        if visual is None:
            raise InputError("this model is text-only (no vision tower); it does not accept images")
        if pixel_values is None or grid is None:
            raise InputError("images need both pixel_values and image_grid_thw")
        grid = torch.as_tensor(grid, dtype=torch.long)
        if grid.dim() != 2 or grid.shape[1] != 3:
            raise InputError(f"image_grid_thw must be [n_images, 3], got {tuple(grid.shape)}")
        if pixel_values.shape[0] != int(grid.prod(-1).sum()):
            raise InputError(
                f"pixel_values has {pixel_values.shape[0]} patches; image_grid_thw gives {int(grid.prod(-1).sum())}"
            )
        ids_t = torch.tensor(ids, dtype=torch.long)
        image_token_id = self.model.image_token_id
        m = visual.config.spatial_merge_size
        n_placeholders = int((ids_t == image_token_id).sum())
        n_features = int(grid.prod(-1).sum()) // (m * m)
        if n_placeholders != n_features:
            raise InputError(
                f"the prompt has {n_placeholders} image placeholders (id {image_token_id}) but the images give "
                f"{n_features} features"
            )
        positions, deltas = get_rope_index(ids_t, [0, len(ids)], (ids_t == image_token_id).long(), grid, m)
        return positions, int(deltas[0])

    def abort(self, request_id: str) -> None:
        """Cancel a request, all its choices (thread-safe); slots are freed at the start of the next step."""
        with self._lock:
            self._aborts.add(request_id)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Prompt ids; a text prompt is checked (valid Unicode, not certainly too long) before tokenizing."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("text prompts need a tokenizer; pass token ids")
            size = check_text(prompt, "prompt")
            if self.max_prompt_bytes is not None and size > self.max_prompt_bytes:
                raise FieldError(
                    f"prompt is {size} bytes, more than max_model_len={self.max_model_len} tokens can hold (a "
                    f"token covers at most {self.max_prompt_bytes // self.max_model_len} bytes); not tokenized",
                    "prompt",
                )
            return list(self.tokenizer.encode(prompt))
        try:
            return [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise FieldError("a prompt is a string or a sequence of token ids (ints)", "prompt") from None

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
        plan = self._schedule()
        if plan:
            t0 = time.perf_counter()
            try:
                out, routing, prompt = self._forward(plan)
            except Exception as exc:  # see the module doc: recompute the involved requests, end only a culprit
                self._recover(plan, exc)
            else:
                self._advance(plan, out, t0, routing, prompt)
        done, self._finished = self._finished, []
        return done

    def _forward(self, plan: list[tuple[Request, int]]):
        """One `forward_step` over the plan's stream: logits [entries.., V] of every entry's last token, or, when a
        request of the step speculates, the `SpecForward` (verified rows, residual) `serve.speculative` needs; the
        stream's routed experts [T, L, k] when a request of the plan asked for them (else None); and the prompt
        positions whose log-probs were asked, with their logits (`serve.prompt_logprobs`; None when none). A
        decode-only step without speculation or routing runs as the decode graph, when the engine has one."""
        if self.decode_graph is not None and decode_only(plan) and self.decode_graph.ready_for(len(plan)):
            logits = self.decode_graph.run(
                [req.pending_ids(1)[0] for req, _ in plan], [req.slot for req, _ in plan],
                [req.num_cached for req, _ in plan],
            )  # fmt: skip
            return logits, None, None
        ids, cu, slots, cached = [], [0], [], []
        for req, n in plan:
            chunk = req.pending_ids(n) + req.drafts
            ids.extend(chunk)
            cu.append(cu[-1] + len(chunk))
            slots.append(req.slot)
            cached.append(req.num_cached)
        mrope = [req.mrope for req, _ in plan]
        step = make_step(cu, slots, cached, self.cache.scratch_slot, self.device, mrope=mrope)
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

    def _advance(self, plan: list[tuple[Request, int]], out, t0: float, routing=None, prompt=None):
        """After a successful forward: record asked prompt log-probs, count the fed tokens, fork n-choice prompts,
        sample the due entries (a request with `max_tokens` 0 ends instead), verify drafts and propose new ones
        (speculative steps). `routing`: the stream's routed experts [T, L, k] (requests that asked keep their rows;
        they never carry drafts, see `add_request`); `prompt`: `_forward`'s prompt positions and their logits."""
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
            req.num_cached += n
            if req.num_cached >= len(req.prompt_ids):
                req.prompt_embeds = None  # prefilled: nothing of the vision tower stays
            cells.append((req, i))
            if req.num_cached == req.num_tokens:  # fed everything known: the next token is due
                if req.suspect:  # recomputed its whole history alone: cleared
                    req.suspect = False
                    self._suspects.remove(req)
                if req.drafts:
                    to_verify.append((req, i, n))
                    continue
                if req.params.max_tokens == 0:  # the prompt was only to be scored; its choices end with it
                    self._finish(req, "length")
                    continue
                row = i if spec is None else spec.first_row[i]
                rows.append(row)
                to_sample.append(req)
                if req.forks:  # prompt prefilled: its other choices start from a copy of its state
                    for child in self._fork(req):
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

    def _fork(self, parent: Request) -> list[Request]:
        """Give the parent's pending children its prefilled state (their reserved slots) and start them."""
        children, parent.forks = parent.forks, []
        for child in children:
            self.cache.copy_slot(parent.slot, child.slot)
            child.num_cached, child.mtp_cells = parent.num_cached, parent.mtp_cells
            child.routed = list(parent.routed)  # the shared prompt's experts
            self.running.append(child)
        return children

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
        for req, _ in plan:
            self.cache.reset_slot(req.slot)  # partly written by the failed step
            req.num_cached = req.mtp_cells = 0
            req.prompt_embeds, req.drafts = None, []
            req.routed = []  # recomputed from the start
            if not req.suspect:
                req.suspect = True
                self._suspects.append(req)

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

    def _unfinished(self) -> Iterator[Request]:
        """Every queued or running request, with children still waiting for their parent's prefill."""
        for req in itertools.chain(self.waiting, self.running):
            yield req
            yield from req.forks

    def _take_incoming(self) -> None:
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
            aborts, self._aborts = self._aborts, set()
        if aborts:
            for req in [r for r in self._unfinished() if r.group in aborts or r.request_id in aborts]:
                self._finish(req, "abort", "cancelled")

    def _schedule(self) -> list[tuple[Request, int]]:
        """(request, tokens to feed) pairs: decodes, then prefill chunks, then admissions, within the budget.

        While suspects of a failed step remain, a step runs the first of them alone (its recompute, chunked).
        """
        budget = self.max_num_batched_tokens
        if self._suspects:
            req = self._suspects[0]
            return [(req, self._chunk(req, budget))]
        plan = []
        decoding = [r for r in self.running if r.num_cached >= len(r.prompt_ids)]
        prefilling = [r for r in self.running if r.num_cached < len(r.prompt_ids)]
        for req in decoding + prefilling:  # decodes first: one token each (more after rejected drafts)
            if budget == 0:
                break
            n = self._chunk(req, budget)
            plan.append((req, n))
            budget -= n + len(req.drafts)
        # A request with n choices is admitted when its n slots are free (its children reserve theirs now).
        while self.admitting and budget > 0 and self.waiting and self.cache.free_slots > len(self.waiting[0].forks):
            req = self.waiting.popleft()
            req.slot = self.cache.allocate()
            for child in req.forks:
                child.slot = self.cache.allocate()
            for choice in req.choices:
                choice.weight_version = self.weight_version
            self.running.append(req)
            n = min(budget, len(req.prompt_ids))
            plan.append((req, n))
            budget -= n
        return plan

    @staticmethod
    def _chunk(req: Request, budget: int) -> int:
        """Known tokens of `req` to feed in a step with `budget` tokens left: all not yet cached (a decode's one
        token, a replay after rejected drafts, a prompt's rest) or a chunk of them. Its drafts ride along only
        when the entry reaches its last known token, trimmed to the budget (else they are dropped)."""
        known = req.num_tokens - req.num_cached
        n = min(budget, known)
        req.drafts = req.drafts[: budget - n] if n == known else []
        return n

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        want = any(r.params.logprobs is not None for r in reqs)
        errors: dict[int, str] = {}
        tokens, logprobs = sample(
            logits, [r.params for r in reqs], [r.generator for r in reqs], with_logprobs=want, errors=errors
        )
        chosen = logprobs.gather(1, tokens.clamp_min(0)[:, None]).squeeze(1).tolist() if want else None
        tokens_host = tokens.tolist()
        top_n = max((r.params.logprobs or 0) for r in reqs)
        top = torch.topk(logprobs, top_n, dim=-1) if top_n else None
        for i, req in enumerate(reqs):
            tok = tokens_host[i]
            if tok == FAILED:
                msg = errors.get(i, "the model's logits for this request are not finite (NaN or inf)")
                log.error("request %s failed: %s", req.request_id, msg)
                self._finish(req, "error", msg)
                continue
            self._emit(req, [tok], [chosen[i]] if want else None, top, [i])

    def _emit(self, req: Request, tokens: list[int], chosen: list[float] | None, top, rows: list[int]) -> None:
        """Record `tokens` in order (log-probs `chosen[j]`, top-n row `rows[j]` of `top`) until one stops the
        request; then finish or notify it. A failure processing them ends this request alone."""
        now = time.perf_counter()
        for j, tok in enumerate(tokens):
            try:
                reason = self._record(req, tok, chosen[j] if chosen is not None else None, top, rows[j], now)
            except Exception as e:  # e.g. the tokenizer failing on this request's text: its problem alone
                log.exception("request %s failed after sampling", req.request_id)
                self._finish(req, "error", f"processing the sampled token failed: {type(e).__name__}: {e}")
                return
            if reason is not None:
                self._finish(req, reason)
                return
        self._notify(req)

    def _record(self, req: Request, tok: int, chosen: float | None, top, i: int, now: float) -> str | None:
        """Append a sampled token (and its log-probs) to `req`; its stop reason or None."""
        req.output_ids.append(tok)
        if req.first_token_time is None:
            req.first_token_time = now
        if req.params.logprobs is not None:
            req.logprobs.append(chosen)
            if req.params.logprobs:
                n = req.params.logprobs
                req.top_logprobs.append(list(zip(top.indices[i, :n].tolist(), top.values[i, :n].tolist(), strict=True)))
        return self._stop_reason(req, tok)

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        stop_id = tok in p.stop_token_ids or (tok == self.eos_id and not p.ignore_eos)
        if self.tokenizer is not None:
            ids = req.output_ids[:-1] if stop_id else req.output_ids
            req.text = self.tokenizer.decode(ids)
            for s in p.stop:
                at = req.text.find(s)
                if at >= 0:
                    req.text = req.text[:at]
                    return "stop"
        if stop_id:
            return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End `req` (idempotent): free its slot, count it, tell its client; pending children share its end."""
        if req.finished:
            return
        req.finish_reason = reason
        req.error = error
        req.finish_time = time.perf_counter()
        req.images = req.prompt_embeds = None
        req.drafts = []
        if req.suspect:
            req.suspect = False
            self._suspects.remove(req)
        if req.slot is not None:
            slot, req.slot = req.slot, None
            self.cache.release(slot)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
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
        for req in list(self._unfinished()):
            try:
                self._finish(req, reason, message)
            except Exception:
                log.exception("could not finish request %s cleanly", req.request_id)
                req.finish_reason, req.error, req.slot = reason, message, None
                self._finished.append(req)
                self._notify(req)
        self.running.clear()
        self.waiting.clear()
        self._suspects.clear()
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
