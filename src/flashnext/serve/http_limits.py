"""ASGI middleware capping the request body size (`flashnext serve --max-request-bytes`).

A body over the limit gets 413 with an OpenAI-style error body before the application reads or parses any of
it: with a `Content-Length` header at once; a chunked body is read up to the limit and refused when it goes past.
An accepted chunked body is buffered (the application would buffer it to parse the JSON anyway) and replayed.
Paths in `streamed` (the weight upload, which checks its key before reading and never holds the whole body) pass
through unlimited and unbuffered.
"""

from __future__ import annotations

import json

from flashnext.serve.protocol import error_body

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


class BodySizeLimit:
    """Refuse HTTP request bodies over `max_bytes` with 413.

    Args:
        app: the ASGI application to protect.
        max_bytes: the largest accepted body.
        streamed: paths whose bodies are streamed to the application as they come (no limit).
    """

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES, streamed: tuple[str, ...] = ()):
        self.app = app
        self.max_bytes = max_bytes
        self.streamed = streamed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in self.streamed:
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.max_bytes:
                return await self._refuse(send, f"request body is {int(declared)} bytes")
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._refuse(send, f"request body exceeds {self.max_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: disconnect notices
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        return await self.app(scope, replay, send)

    async def _refuse(self, send, what: str) -> None:
        message = f"{what}; the limit is {self.max_bytes} bytes (flashnext serve --max-request-bytes)"
        body = json.dumps(error_body(message, code="request_too_large")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
