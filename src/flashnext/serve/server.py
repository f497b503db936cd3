"""OpenAI-compatible HTTP server: FastAPI app over an `Engine` stepped by a background thread.

Endpoints: GET /health, GET /metrics (Prometheus text), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (both with SSE streaming). With an API key, /v1/* needs `Authorization: Bearer KEY`.
A malformed or impossible request gets a 4xx with an OpenAI-style `{"error": {...}}` body; a client that
disconnects mid-stream has its request aborted, which frees its cache slot at the engine's next step.

Threads: the engine (model, cache, scheduler) is touched only by `EngineLoop`'s thread; request handlers queue
requests through the engine's thread-safe `add_request` / `abort`, and the engine reports progress through each
request's `on_update` callback, which hands a snapshot to the handler's asyncio queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from flashnext.errors import FlashNextError, InputError
from flashnext.serve.engine import Engine
from flashnext.serve.protocol import ChatRequest, CompletionRequest, error_body

log = logging.getLogger("flashnext.serve")


class EngineLoop:
    """Steps the engine in a daemon thread while it has work; sleeps on an event otherwise."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._wake = threading.Event()
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="flashnext-engine", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop:
            if not self.engine.has_unfinished():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception:  # keep serving: fail the running requests, not the process
                log.exception("engine step failed; aborting its requests")
                for req in list(self.engine.running):
                    self.engine._finish(req, "abort")


class _Stream:
    """A request's progress as seen by its handler: (tokens so far, text, finish reason) snapshots."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def __call__(self, req) -> None:  # engine thread
        snap = (len(req.output_ids), req.text, req.finish_reason)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, snap)


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def build_app(engine: Engine, model_name: str, api_key: str | None = None, model_dir=None) -> FastAPI:
    """The FastAPI app serving `engine` as model `model_name` (starts the engine thread on startup).

    `model_dir`: the checkpoint directory; its `preprocessor_config.json`, if any, configures the image processor.
    """
    state: dict = {"loop": None, "started": time.time(), "model_dir": model_dir}
    tok = engine.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        state["loop"] = EngineLoop(engine)
        yield
        state["loop"].stop()

    app = FastAPI(title="flashnext", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = first.get("msg", "malformed body")
        return _error(
            400, f"invalid request: {where}: {msg}" if where else f"invalid request: {msg}", param=where or None
        )

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return _error(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": int(state["started"]), "owned_by": "flashnext"}
        card["max_model_len"] = engine.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine, state["started"]), media_type="text/plain; version=0.0.4")

    def check_model(name: str) -> JSONResponse | None:
        if name != model_name:
            return _error(
                404,
                f"model {name!r} does not exist; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )
        return None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if (bad := check_model(body.model)) is not None:
            return bad
        prompt = body.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        elif isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return _error(400, "batched prompts are not supported; send one prompt per request", param="prompt")
        params = body.sampling(body.max_tokens if body.max_tokens is not None else 16, body.logprobs, [])
        return await _serve(request, prompt, params, body.stream, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if (bad := check_model(body.model)) is not None:
            return bad
        if tok is None:
            return _error(400, "this model has no tokenizer, so no chat template; use /v1/completions with ids")
        urls: list[str] = []
        images = None
        try:
            messages = [{"role": m.role, "content": _content_text(m.content, urls)} for m in body.messages]
            if urls:
                prompt, images = await asyncio.to_thread(_image_prompt, engine, tok, messages, urls, state)
            else:
                prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except FlashNextError as e:
            return _error(400, str(e), param="messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, engine.max_model_len - len(prompt))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        end_turn = tok.backend.token_to_id("<|im_end|>")
        params = body.sampling(max_tokens, logprobs, [end_turn] if end_turn is not None else [])
        return await _serve(request, prompt, params, body.stream, chat=True, images=images)

    async def _serve(request: Request, prompt, params, stream: bool, chat: bool, images=None):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        sink = _Stream(asyncio.get_running_loop())
        kw = {} if images is None else dict(pixel_values=images.pixel_values, image_grid_thw=images.image_grid_thw)
        try:
            req = engine.add_request(prompt, params, request_id=rid, on_update=sink, **kw)
        except FlashNextError as e:
            return _error(400, str(e))
        state["loop"].wake()
        fmt = _Formatter(rid, model_name, tok, req, chat)
        if stream:
            return StreamingResponse(_sse(request, req, sink, fmt), media_type="text/event-stream")
        try:
            while True:
                n, text, reason = await sink.queue.get()
                if reason is not None:
                    break
        except asyncio.CancelledError:
            engine.abort(rid)
            raise
        return fmt.final(text, reason)

    async def _sse(request: Request, req, sink: _Stream, fmt: _Formatter) -> AsyncIterator[str]:
        sent_tokens, sent_text = 0, ""
        try:
            if fmt.chat:
                yield _event(fmt.chunk({"role": "assistant", "content": ""}, None))
            while True:
                try:
                    n, text, reason = await asyncio.wait_for(sink.queue.get(), timeout=1.0)
                except TimeoutError:
                    if await request.is_disconnected():
                        engine.abort(req.request_id)
                        return
                    continue
                hold = _holdback(text, req.params.stop) if reason is None else 0
                delta = text[len(sent_text) : len(text) - hold] if len(text) - hold > len(sent_text) else ""
                if n > sent_tokens or delta or reason is not None:
                    yield _event(fmt.delta(delta, sent_tokens, n, reason))
                    sent_tokens, sent_text = n, sent_text + delta
                if reason is not None:
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not req.finished:
                engine.abort(req.request_id)  # client went away (generator closed): free the slot

    return app


IMAGE_SENTINEL = "\ue000"  # stands for one image in the rendered chat template (a private-use character)


def _content_text(content, urls: list[str]) -> str:
    """A message's text; each `image_url` part becomes `IMAGE_SENTINEL` and its URL is appended to `urls`."""
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for part in content:
        if part.get("type") == "text":
            out.append(part.get("text", ""))
        elif part.get("type") == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise InputError("an image_url part needs image_url.url (a data: URL)")
            urls.append(url)
            out.append(IMAGE_SENTINEL)
    return "".join(out)


