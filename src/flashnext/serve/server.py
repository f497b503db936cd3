"""OpenAI-compatible HTTP server: FastAPI app over an `Engine` stepped by a background thread.

Endpoints: GET /health, GET /metrics (Prometheus text), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (both with SSE streaming and `n` choices). With an API key, /v1/* needs
`Authorization: Bearer KEY`. A malformed or impossible request gets a 4xx with an OpenAI-style `{"error": {...}}`
body naming the bad field and value (413 for a body over `max_request_bytes`); a client that disconnects has its
request aborted, which frees its cache slots at the engine's next step. A request that fails while generating
(see `Engine`: one request's failure never ends another) gets a 5xx error body, or on a stream an error event
then `[DONE]`; it is never reported as a normal finish.

Threads: the engine (model, cache, scheduler) is touched only by `EngineLoop`'s thread; request handlers queue
requests through the engine's thread-safe `add_request` / `abort`, and the engine reports progress through each
request's `on_update` callback, which hands a snapshot to the handler's asyncio queue. Tokenizing and rendering
the chat template run in a worker thread (`asyncio.to_thread`), so a large prompt never stalls the event loop.

Logs (logger `flashnext.serve`, INFO): one line per finished request (id, prompt and completion tokens, finish
reason, time to first token, duration) and, while busy, one throughput line every `log_every` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashnext.errors import FlashNextError
from flashnext.serve import rl_routes
from flashnext.serve.chat_parse import template_dialect
from flashnext.serve.chat_render import apply_defaults, chat_prompt, generation_defaults
from flashnext.serve.engine import Engine
from flashnext.serve.formatting import FAILED_REASONS, Formatter, event, holdback
from flashnext.serve.handlers import Stream, error_response, off_loop
from flashnext.serve.http_limits import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from flashnext.serve.loading import end_of_turn_ids
from flashnext.serve.prefix_cache import prefix_cache_line
from flashnext.serve.protocol import IMAGE_SENTINEL, BadRequest, ChatRequest, CompletionRequest, show
from flashnext.serve.stats import prometheus_text

log = logging.getLogger("flashnext.serve")


class EngineLoop:
    """Steps the engine in a daemon thread while it has work; sleeps on an event otherwise.

    Logs each finished request and, while busy, the recent throughput every `log_every` seconds. On `stop`, every
    unfinished request ends with "abort" (its client gets an error, not a silent hang).
    """

    def __init__(self, engine: Engine, log_every: float = 10.0):
        self.engine = engine
        self.log_every = log_every
        self._wake = threading.Event()
        self._stop = False
        self._pause_until: float | None = None  # a weight update: finish the running requests, then park
        self.parked = threading.Event()  # set while paused with nothing running: the engine is not touched
        self.thread = threading.Thread(target=self._run, name="flashnext-engine", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self.thread.join(timeout=5)

    @property
    def paused(self) -> bool:
        return self._pause_until is not None

    def pause(self, timeout: float) -> None:
        """Stop admitting requests, let the running ones finish, and return once the engine is parked (then the
        model may be changed from another thread). The pause ends by itself after `timeout` seconds."""
        self.engine.admitting = False
        self.parked.clear()
        self._pause_until = time.monotonic() + timeout
        self._wake.set()
        while not self.parked.wait(0.05):
            if self._stop or not self.paused:
                raise RuntimeError("the engine loop stopped or the pause timed out before the engine was parked")

    def resume(self) -> None:
        self._pause_until = None
        self.engine.admitting = True
        self.parked.clear()
        self._wake.set()

    def _park(self) -> bool:
        """While paused: True (the caller sleeps) once no request is running; the timeout resumes."""
        if self._pause_until is None:
            return False
        if time.monotonic() > self._pause_until:
            log.warning("weight update not ended within its timeout; resuming on the current weights")
            self.resume()
            return False
        if self.engine.running:
            return False
        self.parked.set()
        return True

    def _run(self) -> None:
        last_log = time.monotonic()
        while not self._stop:
            if self._park():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            if not self.engine.has_unfinished():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                done = self.engine.step()
            except Exception as e:  # outside the model step (which recovers itself): nothing left to trust
                log.exception("engine step failed; failing every request in flight")
                done = self.engine.fail_all("error", f"internal error in the engine: {type(e).__name__}: {e}")
            for req in done:
                log_finished(req)
            if time.monotonic() - last_log >= self.log_every:
                last_log = time.monotonic()
                log_throughput(self.engine)
        for req in self.engine.fail_all("abort", "the server is shutting down"):
            log_finished(req)


@dataclasses.dataclass
class Batch:
    """The prompts of one completions request, answered as one: `choices` are every prompt's, in order."""

    request_id: str
    parents: list

    @property
    def choices(self) -> list:
        return [c for p in self.parents for c in p.choices]


