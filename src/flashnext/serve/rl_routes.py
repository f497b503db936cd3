"""The routes an RL trainer uses: token-in generation and authenticated weight updates.

`POST /inference/v1/generate` (API key as /v1/*): token ids in, tokens out, with what RL needs and the OpenAI routes
do not return:
    {"token_ids": [int], "sampling_params": {"max_tokens", "temperature", "top_k", "top_p", "seed", "n",
     "stop_token_ids", "ignore_eos", "logprobs_mode": "raw"|"processed", "return_routed_experts": bool}}
 -> {"prompt_token_ids": [...], "weight_version": int, "choices": [{"index", "token_ids", "logprobs": [float],
     "finish_reason", "routed_experts": {"dtype": "uint16", "shape": [tokens, L, k], "data": base64} | null}]}
A choice that fails makes the answer a 5xx error body, as on the OpenAI routes.

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
from flashnext.serve.handlers import Stream, error_response, off_loop
from flashnext.serve.sampling import SamplingParams
from flashnext.serve.weight_update import StagedUpdate

UPLOAD_PATH = "/admin/weights/update"


class TokenSampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs_mode: str = "raw"
    return_routed_experts: bool = False


class TokenGenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    token_ids: list[int]
    sampling_params: TokenSampling = TokenSampling()
    model: str | None = None


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
        try:
            params = SamplingParams(**body.sampling_params.model_dump(), logprobs=0)
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
        choices = []
        for c in (r.completion(False) for r in req.choices):
            if c.finish_reason in ("error", "abort"):
                status = 503 if c.finish_reason == "abort" else 500
                return error_response(status, f"choice {c.index} failed: {c.error}", "server_error")
            routed = encode_tensor(c.routed_experts) if c.routed_experts is not None else None
            choices.append({"index": c.index, "token_ids": c.token_ids, "logprobs": c.logprobs,
                            "finish_reason": c.finish_reason, "routed_experts": routed})  # fmt: skip
        return {"prompt_token_ids": req.prompt_ids, "weight_version": req.weight_version, "choices": choices}

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
