"""Continuous-batching inference engine over a `StateCache`.

Every `step()`:
1. applies cancellations and admits queued requests (thread-safe hand-off from other threads);
2. schedules a flat stream: one decode token for every running request first, then prompt chunks of requests
   still prefilling, then newly admitted requests (each takes a free slot), while the step's token budget
   `max_num_batched_tokens` lasts, so long prompts are prefilled in chunks across steps;
3. runs `model.forward_step` once on that stream (the same layers as training);
4. samples a token for every entry that reached the end of its known tokens, records log-probs, checks stop
   conditions, and frees a finished request's slot at once (its state is wiped; the slot is reusable next step).

Images (a composite model): a request may carry `pixel_values` + `image_grid_thw` for the placeholder spans in its
prompt. Its MRoPE positions (`get_rope_index`) and delta are computed when it is queued; when it is first
scheduled, the vision tower runs once and its features are scattered into the whole prompt's embeddings, which
the prompt's chunks (chunking across an image is fine: the text path is causal) feed to `forward_step` instead of
token embeddings. The embeddings and pixels are dropped when the prompt is prefilled: nothing of the tower stays.
Decode tokens rotate at `row + delta` on all three axes.

`generate(prompts, params)` is the synchronous API; the HTTP server drives `step()` from a background thread and
streams through each request's `on_update` callback.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from flashnext.errors import InputError
from flashnext.model.multimodal import get_rope_index
from flashnext.model.state import make_step
from flashnext.serve.cache import StateCache
from flashnext.serve.prepare import prepare_for_inference
from flashnext.serve.sampling import SamplingParams, sample


@dataclass
class Completion:
    """The result of one request.

    Attributes:
        token_ids: generated ids (a stop id or EOS that ended the request included).
        text: decoded text (None without a tokenizer); cut before a matched stop string.
        logprobs: log-prob of each generated token under the model (None unless requested).
        top_logprobs: per position, the top n `(token_id, logprob)` pairs (None unless n > 0).
        finish_reason: "length", "stop" or "abort".
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None


