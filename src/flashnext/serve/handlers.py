"""Pieces every HTTP handler of the server shares: a request's progress stream from the engine thread, running
engine calls off the event loop, and OpenAI-shaped error responses (`serve/server.py`, `serve/rl_routes.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi.responses import JSONResponse

from flashnext.serve.protocol import error_body


class Stream:
    """A request's progress as seen by its handler: (choice index, tokens so far, text, finish reason) snapshots.
    `shifted(k)` is a sink into the same queue whose choice indices start at k (prompt i of a batch: i * n)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue | None = None, offset: int = 0):
        self.loop, self.offset = loop, offset
        self.queue: asyncio.Queue = queue if queue is not None else asyncio.Queue()

    def shifted(self, offset: int) -> Stream:
        return Stream(self.loop, self.queue, offset)

    def __call__(self, req) -> None:  # engine thread
        snap = (self.offset + req.index, len(req.output_ids), req.text, req.finish_reason)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, snap)


async def off_loop(fn: Callable, on_cancel: Callable[[], None]):
    """`fn()` in a worker thread. If the caller is cancelled, `on_cancel` runs once `fn` has returned (so a
    request `fn` queued after the client left is still cancelled)."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None else on_cancel())
        raise


def error_response(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
    """An OpenAI-shaped error body with its HTTP status."""
    return JSONResponse(error_body(message, kind, param, code), status_code=status)
