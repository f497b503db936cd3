"""The HTTP server driven by the official `openai` client, concurrent streams with disconnects, bad requests."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serve_helpers import running_server

from flashnext.serve.engine import Engine
from flashnext.serve.loading import load_for_serving
from flashnext.serve.server import build_app

KEY = "test-key"
MAX_LEN = 96


@pytest.fixture(scope="module")
def server():
    """The tiny default model (seeded weights + bundled tokenizer) served on a free 127.0.0.1 port."""
    model, tok, name = load_for_serving(None)
    engine = Engine(model, tok, max_slots=8, max_model_len=MAX_LEN, max_num_batched_tokens=64)
    with running_server(build_app(engine, name, api_key=KEY)) as base:
        yield base, name, engine


@pytest.fixture(scope="module")
def client(server):
    base, _, _ = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)


def _wait_idle(engine, timeout=20.0):
    deadline = time.time() + timeout
    while engine.has_unfinished() or engine.cache.free_slots != engine.cache.max_slots:
        assert time.time() < deadline, f"slots not freed: {engine.cache.free_slots}/{engine.cache.max_slots}"
        time.sleep(0.05)


def test_models_and_completion(server, client):
    _, name, engine = server
    assert [m.id for m in client.models.list().data] == [name]
    out = client.completions.create(model=name, prompt="Hello world", max_tokens=6, temperature=0, logprobs=2)
    choice = out.choices[0]
    assert out.usage.completion_tokens == 6 and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == 6 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    # Greedy and deterministic: the engine's own API gives the same text; the token's logprob is the top-1's.
    again = client.completions.create(model=name, prompt="Hello world", max_tokens=6, temperature=0)
    assert again.choices[0].text == choice.text
    assert max(choice.logprobs.top_logprobs[0].values()) == pytest.approx(choice.logprobs.token_logprobs[0])


def test_seeded_sampling_reproducible(server, client):
    _, name, _ = server
    kw = dict(model=name, prompt=[5, 6, 7], max_tokens=8, temperature=1.0, top_p=0.9, seed=123)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_chat_and_streaming(server, client):
    _, name, _ = server
    messages = [{"role": "user", "content": "Hi there"}]
    full = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=1)  # fmt: skip
    assert full.choices[0].message.role == "assistant"
    assert len(full.choices[0].logprobs.content) == full.usage.completion_tokens
    stream = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0, stream=True)
    text, reasons = "", []
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert text == full.choices[0].message.content
    assert reasons[-1] in ("stop", "length")
    stream = client.completions.create(model=name, prompt="Hello world", max_tokens=6, temperature=0, stream=True)
    chunks = list(stream)
    streamed = "".join(c.choices[0].text for c in chunks)
    assert sum(len(c.choices[0].model_extra["token_ids"]) for c in chunks) == 6
    assert streamed == client.completions.create(model=name, prompt="Hello world", max_tokens=6, temperature=0)\
        .choices[0].text  # fmt: skip


def test_concurrent_streams_with_disconnects(server, client):
    """16 streaming clients at once (8 slots: half wait); every 4th hangs up after 2 chunks. All slots come back."""
    _, name, engine = server

    def one(i: int) -> int:
        stream = client.completions.create(model=name, prompt=f"client {i}", max_tokens=16, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        n = 0
        for _ in stream:
            n += 1
            if i % 4 == 0 and n == 2:
                stream.close()  # disconnect mid-stream
                return -1
        return n

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert results.count(-1) == 4 and all(r > 1 for r in results if r != -1)
    _wait_idle(engine)
    assert client.completions.create(model=name, prompt="still here", max_tokens=2).usage.completion_tokens == 2


def test_bad_requests(server):
    base, name, engine = server
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = f"{base}/v1/completions"
    vocab = engine.config.vocab_size
    cases = {
        "bad json": (b"{not json", 400),
        "missing prompt": (json.dumps({"model": name}), 400),
        "unknown model": (json.dumps({"model": "nope", "prompt": "x"}), 404),
        "max_tokens 0": (json.dumps({"model": name, "prompt": "x", "max_tokens": 0}), 400),
        "max_tokens -3": (json.dumps({"model": name, "prompt": "x", "max_tokens": -3}), 400),
        "too long": (json.dumps({"model": name, "prompt": [5] * MAX_LEN}), 400),
        "out of vocab": (json.dumps({"model": name, "prompt": [1, vocab]}), 400),
        "negative id": (json.dumps({"model": name, "prompt": [-1]}), 400),
        "empty prompt": (json.dumps({"model": name, "prompt": ""}), 400),
        "bad top_p": (json.dumps({"model": name, "prompt": "x", "top_p": 0}), 400),
    }
    for what, (body, status) in cases.items():
        r = httpx.post(url, content=body, headers=h)
        assert r.status_code == status, (what, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"], what
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": name, "messages": "hi"}, headers=h)
    assert r.status_code == 400
    r = httpx.post(url, json={"model": name, "prompt": "x"})  # no API key
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    r = httpx.post(url, json={"model": name, "prompt": "x", "max_tokens": 2}, headers=h)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_metrics(server, client):
    base, name, _ = server
    client.completions.create(model=name, prompt="metrics", max_tokens=3)
    text = httpx.get(f"{base}/metrics").text
    for metric in ("flashnext_requests_running", "flashnext_requests_waiting", "flashnext_generation_tokens_total",
                   "flashnext_generation_tokens_per_second", 'flashnext_time_to_first_token_seconds{quantile="0.5"}',
                   "flashnext_time_per_output_token_seconds_count"):  # fmt: skip
        assert metric in text