def log_finished(req) -> None:
    ttft = f"{req.first_token_time - req.arrival:.3f}s" if req.first_token_time is not None else "-"
    total = (req.finish_time or time.perf_counter()) - req.arrival
    spec = ""
    if req.num_verify_steps:  # speculative decoding: this request's acceptance rate and mean accepted length
        rate = req.num_accepted / req.num_drafted
        length = (req.num_accepted + req.num_verify_steps) / req.num_verify_steps
        spec = f", drafts accepted {req.num_accepted}/{req.num_drafted} ({rate:.0%}, mean length {length:.2f})"
    if req.num_cached_prompt:  # resumed from the prefix cache
        spec += f", {req.num_cached_prompt} prompt tokens cached"
    log.info(
        "request %s finished: %s, prompt %d tokens, completion %d tokens, ttft %s, %.3fs%s%s",
        req.request_id, req.finish_reason, len(req.prompt_ids), len(req.output_ids), ttft, total, spec,
        f" ({req.error})" if req.error else "",
    )  # fmt: skip


def log_throughput(engine: Engine) -> None:
    prompt_rate, gen_rate = engine.stats.recent_rates()
    log.info(
        "last %gs: %.1f generated tokens/s, %.1f prompt tokens/s; %d running, %d waiting, %d free slots",
        engine.stats.rate_seconds, gen_rate, prompt_rate, len(engine.running), len(engine.waiting),
        engine.cache.free_slots,
    )  # fmt: skip
    if engine.prefix_cache is not None:
        log.info("%s", prefix_cache_line(engine.prefix_cache))


def _bad(e: FlashNextError) -> JSONResponse:
    return error_response(400, str(e), param=getattr(e, "field", None))


