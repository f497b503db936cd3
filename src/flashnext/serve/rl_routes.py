"""The routes an RL trainer uses: token-in generation and authenticated weight updates.

`POST /inference/v1/generate` (API key as /v1/*): token ids in, tokens out, with what RL needs and the OpenAI routes
do not return:
    {"token_ids": [int], "model"?, "cache_salt"?, "priority"?: 0,
     "sampling_params": {"max_tokens", "temperature", "top_k", "top_p", "seed", "n", "stop_token_ids", "ignore_eos",
     "logprobs": null|int, "skip_special_tokens", "logprobs_mode": "raw"|"processed", "return_routed_experts": bool,
     "routed_experts_prompt_start"?}}
 -> {"request_id", "prompt_token_ids": [...], "weight_version": int, "usage", "choices": [{"index", "token_ids",
     "text", "logprobs", "finish_reason", "routed_experts": {"dtype": "uint16", "shape": [tokens, L, k],
     "data": base64} | null}]}
`logprobs` in a choice: without `sampling_params.logprobs` (flashnext's own client), the sampled tokens' log-probs as
a list of floats; with `logprobs: N` (vLLM's token route, which verifiers' training client calls with `logprobs: 1`),
vLLM's object `{"content": [{"token": "token_id:ID", "logprob", "bytes": null, "top_logprobs": [N entries]}]}`.
`text` is the completion decoded with `skip_special_tokens` (null on a server without a tokenizer). The penalties,
`logit_bias`, `min_tokens` and `min_p` are honoured as on the OpenAI routes (`serve.logit_controls`; a bad value is
a 400 naming `sampling_params.<field>`); `priority` is accepted at 0 only; `reasoning_effort` is refused (it shapes
a chat template, and the prompt here is already token ids); unknown fields are refused. `cache_salt` is accepted:
no prompt state is shared between requests here, so every request is already isolated. A choice that fails makes
the answer a 5xx error body, as on the OpenAI routes.

Weight updates (`--admin-key KEY`; without it these routes answer 404; a wrong key 401; a malformed body or query
400), see `rl/weights.py`. An update is all or nothing (`serve.weight_update.StagedUpdate`):
- `POST /admin/weights/begin` -> `{"update_id", "tensors": {name: {"dtype", "shape"}}}` (what every piece must
  match): stop admitting requests, let the running ones finish on the old weights, park the engine (queued requests
  wait; none is lost). The pause ends by itself after `timeout_s` (query parameter, default 600) if no `end` comes,
  so a dead trainer cannot freeze the server; nothing received is applied then;
- `POST /admin/weights/update?update_id=ID`: a streamed body of `serve.weight_update` frames, each checked (name,
  rows and shape, dtype) from its header and held until `end` (several such uploads may run at once: one per trainer
  rank) -> `{"tensors", "bytes", "peak_extra_bytes"}` (what this upload held). A bad piece or a truncated body
  answers 400 naming it and aborts the update: what was held is dropped, nothing is applied;
- `POST /admin/weights/end` `{"update_id", "weight_version"}`: apply every held piece, set the engine's weight
  version and resume serving -> `{"weight_version", "tensors", "bytes", "peak_extra_bytes"}` (the most the update
  held at once). After an aborted update it applies nothing, resumes serving on the old weights and answers 409
  saying so.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import time
import uuid

import torch
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from flashnext.errors import FlashNextError
from flashnext.serve import frozen
from flashnext.serve.handlers import Stream, error_response, off_loop
from flashnext.serve.protocol import controls_fields
from flashnext.serve.sampling import FieldError, SamplingParams
from flashnext.serve.weight_update import StagedUpdate

UPLOAD_PATH = "/admin/weights/update"


class TokenSampling(BaseModel):
    """`sampling_params` of the token route: flashnext's fields and the vLLM ones its RL clients send."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: each choice's `logprobs` is the list of the sampled tokens' log-probs (flashnext's shape); N >= 0:
    vLLM's `{"content": [...]}` object with the top N alternatives per token."""
    skip_special_tokens: bool = True
    """Leave special tokens out of each choice's `text` (the token ids are unaffected)."""
    logprobs_mode: str = "raw"
    return_routed_experts: bool = False
    routed_experts_prompt_start: int | None = None
    """With `return_routed_experts`: the first position whose experts are returned (a later turn's request sends
    the length of the conversation it already has the routing of); None: 0."""
    reasoning_effort: str | None = None
    min_tokens: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def refuse_unsupported(self) -> None:
        """Raise `FieldError` naming a field set to a value this server cannot honour."""
        if self.reasoning_effort is not None:
            raise FieldError(f"sampling_params.reasoning_effort={self.reasoning_effort!r} shapes a chat template; "
                             "this route takes rendered token ids (render the effort into the prompt)",
                             "sampling_params.reasoning_effort")  # fmt: skip

    def engine_params(self) -> SamplingParams:
        """The engine's params, checked: `FieldError` naming `sampling_params.<field>`."""
        fields = ("max_tokens", "temperature", "top_k", "top_p", "seed", "n", "stop_token_ids", "ignore_eos",
                  "logprobs_mode", "return_routed_experts")  # fmt: skip
        try:
            # the sampled token's log-prob is always computed (flashnext's shape returns it unasked)
            params = SamplingParams(**{f: getattr(self, f) for f in fields}, logprobs=self.logprobs or 0,
                                    **controls_fields(self))  # fmt: skip
            params.validate()
        except FieldError as e:
            raise FieldError(f"sampling_params.{e}", e.field and f"sampling_params.{e.field}") from None
        return params


class TokenGenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_ids: list[int]
    sampling_params: TokenSampling = TokenSampling()
    model: str | None = None
    cache_salt: str | None = None
    """vLLM's prefix-cache isolation key; accepted as is: no request here reuses another's prompt state."""
    priority: int = 0
    """vLLM's priority scheduling; only 0 (this server serves first come, first served)."""


def vllm_logprobs(token_ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]] | None) -> dict:
    """vLLM's token-route log-probs: tokens named `token_id:ID` (what `return_tokens_as_token_ids` gives)."""

    def entry(t: int, lp: float) -> dict:
        return {"token": f"token_id:{t}", "logprob": lp, "bytes": None}

    top = top or [[] for _ in token_ids]
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
                        for t, lp, alts in zip(token_ids, logprobs, top, strict=True)]}  # fmt: skip


def encode_tensor(t: torch.Tensor) -> dict:
    """A tensor as JSON: `{"dtype", "shape", "data": base64 of its little-endian bytes}`."""
    t = t.contiguous().cpu()
    raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    dtype = str(t.dtype).removeprefix("torch.")
    return {"dtype": dtype, "shape": list(t.shape), "data": base64.b64encode(raw).decode()}


def decode_tensor(d: dict) -> torch.Tensor:
    """The inverse of `encode_tensor`."""
    dtype = getattr(torch, d["dtype"])
    raw = bytearray(base64.b64decode(d["data"]))
    t = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return t.view(d["shape"])


