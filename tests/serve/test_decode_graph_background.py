"""The decode graph compiled in the background (`DecodeGraph.compile_in_background`): serving starts at once, a
bucket's decode steps run eager until its graph is compiled, then switch, with the same tokens.

The switching tests hold each compile on a gate (a compiler backend that waits for the test, then hands back the
traced graph as "eager" does), so when a bucket becomes ready is decided by the test, not by the box's load. The
real inductor compile, end to end through `flashnext serve`, is the slow test at the bottom.

Tokens: the graph runs the static step (padded to its bucket), whose logits equal the eager step's to fp32
rounding; on this tiny model and these prompts no greedy choice is that close (as in test_decode_graph.py), so the
tokens are compared exactly and the log-probs to a tolerance.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from serve_helpers import running_server, small_model

from flashnext.cli import main as cli_main
from flashnext.serve.chunk_graph import CHUNK_LENGTHS
from flashnext.serve.decode_graph import DecodeGraph
from flashnext.serve.engine import Engine
from flashnext.serve.sampling import SamplingParams
from flashnext.serve.server import build_app

TOL = dict(atol=2e-5, rtol=2e-5)  # fp32 rounding: other GEMM shapes than the eager step's (module doc)
KW = dict(max_slots=2, max_model_len=48, max_num_batched_tokens=16)


@pytest.fixture
def model(small_config):
    cfg = {**small_config, "num_hidden_layers": 2, "layer_types": ["linear_attention", "indexed_attention"],
           "ple_layer_ids": [1]}  # fmt: skip
    return small_model(cfg)


class Gate:
    """A compiler backend that holds every compile (after the first `let_through`) until `open` is set, then returns
    the traced graph unchanged, as the "eager" backend does; `entered` is set once a compile is waiting."""

    def __init__(self, let_through: int = 0):
        self.open = threading.Event()
        self.entered = threading.Event()
        self.let_through = let_through

    def __call__(self, gm, example_inputs):
        if self.let_through > 0:
            self.let_through -= 1
            return gm.forward
        self.entered.set()
        if not self.open.wait(120):
            raise TimeoutError("the test never opened the gate")
        return gm.forward


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (6, 9)]


# different lengths: batches of 2, then of 1 once the shorter request is done (both buckets are used)
PARAMS = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=0) for m in (14, 7)]


def _graph_engine(model, gate: Gate) -> tuple[Engine, list[int]]:
    """An engine with buckets [1, 2] compiled through `gate`, and the list of buckets its graph steps ran."""
    engine = Engine(model, **KW, decode_graph=True, decode_buckets=[1, 2], compile_backend=gate)
    graph, ran = engine.decode_graph, []
    run = graph.run
    graph.run = lambda ids, slots, cached: ran.append(graph.bucket(len(ids))) or run(ids, slots, cached)
    return engine, ran


def _same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), **TOL)


def test_steps_run_eager_until_their_bucket_is_compiled_then_switch(model):
    """While bucket 1's compile is held, whole generations run eager (the graph never runs) with the eager
    engine's tokens; then a generation whose compile finishes midway (after 3 steps) switches to the graphs of
    both buckets for its remaining decode steps and still gives the eager tokens; so does one after the switch."""
    want = Engine(model, **KW).generate(_prompts(), PARAMS)
    gate = Gate()
    engine, ran = _graph_engine(model, gate)
    graph = engine.decode_graph
    try:
        graph.compile_in_background()
        assert gate.entered.wait(60)  # bucket 1 is compiling (held)
        _same(engine.generate(_prompts(), PARAMS), want)
        assert ran == [] and graph.ready == set() and graph.compiling() == [1, 2]

        reqs = [engine.add_request(p, sp) for p, sp in zip(_prompts(), PARAMS, strict=True)]
        for _ in range(3):
            engine.step()
        assert ran == []
        gate.open.set()
        graph.background.join(60)
        assert not graph.background.is_alive() and graph.ready == {1, 2} and graph.compiling() == []
        while engine.has_unfinished():
            engine.step()
        _same([r.completion(False) for r in reqs], want)
        assert set(ran) == {1, 2}  # the rest of the generation ran through both graphs

        ran.clear()
        _same(engine.generate(_prompts(), PARAMS), want)
        assert ran.count(2) == 6 and ran.count(1) == 7  # every decode-only step: 13 decode steps after prefill
        assert graph.compiles == 2
    finally:
        gate.open.set()


def test_a_compiled_bucket_runs_while_the_next_one_compiles(model):
    """Bucket 1 compiled, bucket 2's compile held (a compile session open in the other thread): the batch-1 decode
    steps run the graph, the batch-2 ones eager, in one generation, with the eager engine's tokens."""
    want = Engine(model, **KW).generate(_prompts(), PARAMS)
    gate = Gate(let_through=1)
    engine, ran = _graph_engine(model, gate)
    try:
        engine.decode_graph.compile_in_background()
        assert gate.entered.wait(60) and engine.decode_graph.ready == {1}
        _same(engine.generate(_prompts(), PARAMS), want)
        assert ran == [1] * 7  # the longer request's steps alone; the 6 steps of two ran eager
        assert engine.decode_graph.background.is_alive()
    finally:
        gate.open.set()
    engine.decode_graph.background.join(60)


