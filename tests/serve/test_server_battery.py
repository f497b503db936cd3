"""Bad requests and failing generations against the running server, beside an innocent stream.

While the battery runs, greedy streaming requests run back to back in a thread (`Innocent`); every one of them
must finish untouched: its tokens equal the same request run alone before the battery, finish reason "length",
no error event. Each case checks the innocent runs completed so far; the last test checks them all.

The served model is wrapped (`StepFault`): a prompt starting with `RAISE` makes its model step raise, one starting
with `NAN` gets NaN logits; generated tokens never trigger either. Every refusal must name the bad field and value
(`needles`), nothing may answer 500 except a generation that failed, and nothing may report a failure as "stop".
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from serve_helpers import GatedTokenizer, StepFault, running_server, sse_events

from flashnext.serve.engine import Engine
from flashnext.serve.loading import load_for_serving
from flashnext.serve.server import build_app

KEY = "test-key"
H = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
MAX_LEN = 96
RAISE, NAN = 0, 1  # <|pad|>, <|bos|>: never the first token of an encoded text or chat prompt
INNOCENT = {"prompt": list(range(30, 42)), "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
PROMPT = [40, 41, 42, 43]  # of the degenerate-but-valid cases


@pytest.fixture(scope="module")
def server():
    torch.set_num_threads(1)  # module fixtures run before the per-test one-thread fixture
    model, tok, name = load_for_serving(None)
    # 10 ms of sleep per step: the innocent streams overlap every case yet leave the CPU (and GIL) to the cases.
    StepFault(model, RAISE, where="start", delay=0.01)
    StepFault(model, NAN, mode="nan", where="start")
    engine = Engine(model, tok, max_slots=8, max_model_len=MAX_LEN, max_num_batched_tokens=64)
    with running_server(build_app(engine, name, api_key=KEY)) as base:
        yield base, name, engine


class Innocent:
    """Greedy streaming requests run back to back in a thread; `check()` compares each with `reference`."""

    def __init__(self, base: str, name: str):
        self.url, self.body = f"{base}/v1/completions", {"model": name, **INNOCENT}
        self.runs: list = []
        self.spans: list[tuple[float, float]] = []
        self.started = float("inf")
        self.reference = self.run_once()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def run_once(self) -> tuple[list[int], list[str], list, bool]:
        """(token ids, finish reasons, error events, ended with [DONE]) of one streamed request."""
        with httpx.stream("POST", self.url, json=self.body, headers=H, timeout=60) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        chunks = [e for e in events if isinstance(e, dict) and "choices" in e]
        tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        return tokens, reasons, errors, events[-1:] == ["[DONE]"]

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.started = time.perf_counter()
            try:
                self.runs.append(self.run_once())
            except Exception as e:  # reported by check()
                self.runs.append(e)
            self.spans.append((self.started, time.perf_counter()))
            self.started = float("inf")  # between runs

    def overlapped(self, t0: float, t1: float) -> bool:
        """Whether an innocent stream was in flight at some time in [t0, t1] (one still running started before t1)."""
        return self.started < t1 or any(s < t1 and e > t0 for s, e in self.spans)

    def check(self) -> None:
        tokens, reasons, errors, done = self.reference
        assert len(tokens) == 60 and reasons == ["length"] and not errors and done
        for run in list(self.runs):
            assert run == self.reference, f"an innocent stream was disturbed: {run}"

    def stop(self) -> int:
        self._stop.set()
        self.thread.join(timeout=60)
        return len(self.runs)


@pytest.fixture(scope="module")
def innocent(server):
    base, name, _ = server
    bystander = Innocent(base, name)
    yield bystander
    bystander.stop()


def _raw(**fields) -> str:
    """A JSON body with some values written as raw JSON text (NaN, Infinity, escapes, huge ints)."""
    return "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}"


def C(path: str, body, status: int, needles=(), param=None, id=None):
    return pytest.param(path, body, status, needles, param, id=id)


M = '"flashnext-tiny"'
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = '[{"role": "user", "content": "hi"}]'
REFUSALS = [
    C(CMPL, "{not json", 400, ["JSON"], id="bad-json"),
    C(CMPL, _raw(model=M), 400, ["prompt", "Field required"], "prompt", id="missing-prompt"),
    C(CMPL, _raw(model='"nope"', prompt='"x"'), 404, ["'nope'"], "model", id="unknown-model"),
    C(CMPL, _raw(model=M, prompt='"x"', max_tokens=0), 400, ["max_tokens", "0"], "max_tokens", id="max_tokens-0"),
    C(CMPL, _raw(model=M, prompt='"x"', max_tokens=-3), 400, ["max_tokens", "-3"], "max_tokens", id="max_tokens-neg"),
    C(CMPL, _raw(model=M, prompt='"x"', max_tokens="Infinity"), 400, ["max_tokens", "inf"], id="max_tokens-inf"),
    C(
        CMPL,
        _raw(model=M, prompt=json.dumps([5] * MAX_LEN)),
        400,
        ["96 tokens", "max_model_len=96"],
        "prompt",
        id="too-long-ids",
    ),  # fmt: skip
    C(CMPL, _raw(model=M, prompt="[1, 512]"), 400, ["512", "vocabulary"], "prompt", id="out-of-vocab"),
    C(CMPL, _raw(model=M, prompt="[-1]"), 400, ["-1", "vocabulary"], "prompt", id="negative-id"),
    C(
        CMPL,
        _raw(model=M, prompt='"x"', num_speculative_tokens=99),
        400,
        ["num_speculative_tokens", "99"],
        "num_speculative_tokens",
        id="speculative-tokens-99",
    ),  # fmt: skip
    C(CMPL, _raw(model=M, prompt='""'), 400, ["prompt is empty"], "prompt", id="empty-prompt"),
    C(CMPL, _raw(model=M, prompt='["a", ""]'), 400, ["prompt[1]: prompt is empty"], "prompt[1]", id="batch-empty-one"),
    C(CMPL, _raw(model=M, prompt="[]"), 400, ["prompt is empty"], "prompt", id="empty-batch"),
    C(
        CMPL,
        _raw(model=M, prompt='"a\\ud800b"'),
        400,
        ["prompt", "surrogate", "'\\ud800'"],
        "prompt",
        id="surrogate-prompt",
    ),  # fmt: skip
    C(
        CMPL,
        _raw(model=M, prompt='"x"', temperature="NaN"),
        400,
        ["temperature", "nan"],
        "temperature",
        id="temperature-NaN",
    ),  # fmt: skip
    C(
        CMPL,
        _raw(model=M, prompt='"x"', temperature="Infinity"),
        400,
        ["temperature", "inf"],
        "temperature",
        id="temperature-inf",
    ),  # fmt: skip
    C(
        CMPL,
        _raw(model=M, prompt='"x"', temperature="-Infinity"),
        400,
        ["temperature", "-inf"],
        "temperature",
        id="temperature-neg-inf",
    ),  # fmt: skip
    C(CMPL, _raw(model=M, prompt='"x"', top_p="NaN"), 400, ["top_p", "nan"], "top_p", id="top_p-NaN"),
    C(CMPL, _raw(model=M, prompt='"x"', top_p="Infinity"), 400, ["top_p", "inf"], "top_p", id="top_p-inf"),
    C(CMPL, _raw(model=M, prompt='"x"', top_p=0), 400, ["top_p", "0"], "top_p", id="top_p-0"),
    C(CMPL, _raw(model=M, prompt='"x"', seed=2**63), 400, ["seed", str(2**63)], "seed", id="seed-2^63"),
    C(
        CMPL,
        _raw(model=M, prompt='"x"', seed=-(2**63) - 1),
        400,
        ["seed", str(-(2**63) - 1)],
        "seed",
        id="seed-below-int64",
    ),  # fmt: skip
    C(CMPL, _raw(model=M, prompt='"x"', seed=10**30), 400, ["seed", str(10**30)], "seed", id="seed-1e30"),
    C(CMPL, _raw(model=M, prompt='"x"', stop='[""]'), 400, ["stop[0]", "non-empty"], "stop[0]", id="empty-stop"),
    C(CMPL, _raw(model=M, prompt='"x"', logprobs=21), 400, ["logprobs", "21"], "logprobs", id="logprobs-21"),
    C(CMPL, _raw(model=M, prompt='"x"', n=0), 400, ["n must", "0"], "n", id="n-0"),
    C(CMPL, _raw(model=M, prompt='"x"', n=9), 400, ["n=9", "max_slots=8"], "n", id="n-over-slots"),
    C(CMPL, _raw(model=M, prompt='"x"', max_tokens=0), 400, ["max_tokens", "allowed with echo"], "max_tokens",
      id="max-tokens-0-without-echo"),  # fmt: skip
    C(CMPL, _raw(model=M, prompt='"x"', logit_bias='{"5": 101}'), 400, ["logit_bias[5]", "[-100, 100]", "101"],
      "logit_bias", id="logit_bias-101"),  # fmt: skip
    C(CMPL, _raw(model=M, prompt='"x"', logit_bias='{"five": 1}'), 400, ["logit_bias", "'five'"], "logit_bias",
      id="logit_bias-key-not-an-id"),  # fmt: skip
    C(CMPL, _raw(model=M, prompt='"x"', presence_penalty=2.5), 400, ["presence_penalty", "[-2, 2]", "2.5"],
      "presence_penalty", id="presence_penalty-2.5"),  # fmt: skip
    C(CMPL, _raw(model=M, prompt='"x"', frequency_penalty="NaN"), 400, ["frequency_penalty", "nan"],
      "frequency_penalty", id="frequency_penalty-NaN"),  # fmt: skip
    C(CHAT, _raw(model=M, messages=USER, repetition_penalty=0), 400, ["repetition_penalty", "> 0"],
      "repetition_penalty", id="chat-repetition_penalty-0"),  # fmt: skip
    C(
        CMPL,
        _raw(model=M, prompt='"' + "a" * 40_000 + '"'),
        400,
        ["40000 bytes", "max_model_len=96", "not tokenized"],
        "prompt",
        id="prompt-certainly-too-long",
    ),  # fmt: skip
    C(CHAT, _raw(model=M, messages='"hi"'), 400, ["messages"], "messages", id="chat-messages-not-a-list"),
    C(
        CHAT,
        _raw(model=M, messages=USER, max_completion_tokens=0),
        400,
        ["max_completion_tokens", "0"],
        "max_completion_tokens",
        id="chat-max_completion_tokens-0",
    ),  # fmt: skip
    C(CHAT, _raw(model=M, messages=USER, max_tokens=0), 400, ["max_tokens", "0"], "max_tokens", id="chat-max_tokens-0"),
    C(
        CHAT,
        _raw(model=M, messages='[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]'),
        400,
        ["messages[0].content[0]", "'input_audio'", "not supported"],
        "messages[0].content[0].type",
        id="chat-input_audio",
    ),  # fmt: skip
    C(
        CHAT,
        _raw(model=M, messages='[{"role": "user", "content": [{"text": "hi"}]}]'),
        400,
        ["messages[0].content[0]", "None"],
        "messages[0].content[0].type",
        id="chat-part-without-type",
    ),  # fmt: skip
    C(
        CHAT,
        _raw(model=M, messages='[{"role": "user", "content": [{"type": "text", "text": 5}]}]'),
        400,
        ["messages[0].content[0].text", "must be a string", "5"],
        "messages[0].content[0].text",
        id="chat-text-not-string",
    ),  # fmt: skip
    C(
        CHAT,
        _raw(model=M, messages='[{"role": "user", "content": "a\\ud800b"}]'),
        400,
        ["messages[0].content", "surrogate"],
        "messages[0].content",
        id="chat-surrogate-content",
    ),  # fmt: skip
    C(
        CHAT,
        _raw(model=M, messages='[{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]'),
        400,
        ["messages[0].content[0].text", "surrogate"],
        "messages[0].content[0].text",
        id="chat-surrogate-part",
    ),
    C(
        CHAT,
        _raw(model=M, messages='[{"role": "us\\ud800er", "content": "hi"}]'),
        400,
        ["messages[0].role", "surrogate"],
        "messages[0].role",
        id="chat-surrogate-role",
    ),  # fmt: skip
    C(
        CHAT,
        _raw(model=M, messages=USER, temperature="NaN"),
        400,
        ["temperature", "nan"],
        "temperature",
        id="chat-temperature-NaN",
    ),  # fmt: skip
    C(
        CHAT,
        _raw(model=M, messages=USER, top_logprobs=2),
        400,
        ["top_logprobs", "logprobs: true"],
        "top_logprobs",
        id="chat-top_logprobs-without-logprobs",
    ),  # fmt: skip
    C(
        CHAT,
        _raw(model=M, messages=USER, response_format='{"type": "yaml"}'),
        400,
        ["response_format.type", "yaml"],
        "response_format.type",
        id="chat-response_format",
    ),  # fmt: skip
    C(CHAT, _raw(model=M, messages=USER, n=9), 400, ["n=9"], "n", id="chat-n-over-slots"),
]


@pytest.mark.parametrize(("path", "body", "status", "needles", "param"), REFUSALS)
def test_refused(server, innocent, path, body, status, needles, param):
    base, _, _ = server
    t0 = time.perf_counter()
    r = httpx.post(f"{base}{path}", content=body.encode("utf-8", "surrogatepass"), headers=H, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" or status == 404
    for needle in needles:
        assert needle in err["message"], (needle, err["message"])
    if param is not None:
        assert err["param"] == param
    assert time.perf_counter() - t0 < 10
    innocent.check()


DEGENERATE = [
    pytest.param({"temperature": 1e-45}, id="temperature-1e-45"),
    pytest.param({"temperature": 1.0, "top_p": 1e-300}, id="top_p-1e-300"),
    pytest.param({"temperature": 1e300, "top_k": 1}, id="temperature-1e300-top_k-1"),
]


@pytest.mark.parametrize("sampling", DEGENERATE)
def test_degenerate_values_are_greedy(server, innocent, sampling):
    """Finite extremes keep their limiting meaning (see `flashnext.serve.sampling`): here all are greedy."""
    base, name, _ = server
    body = {"model": name, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "seed": 3}
    greedy = httpx.post(f"{base}{CMPL}", json={**body, "temperature": 0}, headers=H, timeout=30).json()
    r = httpx.post(f"{base}{CMPL}", json={**body, **sampling}, headers=H, timeout=30)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == greedy["choices"][0]["token_ids"] and choice["finish_reason"] == "length"
    innocent.check()


FAILING = [
    pytest.param(CMPL, {"prompt": [RAISE, 5, 6]}, "injected fault", id="model-step-raises"),
    pytest.param(CMPL, {"prompt": [NAN, 5, 6]}, "not finite", id="nan-logits"),
    pytest.param(CMPL, {"prompt": [RAISE, 5, 6], "n": 2}, "injected fault", id="model-step-raises-n2"),
    pytest.param(CMPL, {"prompt": [NAN, 7], "n": 3, "temperature": 1.0}, "not finite", id="nan-logits-n3"),
]


@pytest.mark.parametrize(("path", "extra", "needle"), FAILING)
def test_failed_generation_is_an_error(server, innocent, path, extra, needle):
    """A generation that fails answers 500 with an OpenAI error body; its stream sends an error event then
    [DONE]; neither says "stop". The innocent stream beside it goes on untouched."""
    base, name, _ = server
    body = {"model": name, "max_tokens": 8, "temperature": 0, **extra}
    t0 = time.perf_counter()
    r = httpx.post(f"{base}{path}", json=body, headers=H, timeout=30)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "generation_failed" and needle in err["message"]
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}, headers=H, timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and needle in events[-2]["error"]["message"]
    assert all(c["choices"][0]["finish_reason"] is None for c in events if isinstance(c, dict) and "choices" in c)
    assert innocent.overlapped(t0, time.perf_counter())
    innocent.check()


def test_innocent_streams_untouched(innocent):
    """Every innocent stream run during the battery equals the undisturbed one."""
    deadline = time.time() + 60
    while not innocent.runs:
        assert time.time() < deadline
        time.sleep(0.05)
    innocent.stop()
    innocent.check()


@pytest.fixture
def gated_server():
    """A server whose tokenizer blocks on a gate character until released, with a 4 KiB body limit."""
    model, tok, name = load_for_serving(None)
    gated = GatedTokenizer(tok)
    engine = Engine(model, gated, max_slots=2, max_model_len=MAX_LEN, max_num_batched_tokens=64)
    with running_server(build_app(engine, name, max_request_bytes=4096)) as base:
        yield base, name, gated
        gated.release.set()


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_tokenizing_does_not_block_the_server(gated_server, path):
    """While a prompt is being tokenized (here: as long as the test wants), /health answers at once."""
    base, name, gated = gated_server
    body = {"model": name, "max_tokens": 2, "temperature": 0}
    body |= {"prompt": "snow \u2603"} if path == CMPL else {"messages": [{"role": "user", "content": "snow \u2603"}]}
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=httpx.post(f"{base}{path}", json=body, timeout=60)))
    worker.start()
    assert gated.entered.wait(30)
    t0 = time.perf_counter()
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    assert time.perf_counter() - t0 < 2.0
    gated.release.set()
    worker.join(60)
    assert result["r"].status_code == 200


def test_body_size_limit(gated_server):
    """A body over the limit gets 413 with an error body, declared (Content-Length) or chunked, before anything
    reads it (the tokenizer never sees the prompt); a body under it is served."""
    base, name, gated = gated_server
    url = f"{base}{CMPL}"
    big = json.dumps({"model": name, "prompt": "a" * 5000}).encode()
    r = httpx.post(url, content=big, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "limit is 4096 bytes" in r.json()["error"]["message"]
    assert f"is {len(big)} bytes" in r.json()["error"]["message"]
    chunked = (big[i : i + 1000] for i in range(0, len(big), 1000))
    r = httpx.post(url, content=chunked, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert gated.calls == 0
    small = (json.dumps({"model": name, "prompt": [5, 6], "max_tokens": 2}).encode(),)
    r = httpx.post(url, content=iter(small), headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
