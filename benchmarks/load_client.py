"""Streaming load client for `serve_vs_reference.py`'s HTTP run, in its own process (no torch import).

Reads `{"url": ..., "prompts": [[ids], ...], "max_tokens": n}` as JSON on stdin, opens one streaming
/v1/completions request per prompt at once, and prints one JSON line: a list of
`[ttft_s, tpot_s, output_tokens, end_time_s]` (times relative to the start of the run).

A separate process keeps the client's Python work off the server's interpreter: in one process the client's
event loop, uvicorn's and the engine thread all contend for one GIL, which inflated the measured TPOT.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx


async def one_stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, t0: float):
    """(ttft, tpot, output tokens, end time) of one streaming completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens + 1  # a chunk per token
            last = time.perf_counter()
            first = first or last
    tpot = (last - first) / max(1, tokens - 1)
    return [first - start, tpot, tokens, last - t0]


async def run(url: str, prompts: list[list[int]], max_tokens: int) -> list:
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        t0 = time.perf_counter()
        return await asyncio.gather(*(one_stream(client, url, p, max_tokens, t0) for p in prompts))


if __name__ == "__main__":
    job = json.loads(sys.stdin.read())
    print(json.dumps(asyncio.run(run(job["url"], job["prompts"], job["max_tokens"]))))