class Routes:
    """The handlers of one served engine: model card, metrics, completions and chat (streamed or not).

    Args:
        engine: the engine (stepped by `loop`, set when the app starts).
        model_name: the served model's id.
        model_dir: the checkpoint directory; its `preprocessor_config.json`, if any, configures the image processor,
            its `generation_config.json` the sampling defaults.
        tool_call_parser: "auto" (the chat template's dialect), "xml" (alias "qwen3_coder"), "hermes" or "none".
        reasoning_parser: "auto" (on when the chat template has think blocks), "qwen3" or "none".
    """

    def __init__(self, engine: Engine, model_name: str, model_dir=None, tool_call_parser: str = "auto",
                 reasoning_parser: str = "auto"):  # fmt: skip
        self.engine, self.model_name, self.tok = engine, model_name, engine.tokenizer
        self.loop: EngineLoop | None = None
        self.started = time.time()
        self.images: dict = {"model_dir": model_dir}  # the image processor, made on first use
        self.defaults = generation_defaults(model_dir)
        template = (getattr(self.tok, "config", None) or {}).get("chat_template")
        template = template if isinstance(template, str) else ""
        self.dialect = {"auto": template_dialect(template), "qwen3_coder": "xml", "none": None}.get(
            tool_call_parser, tool_call_parser
        )
        self.reasoning = "<think>" in template if reasoning_parser == "auto" else reasoning_parser != "none"

    async def health(self):
        # With a decode graph, its compiled and pending buckets: serving starts before they compile (eager until then).
        graph = self.engine.decode_graph
        if graph is None:
            return {"status": "ok"}
        out = {"status": "ok", "decode_graph": {"compiled": sorted(graph.ready), "pending": graph.compiling()}}
        chunks = self.engine.chunk_graph  # the prefill chunk lengths (CPU), compiled after the decode buckets
        if chunks is not None:
            out["prefill_graph"] = {"compiled": sorted(chunks.ready), "pending": chunks.compiling()}
        return out

    def _card(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": int(self.started), "owned_by": "flashnext"}
        card["max_model_len"] = self.engine.max_model_len
        return card

    async def models(self):
        return {"object": "list", "data": [self._card()]}

    async def model(self, model_id: str):
        """`GET /v1/models/{id}` (`client.models.retrieve`): the card, or 404 for another id."""
        return self._unknown_model(model_id) or self._card()

    async def metrics(self):
        return PlainTextResponse(prometheus_text(self.engine), media_type="text/plain; version=0.0.4")

    def _unknown_model(self, name: str) -> JSONResponse | None:
        if name == self.model_name:
            return None
        msg = f"model {show(name)} does not exist; this server serves {self.model_name!r}"
        return error_response(404, msg, param="model", code="model_not_found")

    async def completions(self, body: CompletionRequest, request: Request):
        if (bad := self._unknown_model(body.model)) is not None:
            return bad
        try:
            apply_defaults(body, self.defaults)
            body.refuse_unsupported()
            prompts = body.prompts()
            params = body.completion_sampling()
        except FlashNextError as e:
            return _bad(e)
        queue = lambda rid, sink: self._queue_prompts(rid, sink, prompts, params)  # noqa: E731
        return await self._serve(request, queue, body, chat=False, echo=body.echo)

    def _queue_prompts(self, rid: str, sink: Stream, prompts: list, params) -> Batch:
        """Worker thread: queue each prompt of a completions request (prompt i's choices answer as indices
        i*n .. i*n + n - 1); they share the group `rid`, so one abort cancels them all. A bad prompt cancels the
        ones already queued and its error names it."""
        parents = []
        try:
            for i, prompt in enumerate(prompts):
                own = rid if i == 0 else f"{rid}-{i}"
                shift = sink.shifted(i * params.n)
                parents.append(self.engine.add_request(prompt, dataclasses.replace(params), own, shift, group=rid,
                                                       length_field="max_tokens"))  # fmt: skip
        except FlashNextError as e:
            self.engine.abort(rid)
            if len(prompts) > 1:
                field = getattr(e, "field", None)
                raise BadRequest(f"prompt[{len(parents)}]: {e}", field and f"{field}[{len(parents)}]") from None
            raise
        return Batch(rid, parents)

    async def chat(self, body: ChatRequest, request: Request):
        if (bad := self._unknown_model(body.model)) is not None:
            return bad
        if self.tok is None:
            return error_response(400, "this model has no tokenizer, so no chat template; use /v1/completions with ids")
        urls: list[str] = []
        try:
            apply_defaults(body, self.defaults)
            body.refuse_unsupported()
            chat = chat_prompt(body, urls)
            max_tokens = body.completion_limit()
            limit = max_tokens or max(1, body.min_tokens)  # no limit: up to the context, set when queued
            params = body.sampling(limit, body.logprobs_setting(), end_of_turn_ids(self.tok))
        except FlashNextError as e:
            return _bad(e)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        box: dict = {}  # the answer's parser, made with the rendered prompt
        queue = lambda rid, sink: self._queue_chat(rid, sink, chat, urls, params, max_tokens, field, box)  # noqa: E731
        return await self._serve(request, queue, body, chat=True, box=box)

    def _queue_chat(self, rid: str, sink: Stream, chat, urls, params, max_tokens, field: str, box: dict):
        """Worker thread: render the chat template (images expanded), tokenize, queue the request; `box["parser"]`
        is the answer's `OutputParser` (its reasoning state read from the rendered prompt)."""
        kw = {}
        text = chat.render(self.tok)
        box["parser"] = chat.parser(text, self.reasoning, self.dialect)
        try:
            if urls:
                ids, images = _image_prompt(self.engine, self.tok, text, urls, self.images)
                kw = dict(pixel_values=images.pixel_values, image_grid_thw=images.image_grid_thw)
            else:
                ids = self.engine.encode(text)
        except jinja2.TemplateError as e:
            raise BadRequest(f"the chat template cannot render these messages: {e}", "messages") from None
        if max_tokens is None:  # up to the context
            params.max_tokens = max(1, self.engine.max_model_len - len(ids))
        return self.engine.add_request(ids, params, rid, sink, length_field=field, **kw)

    async def _serve(self, request: Request, queue: Callable, body, chat: bool, echo: bool = False, box=None):
        """Queue the request off the event loop, then answer it whole or as an SSE stream (`echo`: completions
        return each prompt before its completion; `box["parser"]`: a chat answer's parser)."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        sink = Stream(asyncio.get_running_loop())
        try:
            req = await off_loop(lambda: queue(rid, sink), lambda: self.engine.abort(rid))
        except FlashNextError as e:
            return _bad(e)
        self.loop.wake()
        fmt = Formatter(rid, self.model_name, self.tok, req.choices, chat, echo, body.include_usage)
        fmt.parser = (box or {}).get("parser")
        if body.stream:
            return StreamingResponse(self._sse(request, req, sink, fmt), media_type="text/event-stream")
        return await self._whole(req, sink, fmt)

    async def _whole(self, req, sink: Stream, fmt: Formatter):
        """The non-streamed answer: wait for every choice's finish snapshot (not `finished` flags, which run ahead
        of the queue); a failed choice makes the whole response its error."""
        texts, pending = [""] * len(req.choices), len(req.choices)
        try:
            while pending:
                i, _, text, reason = await sink.queue.get()
                texts[i] = text
                pending -= reason is not None
                if reason in FAILED_REASONS:
                    self.engine.abort(req.request_id)  # the other choices cannot make a response without this one
                    status, body = fmt.failure(req.choices[i])
                    return JSONResponse(body, status_code=status)
        except asyncio.CancelledError:
            self.engine.abort(req.request_id)
            raise
        return fmt.final(texts)

    async def _sse(self, request: Request, req, sink: Stream, fmt: Formatter) -> AsyncIterator[str]:
        """Server-sent events: text deltas per choice (holding back a possible stop-string prefix), then [DONE]."""
        n = len(req.choices)
        sent_tokens, sent_text, done = [0] * n, [""] * n, 0
        try:
            if fmt.chat:
                for i in range(n):
                    yield event(fmt.chunk(i, {"role": "assistant", "content": ""}, None))
            while done < n:
                try:
                    i, ntok, text, reason = await asyncio.wait_for(sink.queue.get(), timeout=1.0)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if reason in FAILED_REASONS:
                    self.engine.abort(req.request_id)
                    yield event(fmt.failure(req.choices[i])[1])
                    break
                hold = holdback(text, req.choices[i].params.stop) if reason is None else 0
                delta = text[len(sent_text[i]) : len(text) - hold] if len(text) - hold > len(sent_text[i]) else ""
                if ntok > sent_tokens[i] or delta or reason is not None:
                    done += reason is not None
                    for obj in fmt.deltas(i, delta, sent_tokens[i], ntok, reason):
                        yield event(obj)
                    sent_tokens[i], sent_text[i] = ntok, sent_text[i] + delta
            if fmt.include_usage and done == n:
                yield event(fmt.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            if not all(c.finished for c in req.choices):
                self.engine.abort(req.request_id)  # client went away (generator closed): free the slots


def _json_kind(python_type: str) -> str:
    return {"list": "array", "str": "string", "int": "number", "float": "number", "bool": "boolean",
            "NoneType": "null"}.get(python_type, python_type)  # fmt: skip


def _install_guards(app: FastAPI, api_key: str | None, max_request_bytes: int) -> None:
    """Validation errors as OpenAI 400 bodies naming the field, the API key on /v1/*, the body size limit."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """An unknown path (404), a wrong method (405) and the like, in OpenAI's error shape."""
        what = {404: "no such route", 405: "method not allowed on this route"}.get(exc.status_code, str(exc.detail))
        response = error_response(exc.status_code, f"{what}: {request.method} {request.url.path}",
                                  "not_found_error" if exc.status_code == 404 else "invalid_request_error")  # fmt: skip
        response.headers.update(exc.headers or {})  # 405 names the allowed methods in Allow
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # a syntax error: say where, as json does
            doc, pos = exc.body if isinstance(exc.body, str) else "", first.get("loc", ("body", 0))[-1]
            pos = pos if isinstance(pos, int) else 0
            line, column = doc.count("\n", 0, pos) + 1, pos - doc.rfind("\n", 0, pos)
            why = first.get("ctx", {}).get("error", "malformed JSON")
            return error_response(400, f"invalid JSON at line {line} column {column} (char {pos}): {why}")
        if tuple(first.get("loc", ())) == ("body",) and first.get("type") != "missing":
            got = type(first.get("input")).__name__
            return error_response(400, f"the request body must be a JSON object, got a JSON {_json_kind(got)}")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = first.get("msg", "malformed body")
        if "input" in first and first.get("type") != "missing" and where:
            msg += f", got {show(first['input'])}"
        return error_response(
            400, f"invalid request: {where}: {msg}" if where else f"invalid request: {msg}", param=where or None
        )

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith(("/v1/", "/inference/")):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error_response(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        return await call_next(request)

    # outermost: before auth reads anything; a weight upload streams (its handler checks the admin key first)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes, streamed=(rl_routes.UPLOAD_PATH,))


def build_app(
    engine: Engine,
    model_name: str,
    api_key: str | None = None,
    model_dir=None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    log_every: float = 10.0,
    admin_key: str | None = None,
    tool_call_parser: str = "auto",
    reasoning_parser: str = "auto",
) -> FastAPI:
    """The FastAPI app serving `engine` as model `model_name` (starts the engine thread on startup).

    `model_dir`: the checkpoint directory (its image processor config). `max_request_bytes`: larger request bodies
    get 413 (weight uploads are exempt: they stream). `log_every`: seconds between throughput log lines.
    `admin_key`: enables the weight-update routes (`serve/rl_routes.py`) behind `Authorization: Bearer KEY`.
    `tool_call_parser`, `reasoning_parser`: how chat answers are split (`Routes`; `serve/chat_parse.py`).
    """
    routes = Routes(engine, model_name, model_dir, tool_call_parser, reasoning_parser)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        routes.loop = EngineLoop(engine, log_every)
        yield
        routes.loop.stop()

    app = FastAPI(title="flashnext", version="0.1.0", lifespan=lifespan)
    _install_guards(app, api_key, max_request_bytes)
    app.get("/health")(routes.health)
    app.get("/v1/models")(routes.models)
    app.get("/v1/models/{model_id:path}")(routes.model)
    app.get("/metrics")(routes.metrics)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat)
    app.state.routes = routes
    app.state.rl_routes = rl_routes.install(app, routes, admin_key)
    return app


def _image_prompt(engine: Engine, tok, text: str, urls: list[str], state: dict):
    """Prompt ids with each image expanded into its placeholder span, and the images' `ImageInputs`.

    `text` is the rendered template with a sentinel per image; the text between sentinels is tokenized piece by
    piece (the span's special tokens split the text in the reference tokenizer too).
    """
    from flashnext.errors import InputError
    from flashnext.vision_inputs import image_processor, image_span, process_images

    model = engine.model
    vision = getattr(getattr(model, "model_config", None), "vision_config", None)
    if model.visual is None or vision is None:
        raise InputError("this model is text-only (no vision tower); it does not accept image_url content")
    if "processor" not in state:
        state["processor"] = image_processor(vision, state.get("model_dir"))
    images = process_images(urls, vision, state["processor"])
    pieces = text.split(IMAGE_SENTINEL)
    if len(pieces) != len(urls) + 1:
        raise InputError(f"{len(urls)} images but {len(pieces) - 1} image positions in the rendered chat template")
    cfg = model.model_config
    ids = list(tok.encode(pieces[0]))
    for n, piece in zip(images.num_tokens, pieces[1:], strict=True):
        ids += image_span(n, cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
        ids += tok.encode(piece)
    return ids, images