class RLRoutes:
    """Handlers of the token-in route and the weight-update routes of one served engine.

    Args:
        routes: the server's `Routes` (its engine, its `EngineLoop` once started, the model name).
        admin_key: the key the weight-update routes require; None disables them.
    """

    def __init__(self, routes, admin_key: str | None):
        self.routes, self.admin_key = routes, admin_key
        self.update: dict | None = None  # the update in progress: id, totals

    @property
    def engine(self):
        return self.routes.engine

    async def generate(self, body: TokenGenerateRequest, request: Request):
        if body.model is not None and (bad := self.routes._unknown_model(body.model)) is not None:
            return bad
        rid = "gen-" + uuid.uuid4().hex
        sink = Stream(asyncio.get_running_loop())
        sp = body.sampling_params
        try:
            sp.refuse_unsupported()
            if body.priority != 0:
                raise FieldError(f"priority={body.priority} needs priority scheduling; this server serves first "
                                 "come, first served (only 0)", "priority")  # fmt: skip
            start = sp.routed_experts_prompt_start
            if start is not None and not 0 <= start <= len(body.token_ids):
                raise FieldError(f"sampling_params.routed_experts_prompt_start must be in [0, "
                                 f"{len(body.token_ids)}] (the prompt's length), got {start}",
                                 "sampling_params.routed_experts_prompt_start")  # fmt: skip
            params = sp.engine_params()
            req = await off_loop(
                lambda: self.engine.add_request(body.token_ids, params, rid, sink), lambda: self.engine.abort(rid)
            )
        except FlashNextError as e:
            return error_response(400, str(e), param=getattr(e, "field", None))
        self.routes.loop.wake()
        pending = len(req.choices)
        try:
            while pending:
                _, _, _, reason = await sink.queue.get()
                pending -= reason is not None
        except asyncio.CancelledError:
            self.engine.abort(rid)
            raise
        choices = [r.completion(False) for r in req.choices]
        for c in choices:
            if c.finish_reason in ("error", "abort"):
                status = 503 if c.finish_reason == "abort" else 500
                return error_response(status, f"choice {c.index} failed: {c.error}", "server_error")
        generated = sum(len(c.token_ids) for c in choices)
        return {"request_id": rid, "prompt_token_ids": req.prompt_ids, "weight_version": req.weight_version,
                "usage": {"prompt_tokens": len(req.prompt_ids), "completion_tokens": generated,
                          "total_tokens": len(req.prompt_ids) + generated,
                          "prompt_tokens_details": {"cached_tokens": req.num_cached_prompt}},
                "choices": [self._choice(c, sp) for c in choices]}  # fmt: skip

    def _choice(self, c, sp: TokenSampling) -> dict:
        routed = None
        if c.routed_experts is not None:
            routed = encode_tensor(c.routed_experts[sp.routed_experts_prompt_start or 0 :])
        tok = self.engine.tokenizer
        text = tok.decode(c.token_ids, skip_special_tokens=sp.skip_special_tokens) if tok is not None else None
        logprobs = c.logprobs if sp.logprobs is None else vllm_logprobs(c.token_ids, c.logprobs, c.top_logprobs)
        return {"index": c.index, "token_ids": c.token_ids, "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "routed_experts": routed}  # fmt: skip

    # ---- weight updates ----------------------------------------------------------------------------------
    def _refuse(self, request: Request) -> JSONResponse | None:
        if self.admin_key is None:
            return error_response(404, "weight updates are disabled: start the server with --admin-key", "not_found")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.admin_key}".encode()):
            return error_response(401, "invalid or missing admin key", "authentication_error")
        return None

    async def begin(self, request: Request, timeout_s: float = 600.0):
        if (refused := self._refuse(request)) is not None:
            return refused
        if not timeout_s > 0:
            return error_response(400, f"invalid request: timeout_s must be > 0, got {timeout_s}", param="timeout_s")
        if self.engine.frozen:
            return error_response(409, frozen.REFUSAL, "conflict")
        if self.update is not None and self.routes.loop.paused:
            return error_response(409, f"weight update {self.update['id']} is in progress", "conflict")
        t0 = time.perf_counter()
        await asyncio.to_thread(self.routes.loop.pause, timeout_s)
        self.update = {"id": uuid.uuid4().hex, "staged": StagedUpdate(self.engine.model)}
        manifest = {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                    for n, t in self.update["staged"].targets.items()}  # fmt: skip
        return {"update_id": self.update["id"], "drain_seconds": time.perf_counter() - t0, "tensors": manifest}

    def _current(self, update_id: str | None) -> JSONResponse | None:
        if not isinstance(update_id, str) or not update_id:
            return error_response(400, f"update_id is required (the id `begin` returned), got {update_id!r}",
                                  param="update_id")  # fmt: skip
        if self.update is not None and update_id == self.update["id"] and not self.routes.loop.paused:
            self.update["staged"].fail("its pause timed out")  # free what it held: it can never be applied
            self.update = None
        if self.update is None or update_id != self.update["id"]:
            return error_response(
                409, f"no weight update {update_id!r} in progress (begin one first; it may have timed out)"
            )
        if self.update.get("ending"):
            return error_response(409, f"weight update {update_id} is being applied", "conflict")
        return None

    async def upload(self, request: Request, update_id: str | None = None):
        if (refused := self._refuse(request) or self._current(update_id)) is not None:
            return refused
        staged: StagedUpdate = self.update["staged"]
        reader, tensors, nbytes, error = staged.reader(), 0, 0, None
        try:
            async for chunk in request.stream():
                if error is not None:
                    continue  # read the rest of the body (the sender is still streaming) and drop it
                try:
                    for piece in reader.feed(chunk):
                        staged.keep(piece)
                        tensors, nbytes = tensors + 1, nbytes + piece.tensor.numel() * piece.tensor.element_size()
                    staged.note()
                except FlashNextError as e:
                    error = str(e)
            if error is None:
                reader.close()
        except FlashNextError as e:
            error = str(e)
        except Exception as e:  # the client went away mid-body: what arrived cannot be trusted
            error = f"upload interrupted: {type(e).__name__}"
            raise
        finally:
            staged.readers.discard(reader)
            if error is not None:
                staged.fail(error)
        if error is not None:
            return error_response(400, f"{error}; weight update {update_id} aborted: nothing will be applied, "
                                       "the served weights are unchanged")  # fmt: skip
        return {"tensors": tensors, "bytes": nbytes, "peak_extra_bytes": nbytes + reader.peak_bytes}

    async def _end_body(self, request: Request) -> dict | JSONResponse:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_response(400, f"invalid request: the body is not JSON ({e})")
        if not isinstance(body, dict):
            return error_response(400, f"invalid request: expected a JSON object, got {type(body).__name__}")
        version = body.get("weight_version")
        if version is not None and (type(version) is not int or version < 0):
            return error_response(400, f"invalid request: weight_version must be a non-negative integer, got "
                                       f"{version!r}", param="weight_version")  # fmt: skip
        return body

    async def end(self, request: Request):
        if (refused := self._refuse(request)) is not None:
            return refused
        if isinstance(body := await self._end_body(request), JSONResponse):
            return body
        if (stale := self._current(body.get("update_id"))) is not None:
            return stale
        done = self.update
        staged: StagedUpdate = done["staged"]
        if staged.error is not None or staged.readers:
            reason = staged.error or f"{len(staged.readers)} upload(s) still running"
            staged.fail(reason)
            self.update = None
            self.routes.loop.resume()
            return error_response(409, f"weight update {done['id']} aborted ({reason}): nothing was applied; "
                                       f"serving the unchanged weights, version {self.engine.weight_version}",
                                  "conflict")  # fmt: skip
        done["ending"] = True  # no upload, second `end` or `begin` while the pieces are copied in
        # Renew the pause for the copy (it may be about to time out): nothing runs while the model changes.
        await asyncio.to_thread(self.routes.loop.pause, 600.0)
        try:
            tensors, nbytes = await asyncio.to_thread(staged.apply)
            version = body.get("weight_version")
            self.engine.weight_version = version if version is not None else self.engine.weight_version + 1
        finally:
            self.update = None
            self.routes.loop.resume()
        return {"weight_version": self.engine.weight_version, "tensors": tensors, "bytes": nbytes,
                "peak_extra_bytes": staged.peak_bytes}  # fmt: skip


def install(app, routes, admin_key: str | None) -> RLRoutes:
    """Register the RL routes on `app` (a `build_app` app); returns their handler object."""
    rl = RLRoutes(routes, admin_key)
    app.post("/inference/v1/generate")(rl.generate)
    app.post("/admin/weights/begin")(rl.begin)
    app.post(UPLOAD_PATH)(rl.upload)
    app.post("/admin/weights/end")(rl.end)
    return rl