def _image_prompt(engine: Engine, tok, messages: list[dict], urls: list[str], state: dict):
    """Prompt ids with each image expanded into its placeholder span, and the images' `ImageInputs`.

    The template is rendered as text with a sentinel per image; the text between sentinels is tokenized piece by
    piece (the span's special tokens split the text in the reference tokenizer too).
    """
    from flashnext.vision_inputs import image_processor, image_span, process_images

    model = engine.model
    vision = getattr(getattr(model, "model_config", None), "vision_config", None)
    if getattr(model, "visual", None) is None or vision is None:
        raise InputError("this model is text-only (no vision tower); it does not accept image_url content")
    if "processor" not in state:
        state["processor"] = image_processor(vision, state.get("model_dir"))
    images = process_images(urls, vision, state["processor"])
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pieces = text.split(IMAGE_SENTINEL)
    if len(pieces) != len(urls) + 1:
        raise InputError(f"{len(urls)} images but {len(pieces) - 1} image positions in the rendered chat template")
    cfg = model.model_config
    ids = list(tok.encode(pieces[0]))
    for n, piece in zip(images.num_tokens, pieces[1:], strict=True):
        ids += image_span(n, cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
        ids += tok.encode(piece)
    return ids, images


def _holdback(text: str, stops: list[str]) -> int:
    """Characters to keep back while streaming: a possible stop-string prefix, or a partial UTF-8 character."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Formatter:
    """OpenAI response objects (full and streamed chunks) for one request."""

    def __init__(self, rid: str, model: str, tok, req, chat: bool):
        self.rid, self.model, self.tok, self.req, self.chat = rid, model, tok, req, chat
        self.created = int(time.time())

    def _token_str(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False) if self.tok is not None else str(tid)

    def _logprobs(self, lo: int, hi: int):
        r = self.req
        if r.params.logprobs is None:
            return None
        ids, lps = r.output_ids[lo:hi], r.logprobs[lo:hi]
        tops = r.top_logprobs[lo:hi] if r.params.logprobs else [[] for _ in ids]
        if self.chat:
            return {
                "content": [
                    {
                        "token": self._token_str(t),
                        "logprob": lp,
                        "bytes": list(self._token_str(t).encode()),
                        "top_logprobs": [
                            {"token": self._token_str(a), "logprob": b, "bytes": list(self._token_str(a).encode())}
                            for a, b in top
                        ],
                    }
                    for t, lp, top in zip(ids, lps, tops, strict=True)
                ]
            }
        return {
            "tokens": [self._token_str(t) for t in ids],
            "token_ids": list(ids),
            "token_logprobs": list(lps),
            "top_logprobs": [{self._token_str(a): b for a, b in top} for top in tops] if r.params.logprobs else None,
            "text_offset": [],
        }

    def _usage(self) -> dict:
        p, c = len(self.req.prompt_ids), len(self.req.output_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def final(self, text: str, reason: str) -> dict:
        n = len(self.req.output_ids)
        reason = "stop" if reason == "abort" else reason
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": self._logprobs(0, n),
                "finish_reason": reason,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "token_ids": list(self.req.output_ids),
                "logprobs": self._logprobs(0, n),
                "finish_reason": reason,
            }
            obj = "text_completion"
        return {
            "id": self.rid, "object": obj, "created": self.created, "model": self.model,
            "choices": [choice], "usage": self._usage(),
        }  # fmt: skip

    def chunk(self, delta, reason, logprobs=None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": reason}
            obj = "text_completion"
        out = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if reason is not None:
            out["usage"] = self._usage()
        return out

    def delta(self, text: str, lo: int, hi: int, reason: str | None) -> dict:
        reason = "stop" if reason == "abort" else reason
        out = self.chunk({"content": text} if self.chat else text, reason, self._logprobs(lo, hi))
        if not self.chat:
            out["choices"][0]["token_ids"] = list(self.req.output_ids[lo:hi])  # extension: ids of this chunk
        return out


def prometheus_text(engine: Engine, started: float) -> str:
    """Prometheus exposition of the engine's counters and latency summaries."""
    s = engine.stats
    up = max(time.time() - started, 1e-9)

    def quantiles(name: str, values) -> list[str]:
        vals = sorted(values)
        lines = [f"# TYPE {name} summary"]
        for q in (0.5, 0.9, 0.99):
            v = vals[min(len(vals) - 1, int(q * len(vals)))] if vals else float("nan")
            lines.append(f'{name}{{quantile="{q}"}} {v:.6f}')
        lines += [f"{name}_sum {sum(vals):.6f}", f"{name}_count {len(vals)}"]
        return lines

    lines = [
        "# TYPE flashnext_requests_running gauge",
        f"flashnext_requests_running {len(engine.running)}",
        "# TYPE flashnext_requests_waiting gauge",
        f"flashnext_requests_waiting {len(engine.waiting)}",
        "# TYPE flashnext_requests_finished_total counter",
        f"flashnext_requests_finished_total {s.finished}",
        "# TYPE flashnext_prompt_tokens_total counter",
        f"flashnext_prompt_tokens_total {s.prompt_tokens}",
        "# TYPE flashnext_generation_tokens_total counter",
        f"flashnext_generation_tokens_total {s.generated_tokens}",
        "# TYPE flashnext_generation_tokens_per_second gauge",
        f"flashnext_generation_tokens_per_second {s.generated_tokens / up:.3f}",
        "# TYPE flashnext_cache_free_slots gauge",
        f"flashnext_cache_free_slots {engine.cache.free_slots}",
    ]
    lines += quantiles("flashnext_time_to_first_token_seconds", s.ttft)
    lines += quantiles("flashnext_time_per_output_token_seconds", s.tpot)
    return "\n".join(lines) + "\n"
