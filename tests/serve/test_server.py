"""The HTTP server driven by the official `openai` client: completions, chat, streaming, n choices, concurrent
streams with disconnects, metrics and logs. Bad requests and failing generations: `test_server_battery.py`."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serve_helpers import running_server

from flashnext.serve.engine import Engine
from flashnext.serve.loading import load_for_serving
from flashnext.serve.sampling import choice_seed
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
    text, reasoning, reasons = "", "", []
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning") or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert text == full.choices[0].message.content
    # thinking is on by default (the template opens a think block): the answer so far is reasoning
    assert reasoning == (full.choices[0].message.model_extra["reasoning"] or "")
    assert reasons[-1] in ("stop", "length")
    stream = client.completions.create(model=name, prompt="Hello world", max_tokens=6, temperature=0, stream=True)
    chunks = list(stream)
    streamed = "".join(c.choices[0].text for c in chunks)
    assert sum(len(c.choices[0].model_extra["token_ids"]) for c in chunks) == 6
    assert streamed == client.completions.create(model=name, prompt="Hello world", max_tokens=6, temperature=0)\
        .choices[0].text  # fmt: skip


def test_n_choices(server, client):
    """n choices share one prefill (the engine counts the prompt once); greedy choices are identical, seeded
    sampled choice i equals a request with `choice_seed(seed, i)`, and a stream interleaves the choices by index."""
    _, name, engine = server
    prompt = "Once upon a time"
    n_prompt = len(engine.encode(prompt))
    before = engine.stats.prompt_tokens
    out = client.completions.create(model=name, prompt=prompt, max_tokens=7, temperature=0, n=3,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert engine.stats.prompt_tokens - before == n_prompt
    assert [c.index for c in out.choices] == [0, 1, 2] and len({c.text for c in out.choices}) == 1
    assert out.usage.prompt_tokens == n_prompt and out.usage.completion_tokens == 21

    messages = [{"role": "user", "content": "Tell me a story"}]
    kw = dict(model=name, messages=messages, max_tokens=8, temperature=1.0, top_p=0.95)
    out = client.chat.completions.create(n=2, seed=77, **kw)
    alone = [client.chat.completions.create(seed=choice_seed(77, i), **kw).choices[0] for i in range(2)]
    assert [c.message.content for c in out.choices] == [a.message.content for a in alone]

    stream = client.chat.completions.create(n=2, seed=77, stream=True, stream_options={"include_usage": True}, **kw)
    texts, order, finished = ["", ""], [], {}
    *chunks, chunk = stream  # the last chunk carries the usage alone (include_usage)
    assert chunk.choices == []
    for c in (ch.choices[0] for ch in chunks):
        texts[c.index] += c.delta.content or ""
        order.append(c.index)
        if c.finish_reason is not None:
            finished[c.index] = c.finish_reason
    assert texts == [c.message.content for c in out.choices] and sorted(finished) == [0, 1]
    assert order[:2] == [0, 1] and set(order) == {0, 1}  # each choice's role chunk, then their deltas
    assert chunk.usage is not None and chunk.usage.completion_tokens == out.usage.completion_tokens


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


def test_auth_and_health(server):
    base, name, _ = server
    r = httpx.post(f"{base}/v1/completions", json={"model": name, "prompt": "x"})  # no API key
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}


def test_metrics_and_logs(server, client, caplog):
    """/metrics: counters, and generation tokens/s over a recent window (0 once that window is idle, while the
    counters stay). The server logs one line per finished request."""
    base, name, engine = server
    caplog.set_level(logging.INFO, logger="flashnext.serve")
    out = client.completions.create(model=name, prompt="metrics", max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    text = httpx.get(f"{base}/metrics").text
    metrics = [
        "flashnext_requests_running",
        "flashnext_requests_waiting",
        "flashnext_generation_tokens_total",
        'flashnext_time_to_first_token_seconds{quantile="0.5"}',
        "flashnext_time_per_output_token_seconds_count",
        'flashnext_requests_finished_by_reason_total{finish_reason="error"}',
        "flashnext_step_failures_total",
        "# HELP flashnext_generation_tokens_per_second tokens generated per second over the last 10 s",
    ]
    for metric in metrics:
        assert metric in text
    rate = float(text.split("\nflashnext_generation_tokens_per_second ")[1].split()[0])
    assert rate >= 0.3  # at least these 3 tokens within the last 10 s
    assert engine.stats.recent_rates(time.perf_counter() + engine.stats.rate_seconds + 1) == (0.0, 0.0)
    deadline = time.time() + 5
    while not any(out.id in r.getMessage() for r in caplog.records):
        assert time.time() < deadline, "no log line for the finished request"
        time.sleep(0.02)
    line = next(r.getMessage() for r in caplog.records if out.id in r.getMessage())
    n_prompt = out.usage.prompt_tokens
    assert f"finished: length, prompt {n_prompt} tokens, completion 3 tokens, ttft " in line


def test_throughput_log_line(caplog):
    """While busy, the engine loop logs the recent throughput (here every step: `log_every=0`)."""
    caplog.set_level(logging.INFO, logger="flashnext.serve")
    model, tok, name = load_for_serving(None)
    engine = Engine(model, tok, max_slots=2, max_model_len=32, max_num_batched_tokens=16)
    with running_server(build_app(engine, name, log_every=0.0)) as base:
        r = httpx.post(f"{base}/v1/completions", json={"model": name, "prompt": [5, 6], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
    lines = [r.getMessage() for r in caplog.records if "generated tokens/s" in r.getMessage()]
    assert lines and "running" in lines[0] and "free slots" in lines[0]


def test_speculative_request_over_http(server, client, caplog):
    """A request body's `num_speculative_tokens` (the tiny default has an MTP head): the same greedy text as
    without; /metrics counts its drafts and the log line shows its acceptance."""
    base, name, engine = server
    caplog.set_level(logging.INFO, logger="flashnext.serve")
    kw = dict(model=name, prompt="The cat", max_tokens=16, temperature=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True})
    before = engine.stats.spec_verify_steps
    spec = client.completions.create(**kw, extra_body={"ignore_eos": True, "num_speculative_tokens": 3})
    assert spec.choices[0].text == plain.choices[0].text
    assert engine.stats.spec_verify_steps > before
    text = httpx.get(f"{base}/metrics").text
    assert f"flashnext_spec_draft_tokens_total {engine.stats.spec_drafted}" in text
    assert "flashnext_spec_mean_accepted_length " in text and "flashnext_spec_request_acceptance_rate_count" in text
    deadline = time.time() + 5
    while not any(spec.id in r.getMessage() and "drafts accepted" in r.getMessage() for r in caplog.records):
        assert time.time() < deadline, "no log line with the request's acceptance"
        time.sleep(0.05)