def test_eager_steps_see_weight_updates_while_a_bucket_compiles(model):
    """While a compile session is open in the background thread (torch's `is_compiling()` flag then reads True in
    every thread), the engine's eager steps still refresh the fused weights: an in-place update of a fused group's
    member made meanwhile gives the tokens and log-probs of a fresh eager engine over the updated model."""
    gate = Gate()
    engine, ran = _graph_engine(model, gate)
    try:
        engine.decode_graph.compile_in_background()
        assert gate.entered.wait(60)
        with torch.no_grad():
            model.model.layers[0].linear_attn.in_proj_qkv.weight.mul_(1.5)  # member of the fused in-projection
        got = engine.generate(_prompts(), PARAMS)
        assert ran == []
    finally:
        gate.open.set()
    engine.decode_graph.background.join(60)
    _same(got, Engine(model, **KW).generate(_prompts(), PARAMS))


def test_a_bucket_whose_compile_fails_stays_eager(model, caplog):
    """A compile that raises is logged and leaves its bucket eager (tokens unchanged); the other bucket compiles."""
    calls = []

    def flaky(gm, example_inputs):
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("compiler crashed")
        return gm.forward

    want = Engine(model, **KW).generate(_prompts(), PARAMS)
    engine = Engine(model, **KW, decode_graph=True, decode_buckets=[1, 2], compile_backend=flaky)
    engine.decode_graph.compile_in_background().join(60)
    assert engine.decode_graph.ready == {2} and engine.decode_graph.compiling() == [1]
    assert "compiling the decode step for batch 1 failed" in caplog.text
    _same(engine.generate(_prompts(), PARAMS), want)


def test_server_is_healthy_and_answers_while_buckets_compile(model):
    """The server answers /health (listing the pending buckets) and completes a request while every compile is
    held; /health lists them compiled once they are."""
    gate = Gate()
    engine, ran = _graph_engine(model, gate)
    try:
        engine.decode_graph.compile_in_background()
        with running_server(build_app(engine, "m")) as base:
            assert gate.entered.wait(60)
            health = httpx.get(f"{base}/health", timeout=30).json()
            pending_lengths = list(CHUNK_LENGTHS)  # prefill lengths compile after the decode buckets (`serve`)
            assert health == {
                "status": "ok", "decode_graph": {"compiled": [], "pending": [1, 2]},
                "prefill_graph": {"compiled": [], "pending": pending_lengths},
            }  # fmt: skip
            body = {"model": "m", "prompt": _prompts()[0], "max_tokens": 5, "temperature": 0}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5 and ran == []
            gate.open.set()
            engine.decode_graph.background.join(60)
            health = httpx.get(f"{base}/health", timeout=30).json()
            assert health["decode_graph"] == {"compiled": [1, 2], "pending": []}
    finally:
        gate.open.set()


def test_compile_cache_flag_points_inductor_at_the_directory(tmp_path, monkeypatch):
    """`--compile-cache DIR` sets inductor's cache dir; without it `$TORCHINDUCTOR_CACHE_DIR` is kept, else the
    persistent default under ~/.cache is used (not inductor's /tmp default)."""
    from flashnext.serve.decode_graph import use_compile_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert use_compile_cache(None).startswith(str(tmp_path / ".cache"))
    assert use_compile_cache(str(tmp_path / "c")) == str(tmp_path / "c")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c")
    assert use_compile_cache(None) == str(tmp_path / "c")  # the variable set by the user (or above) is kept


