"""OpenAI semantics the official client and other OpenAI-compatible servers rely on: `max_tokens` past the
context is a 400 naming both numbers, `/v1/models/{id}`, at least one chat message, usage streamed as its own last
chunk (`stream_options.include_usage`), OpenAI-shaped errors on unknown routes and methods, and a JSON syntax error
that says where."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_helpers import running_server

from flashnext.serve.engine import Engine
from flashnext.serve.loading import load_for_serving
from flashnext.serve.server import build_app

MAX_LEN = 64


@pytest.fixture(scope="module")
def server():
    model, tok, name = load_for_serving(None)
    engine = Engine(model, tok, max_slots=4, max_model_len=MAX_LEN, max_num_batched_tokens=32)
    with running_server(build_app(engine, name)) as base:
        yield base, name, tok


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0, timeout=60)


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_context_is_refused_naming_both_numbers(server, field):
    base, name, tok = server
    prompt = "The cat sat on the mat"
    n = len(tok.encode(prompt))
    if field == "max_tokens":  # completions
        r = httpx.post(f"{base}/v1/completions", json={"model": name, "prompt": prompt, field: MAX_LEN}, timeout=30)
    else:
        body = {"model": name, "messages": [{"role": "user", "content": prompt}], field: MAX_LEN}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        rendered = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        n = len(tok.encode(rendered))
    assert r.status_code == 400
    err = _error(r)
    assert err["param"] == field
    assert f"{field}={MAX_LEN}" in err["message"] and f"prompt's {n} tokens" in err["message"]
    assert f"context of {MAX_LEN} tokens" in err["message"]
    # what fits is served, and a chat without a limit still runs up to the context
    ok = {"model": name, "prompt": prompt, "max_tokens": MAX_LEN - len(tok.encode(prompt)), "temperature": 0}
    assert httpx.post(f"{base}/v1/completions", json=ok, timeout=60).status_code == 200


def test_models_retrieve(server, client):
    _, name, _ = server
    card = client.models.retrieve(name)
    assert card.id == name and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("someone/else")
    assert e.value.body["code"] == "model_not_found" and "someone/else" in e.value.body["message"]


def test_messages_must_not_be_empty(server):
    base, name, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": name, "messages": []}, timeout=30)
    assert r.status_code == 400 and _error(r)["param"] == "messages"
    assert "at least 1" in _error(r)["message"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_usage_streams_as_its_own_last_chunk(server, client, chat):
    _, name, _ = server
    kw = dict(model=name, max_tokens=5, temperature=0, n=2, stream=True)
    if chat:
        make = lambda **k: client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw, **k)  # noqa: E731
    else:
        make = lambda **k: client.completions.create(prompt="Hi", **kw, **k)  # noqa: E731
    chunks = list(make(stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert all(c.usage is None and len(c.choices) == 1 for c in body)
    assert all(c.usage is None for c in make())  # not asked: no usage on any chunk
    raw = httpx.post(f"{client.base_url}{'chat/completions' if chat else 'completions'}",
                     json={"model": name, "max_tokens": 2, "stream": True,
                           **({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"})},
                     timeout=30)  # fmt: skip
    assert '"usage"' not in raw.text


def test_stream_options_need_stream(server):
    base, name, _ = server
    body = {"model": name, "prompt": "Hi", "max_tokens": 2, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and _error(r)["param"] == "stream_options"


def test_unknown_routes_and_methods_answer_in_the_openai_shape(server):
    base, _, _ = server
    r = httpx.post(f"{base}/v1/nothing", json={}, timeout=30)
    assert r.status_code == 404 and "POST /v1/nothing" in _error(r)["message"]
    r = httpx.get(f"{base}/v1/completions", timeout=30)
    assert r.status_code == 405 and "GET /v1/completions" in _error(r)["message"]
    assert "POST" in r.headers["allow"]


def test_a_json_syntax_error_says_where(server):
    base, _, _ = server
    body = '{"model": "x",\n "prompt": "Hi" "max_tokens": 2}'
    r = httpx.post(f"{base}/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    err = _error(r)
    assert r.status_code == 400 and err["param"] is None
    with pytest.raises(json.JSONDecodeError) as want:  # the position as json itself reports it
        json.loads(body)
    w = want.value
    assert err["message"] == f"invalid JSON at line {w.lineno} column {w.colno} (char {w.pos}): {w.msg}"
    assert (w.lineno, w.colno) == (2, 17)
    r = httpx.post(f"{base}/v1/completions", content="[1, 2]", headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and _error(r)["message"] == "the request body must be a JSON object, got a JSON array"