@dataclass
class Request:
    """A request's scheduling and output state (owned by the engine thread)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_update: Callable[[Request], None] | None = None
    generator: torch.Generator | None = None
    slot: int | None = None
    num_cached: int = 0  # tokens whose state is in the cache
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    images: tuple[torch.Tensor, torch.Tensor] | None = None  # (pixel_values, image_grid_thw) until embedded
    prompt_embeds: torch.Tensor | None = None  # [L, D] text + image features, while prefilling
    mrope: tuple[torch.Tensor, int] | None = None  # prompt MRoPE positions int64 [3, L] and the decode delta

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def pending_ids(self, n: int) -> list[int]:
        """The next n tokens to feed (prompt tokens, then the last sampled one)."""
        if self.num_cached < len(self.prompt_ids):
            return self.prompt_ids[self.num_cached : self.num_cached + n]
        return self.output_ids[-1:]

    def completion(self, with_text: bool) -> Completion:
        want = self.params.logprobs is not None
        return Completion(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_ids),
            token_ids=list(self.output_ids),
            text=self.text if with_text else None,
            logprobs=list(self.logprobs) if want else None,
            top_logprobs=[list(t) for t in self.top_logprobs] if want and self.params.logprobs else None,
            finish_reason=self.finish_reason,
        )


class Engine:
    """Request queue, continuous-batching scheduler and sampler around a model and its state cache.

    Args:
        model: a `FlashNextForCausalLM` or the composite model (prepared here: eval mode, fused serving weights).
        tokenizer: optional; needed for text prompts and stop strings (`encode`, `decode`, `eos_token_id`).
        max_slots: concurrent sequences (cache slots).
        max_model_len: longest prompt + generation.
        max_num_batched_tokens: token budget of one step (decodes first, then prompt chunks).
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        max_slots: int = 16,
        max_model_len: int = 2048,
        max_num_batched_tokens: int = 512,
    ):
        self.model = prepare_for_inference(model)
        self.config = model.config
        self.tokenizer = tokenizer
        self.cache = StateCache(model, max_slots, max_model_len)
        self.device = next(model.parameters()).device
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max(1, max_num_batched_tokens)
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.eos_id = eos if eos is not None else self.config.eos_id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # holding a slot, in admission order
        self._lock = threading.Lock()
        self._incoming: deque[Request] = deque()
        self._aborts: set[str] = set()
        self._ids = itertools.count()
        self.stats = EngineStats()

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        on_update: Callable[[Request], None] | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> Request:
        """Validate and queue a request (thread-safe). Raises `InputError` for an impossible request.

        `pixel_values` [sum t*h*w, P] and `image_grid_thw` int [n, 3] (`flashnext.vision_inputs.process_images`)
        give the images of the prompt's placeholder spans, in order (composite models only).
        """
        params = params or SamplingParams()
        params.validate()
        ids = self.encode(prompt)
        if not ids:
            raise InputError("prompt is empty")
        vocab = self.config.vocab_size
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InputError(f"prompt token {bad} = {ids[bad]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InputError(f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room")
        if params.stop and self.tokenizer is None:
            raise InputError("stop strings need a tokenizer")
        mrope = None
        if pixel_values is not None or image_grid_thw is not None:
            mrope = self._image_positions(ids, pixel_values, image_grid_thw)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else torch.seed())
        req = Request(rid, ids, params, on_update=on_update, generator=gen, mrope=mrope)
        if mrope is not None:
            req.images = (pixel_values, image_grid_thw)
        with self._lock:
            self._incoming.append(req)
        return req

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
        """Cancel a request (thread-safe); its slot is freed at the start of the next step."""
        with self._lock:
            self._aborts.add(request_id)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("text prompts need a tokenizer; pass token ids")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def has_unfinished(self) -> bool:
        with self._lock:
            pending = bool(self._incoming)
        return pending or bool(self.waiting) or bool(self.running)

    # ---- the step ------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule, run the model once, sample. Returns the requests that finished in this step."""
        finished = self._take_incoming()
        plan = self._schedule()
        if not plan:
            return finished
        ids, cu, slots, cached = [], [0], [], []
        for req, n in plan:
            chunk = req.pending_ids(n)
            ids.extend(chunk)
            cu.append(cu[-1] + len(chunk))
            slots.append(req.slot)
            cached.append(req.num_cached)
        mrope = [req.mrope for req, _ in plan]
        step = make_step(cu, slots, cached, self.cache.scratch_slot, self.device, mrope=mrope)
        t0 = time.perf_counter()
        with torch.inference_mode():
            ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
            embeds = self._prompt_embeds(plan, ids_t, cu)
            logits = self.model.forward_step(ids_t, step, self.cache, inputs_embeds=embeds)
        rows, to_sample = [], []
        for i, (req, n) in enumerate(plan):
            req.num_cached += n
            if req.num_cached >= len(req.prompt_ids):
                req.prompt_embeds = None  # prefilled: nothing of the vision tower stays
            if req.num_cached == req.num_tokens:  # fed everything known: the next token is due
                rows.append(i)
                to_sample.append(req)
        if to_sample:
            finished += self._sample(logits if len(rows) == logits.shape[0] else logits[rows], to_sample)
        prefill = sum(n for req, n in plan if req.num_cached <= len(req.prompt_ids))
        self.stats.step(prefill, time.perf_counter() - t0, len(to_sample))
        return finished

    def _prompt_embeds(self, plan, ids: torch.Tensor, cu: list[int]) -> torch.Tensor | None:
        """The step's input embeddings when an entry is a chunk of an image prompt, else None (token embeddings).

        An image request's first chunk runs the vision tower once over its images and keeps the whole prompt's
        embeddings (features scattered into the placeholders) until its prefill ends.
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
                req.images = None
        embeds = self.model.embed(ids, None, None)
        for i in image_entries:
            req, n = plan[i]
            embeds[cu[i] : cu[i] + n] = req.prompt_embeds[req.num_cached : req.num_cached + n]
        return embeds

    def _take_incoming(self) -> list[Request]:
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
            aborts, self._aborts = self._aborts, set()
        done = []
        if aborts:
            for req in [r for r in itertools.chain(self.waiting, self.running) if r.request_id in aborts]:
                if req in self.waiting:
                    self.waiting.remove(req)
                self._finish(req, "abort")
                done.append(req)
        return done

    def _schedule(self) -> list[tuple[Request, int]]:
        """(request, tokens to feed) pairs: decodes, then prefill chunks, then admissions, within the budget."""
        budget = self.max_num_batched_tokens
        plan = []
        decoding = [r for r in self.running if r.num_cached >= len(r.prompt_ids)]
        prefilling = [r for r in self.running if r.num_cached < len(r.prompt_ids)]
        for req in decoding:
            if budget == 0:
                break
            plan.append((req, 1))
            budget -= 1
        for req in prefilling:
            if budget == 0:
                break
            n = min(budget, len(req.prompt_ids) - req.num_cached)
            plan.append((req, n))
            budget -= n
        while budget > 0 and self.waiting and self.cache.free_slots > 0:
            req = self.waiting.popleft()
            req.slot = self.cache.allocate()
            self.running.append(req)
            n = min(budget, len(req.prompt_ids))
            plan.append((req, n))
            budget -= n
        return plan

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[Request]:
        want = any(r.params.logprobs is not None for r in reqs)
        tokens, logprobs = sample(logits, [r.params for r in reqs], [r.generator for r in reqs], with_logprobs=want)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist() if want else None
        tokens_host = tokens.tolist()
        top_n = max((r.params.logprobs or 0) for r in reqs)
        top = torch.topk(logprobs, top_n, dim=-1) if top_n else None
        now = time.perf_counter()
        done = []
        for i, req in enumerate(reqs):
            tok = tokens_host[i]
            req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            if req.params.logprobs is not None:
                req.logprobs.append(chosen[i])
                if req.params.logprobs:
                    n = req.params.logprobs
                    pairs = zip(top.indices[i, :n].tolist(), top.values[i, :n].tolist(), strict=True)
                    req.top_logprobs.append(list(pairs))
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)
                done.append(req)
            elif req.on_update is not None:
                req.on_update(req)
        return done

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

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        req.images = req.prompt_embeds = None
        if req.slot is not None:
            self.cache.release(req.slot)
            req.slot = None
        if req in self.running:
            self.running.remove(req)
        self.stats.finish(req)
        if req.on_update is not None:
            req.on_update(req)

    # ---- synchronous API -----------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """Run prompts to completion (continuous batching among them); one `Completion` per prompt, in order."""
        params_list = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        while not all(r.finished for r in reqs):
            self.step()
        return [r.completion(self.tokenizer is not None) for r in reqs]


class EngineStats:
    """Counters for /metrics: tokens, steps, TTFT and TPOT of recently finished requests."""

    def __init__(self, window: int = 1000):
        self.window = window
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.finished = 0
        self.ttft: deque[float] = deque(maxlen=window)
        self.tpot: deque[float] = deque(maxlen=window)
        self.started = time.perf_counter()

    def step(self, prompt_tokens: int, seconds: float, sampled: int) -> None:
        self.steps += 1
        self.step_seconds += seconds
        self.generated_tokens += sampled
        self.prompt_tokens += prompt_tokens

    def finish(self, req: Request) -> None:
        self.finished += 1
        if req.first_token_time is not None:
            self.ttft.append(req.first_token_time - req.arrival)
            n = len(req.output_ids)
            if n > 1 and req.finish_time is not None:
                self.tpot.append((req.finish_time - req.first_token_time) / (n - 1))