def test_generate_starts_eagerly_and_says_when_it_switches(tmp_path, capsys, monkeypatch):
    """`generate --decode-graph on` compiles its one bucket (batch 1) in the background, says so and when it is
    compiled, and prints the tokens of the plain `generate` (the compile backend is "eager" here: the wiring, not
    inductor, is under test; the slow test below runs inductor)."""
    init = DecodeGraph.__init__

    def eager_init(self, m, c, b=None, backend=None, frozen=False):
        init(self, m, c, b, "eager", frozen)

    monkeypatch.setattr(DecodeGraph, "__init__", eager_init)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # restored after the test (the flag sets it)
    common = ["--ids", "5,9,14,3,7", "--max-tokens", "8", "--threads", "1", "--max-slots", "2"]
    assert cli_main(["generate", *common]) == 0
    eager = capsys.readouterr()
    assert cli_main(["generate", "--decode-graph", "on", "--compile-cache", str(tmp_path / "c"), *common]) == 0
    graph = capsys.readouterr()
    assert graph.out == eager.out
    assert eager.err.split("ids=")[1] == graph.err.split("ids=")[1].split("\n")[0] + "\n"
    assert f"compiling batch bucket 1 in the background (cache {tmp_path / 'c'})" in graph.err
    assert "# decode graph: bucket 1 compiled in" in graph.err


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_while_a_bucket_compiles_stops_in_one_line(tmp_path, sig):
    """Ctrl-C / SIGTERM while inductor compiles a bucket in the background (a fresh compile cache: a minute or
    more here, so still compiling): exit 130 / by the signal within seconds, without the abort ("terminate called
    without an active exception", SIGABRT) that finalising the interpreter around the compile thread gave."""
    import signal

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "flashnext", "serve", "--port", str(port), "--threads", "1", "--max-slots", "1",
           "--decode-graph", "on", "--compile-cache", str(tmp_path / "cache")]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 120
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
                break
            except httpx.TransportError:
                assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "slow"
                time.sleep(0.3)
        assert health["decode_graph"]["pending"] == [1]
        time.sleep(5.0)  # well inside the compile (the abort came from some of its phases only)
        t0 = time.time()
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert time.time() - t0 < 30
    assert proc.returncode == (130 if sig == "SIGINT" else -signal.SIGTERM), err
    assert "terminate called" not in err and "Traceback" not in err
    assert f"flashnext serve: {sig}: shutting down" in err


@pytest.mark.slow
def test_serve_with_real_compile_is_ready_before_it_and_tokens_match(tmp_path):
    """`flashnext serve --decode-graph on` with a cold compile cache (a fresh dir): /health answers with the
    bucket pending (inductor takes a minute or more here), a completion then equals the eager `generate`'s tokens,
    and once the bucket is compiled the same request, run by the graph, gives them again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    common = ["--max-slots", "1", "--threads", "1", "--max-model-len", "64"]
    prompt = [5, 9, 14, 3, 7]
    eager = subprocess.run(
        [sys.executable, "-m", "flashnext", "generate", "--ids", ",".join(map(str, prompt)), "--max-tokens", "8",
         *common], capture_output=True, text=True, timeout=300, env=env, check=True,
    )  # fmt: skip
    want = eager.stdout.removesuffix("\n")  # the generated text
    cmd = [sys.executable, "-m", "flashnext", "serve", "--port", str(port), "--decode-graph", "on",
           "--compile-cache", str(tmp_path / "cache"), *common]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        start, base = time.time(), f"http://127.0.0.1:{port}"
        while True:
            assert proc.poll() is None and time.time() - start < 120, "serve did not become ready"
            try:
                health = httpx.get(f"{base}/health", timeout=5).json()
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert health["decode_graph"]["pending"] == [1]
        body = {"model": "flashnext-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}

        def tokens() -> str:
            return httpx.post(f"{base}/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]

        assert tokens() == want
        while httpx.get(f"{base}/health", timeout=5).json()["decode_graph"]["pending"]:
            assert proc.poll() is None and time.time() - start < 900, "the bucket did not compile"
            time.sleep(1)
        assert tokens() == want
    finally:
        proc.terminate()
        proc.wait(timeout=60)
