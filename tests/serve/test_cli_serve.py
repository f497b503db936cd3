"""`flashnext serve` / `generate` as a user meets them: what a wrong --model is, --chat stopping at the end of
the turn, --served-model-name, a port already in use, the server's log lines."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
from serve_helpers import running_server

from flashnext import save_pretrained
from flashnext.cli import _serve_app, build_parser
from flashnext.cli import main as cli_main
from flashnext.errors import ConfigError
from flashnext.serve.loading import load_for_serving


def _touch(path, text="{}"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    ("layout", "needles"),
    [
        ("missing", ["does not exist"]),
        ("file", ["is a file"]),
        ("step", ["is a training checkpoint", "flashnext convert --checkpoint", "<out_dir>/final"]),
        ("run", ["training run directory", "final"]),
        ("checkpoints", ["holds training checkpoints", "step_00000020", "flashnext convert --checkpoint"]),
        ("empty", ["has no config.json", "not a model directory"]),
    ],
)
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_wrong_model_dir_says_what_it_is(tmp_path, capsys, layout, needles, command):
    path = tmp_path / "x"
    if layout == "file":
        _touch(path)
    elif layout == "step":
        _touch(path / "state.pt", "")
        _touch(path / "meta.json")
    elif layout == "run":
        _touch(path / "final" / "config.json")
        _touch(path / "checkpoints" / "step_00000010" / "meta.json")
    elif layout == "checkpoints":
        for step in (10, 20):
            _touch(path / f"step_{step:08d}" / "meta.json")
    elif layout == "empty":
        path.mkdir()
    extra = ["--port", "0"] if command == "serve" else []
    assert cli_main([command, "--model", str(path), *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"flashnext {command}: error: ") and str(path) in err
    for needle in needles:
        assert needle in err


def test_generate_chat_stops_at_end_of_turn(tmp_path, capsys):
    """A checkpoint whose <|im_end|> (id 4) logit row is made to win at the 3rd token: `generate --chat` stops
    there, as the server's chat endpoint does; the same prompt ids without --chat generate past it."""
    torch.set_num_threads(1)
    model, tok, _ = load_for_serving(None)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    from flashnext.serve.engine import Engine
    from flashnext.serve.sampling import SamplingParams

    greedy = Engine(model, tok, max_slots=1, max_model_len=64).generate([prompt], SamplingParams(temperature=0))
    with torch.no_grad():
        model.lm_head.weight[4] = model.lm_head.weight[greedy[0].token_ids[2]] * 1.5
    save_pretrained(model, tmp_path / "ckpt")
    tok.save(tmp_path / "ckpt")
    common = ["--model", str(tmp_path / "ckpt"), "--max-tokens", "8", "--threads", "1"]
    assert cli_main(["generate", "--chat", "--prompt", "Hello", *common]) == 0
    chat = capsys.readouterr().err
    assert "finish_reason=stop" in chat and ", 4]" in chat
    assert cli_main(["generate", "--ids", ",".join(map(str, prompt)), *common]) == 0
    plain = capsys.readouterr().err
    assert "8 tokens" in plain and "finish_reason=length" in plain
    assert chat.split("ids=[")[1].rstrip("]\n") in plain  # the same tokens up to the stop, then more


def test_serve_flushes_denormals_unless_kept(monkeypatch):
    """`serve` sets its threads' denormal mode after their count: flushed by default, kept with --keep-denormals
    (the mode itself: tests/test_denormals.py)."""
    import flashnext.denormals

    calls = []
    monkeypatch.setattr(flashnext.denormals, "flush_denormals", lambda on=True: calls.append(on) or 1)
    small = ["--max-slots", "1", "--max-model-len", "32", "--threads", "1"]
    _serve_app(build_parser().parse_args(["serve", *small]))
    _serve_app(build_parser().parse_args(["serve", "--keep-denormals", *small]))
    assert calls == [True, False]


def test_served_model_name():
    """--served-model-name is the id /v1/models lists and requests must name; the default stays flashnext-tiny."""
    torch.set_num_threads(1)
    small = ["--max-slots", "1", "--max-model-len", "32", "--threads", "1"]
    _, name, _ = _serve_app(build_parser().parse_args(["serve", *small]))
    assert name == "flashnext-tiny"
    app, name, _ = _serve_app(build_parser().parse_args(["serve", "--served-model-name", "my-model", *small]))
    with running_server(app) as base:
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == ["my-model"]
        body = {"model": "my-model", "prompt": [5, 6], "max_tokens": 2}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        assert httpx.post(f"{base}/v1/completions", json={**body, "model": name + "x"}).status_code == 404


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_port_out_of_range_is_one_line(capsys, port):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--port", port])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --port: must be an integer in [0, 65535], got '{port}'" in err and "Traceback" not in err


def test_a_runs_final_export_is_served_under_the_runs_name(tmp_path):
    from flashnext.serve.loading import served_name

    (tmp_path / "tiny-sft" / "final").mkdir(parents=True)
    assert served_name(tmp_path / "tiny-sft" / "final") == "tiny-sft"
    assert served_name(tmp_path / "tiny-sft") == "tiny-sft"


def test_busy_port_is_an_error_before_any_announcement(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli_main(["serve", "--port", str(port)]) == 1
    out = capsys.readouterr()
    assert "serving" not in out.out
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in out.err and "--port" in out.err


@pytest.mark.slow  # two processes; the in-process cases above cover the name and the port
def test_serve_process_name_logs_and_busy_port():
    """`flashnext serve` as a process: it announces the name, answers, logs each request on stderr; a second one
    on the same port exits 1 naming host:port, without announcing that it serves."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "flashnext", "serve", "--port", str(port), "--threads", "1", "--max-slots", "2"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen([*cmd, "--served-model-name", "my-model"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert f"serving 'my-model' on http://127.0.0.1:{port}/v1" in first.stdout.readline()
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            try:
                models = httpx.get(f"{base}/v1/models", timeout=5).json()
                break
            except httpx.TransportError:
                assert time.time() < deadline, "the server never answered"
                time.sleep(0.1)
        assert [m["id"] for m in models["data"]] == ["my-model"]
        r = httpx.post(
            f"{base}/v1/completions", json={"model": "my-model", "prompt": "hi", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert second.returncode == 1 and "serving" not in second.stdout
        assert f"cannot listen on 127.0.0.1:{port}" in second.stderr and "--port" in second.stderr
    finally:
        first.terminate()
        _, err = first.communicate(timeout=30)
    assert f"request {r.json()['id']} finished: length, prompt" in err


@pytest.mark.parametrize(
    ("device", "needle"),
    [("gpu0", "is not a torch device"), ("meta", "serving runs on cpu or cuda")]
    + ([] if torch.cuda.is_available() else [("cuda", "CUDA is not available")]),
)
def test_bad_device_is_named(capsys, device, needle):
    assert cli_main(["generate", "--device", device, "--max-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("flashnext generate: error: --device ") and needle in err


def test_dtype_auto_follows_the_checkpoint_and_decode_graph_flags(tmp_path, monkeypatch):
    """--dtype auto serves a bf16 checkpoint in bf16 and an fp32 one in fp32 (--dtype float32 overrides);
    --decode-graph on builds the engine's decode graph over the given buckets (compiled on first use), off none;
    --freeze-weights freezes its graphs, and without the decode graph is refused naming the flag it needs; so is
    --decode-run K (which reaches the engine), as is K below 1."""
    torch.set_num_threads(1)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))  # --decode-graph on sets it
    model, tok, _ = load_for_serving(None)
    save_pretrained(model, tmp_path / "fp32")
    save_pretrained(model.to(torch.bfloat16), tmp_path / "bf16")
    for name, want in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        args = build_parser().parse_args(["serve", "--model", str(tmp_path / name), "--max-slots", "4"])
        _, _, engine = _serve_app(args)
        assert next(engine.model.parameters()).dtype == want and engine.decode_graph is None
    args = ["serve", "--model", str(tmp_path / "bf16"), "--dtype", "float32", "--decode-graph", "on"]
    _, _, engine = _serve_app(build_parser().parse_args([*args, "--max-slots", "4", "--decode-buckets", "1,2"]))
    assert next(engine.model.parameters()).dtype == torch.float32
    assert engine.decode_graph.buckets == [1, 2, 4] and engine.decode_graph.compiles == 0
    assert not engine.frozen and not engine.decode_graph.frozen
    _, _, engine = _serve_app(build_parser().parse_args([*args, "--max-slots", "2", "--freeze-weights"]))
    assert engine.frozen and engine.decode_graph.frozen and engine.chunk_graph.frozen
    _, _, engine = _serve_app(build_parser().parse_args([*args, "--max-slots", "2", "--decode-run", "4"]))
    assert engine.decode_run == 4
    assert cli_main(["generate", "--decode-buckets", "1,x", "--decode-graph", "on"]) == 1
    with pytest.raises(ConfigError, match="--decode-graph on"):
        _serve_app(build_parser().parse_args(["serve", "--freeze-weights"]))
    for bad in (["--decode-run", "3"], [*args[3:], "--decode-run", "0"]):
        with pytest.raises(ConfigError, match=f"--decode-run {bad[-1]}: .*--decode-graph on"):
            _serve_app(build_parser().parse_args(["serve", *bad]))


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_speculative_tokens_need_an_mtp_head(tmp_path, capsys, command):
    """`--speculative-tokens K` with a checkpoint that has no MTP head is refused naming the flag and the model;
    the tiny default (which has one) speculates: `generate` reports the drafts it verified."""
    from flashnext.build import build_model
    from flashnext.config import parse_config, tiny_config_dict

    raw = {k: v for k, v in tiny_config_dict().items() if k != "mtp_num_hidden_layers"}
    save_pretrained(build_model(parse_config({**raw, "num_hidden_layers": 1, "layer_types": ["linear_attention"],
                                              "ple_layer_ids": [1]}).text, seed=0), tmp_path / "m")  # fmt: skip
    extra = ["--port", "0"] if command == "serve" else []
    assert cli_main([command, "--model", str(tmp_path / "m"), "--speculative-tokens", "3", *extra]) == 1
    err = capsys.readouterr().err
    assert f"--speculative-tokens 3: {tmp_path / 'm'} has no MTP draft head" in err
    if command == "generate":
        assert cli_main(["generate", "--speculative-tokens", "2", "--max-tokens", "12", "--threads", "1"]) == 0
        assert "drafts accepted" in capsys.readouterr().err


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_cancels_requests_in_flight_and_stops_in_one_line(sig):
    """Ctrl-C / SIGTERM with a long generation running: its client gets the 503 `aborted` body at once (no wait
    for 2000 tokens), the server says so in one line and exits 130 / by the signal, with no traceback."""
    import signal
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flashnext", "serve", "--port", str(port), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                httpx.get(f"{base}/health", timeout=5)
                break
            except httpx.TransportError:
                assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "slow"
                time.sleep(0.3)
        answers = []
        body = {"model": "flashnext-tiny", "prompt": "Hi", "max_tokens": 2000, "ignore_eos": True}
        client = threading.Thread(target=lambda: answers.append(httpx.post(f"{base}/v1/completions", json=body,
                                                                           timeout=120)))  # fmt: skip
        client.start()
        time.sleep(1.0)
        t0 = time.time()
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)
        client.join(timeout=60)
    finally:
        proc.kill()
    assert time.time() - t0 < 30  # did not wait for the 2000 tokens
    assert proc.returncode == (130 if sig == "SIGINT" else -signal.SIGTERM)
    assert f"flashnext serve: {sig}: shutting down, cancelling 1 request(s) in flight" in err
    assert "Traceback" not in err
    assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "aborted"


def test_speculative_auto_is_the_default_with_an_mtp_head(tmp_path):
    """The tiny default has an MTP head: served with no flag it speculates in auto mode (`serve.spec_auto`);
    `--speculative off` and `--speculative-tokens 0` turn it off, `--speculative-tokens 2` is a fixed k; a model
    without a head is served without speculation and without complaint."""
    from flashnext.build import build_model
    from flashnext.config import parse_config, tiny_config_dict

    def engine(*flags):
        return _serve_app(build_parser().parse_args(["serve", "--max-slots", "2", *flags]))[2]

    auto = engine()
    assert auto.spec_auto is not None and auto.num_speculative_tokens > 0
    for flags in (["--speculative", "off"], ["--speculative-tokens", "0"]):
        off = engine(*flags)
        assert off.spec_auto is None and off.num_speculative_tokens == 0
    fixed = engine("--speculative-tokens", "2")
    assert fixed.spec_auto is None and fixed.num_speculative_tokens == 2
    raw = {k: v for k, v in tiny_config_dict().items() if k != "mtp_num_hidden_layers"}
    save_pretrained(build_model(parse_config({**raw, "num_hidden_layers": 1, "layer_types": ["linear_attention"],
                                              "ple_layer_ids": [1]}).text, seed=0), tmp_path / "m")  # fmt: skip
    no_head = engine("--model", str(tmp_path / "m"))
    assert no_head.spec_auto is None and no_head.num_speculative_tokens == 0


def test_sigint_exits_130_even_when_the_server_returns(monkeypatch, capsys):
    """A SIGINT that stopped the server ends `serve` with exit 130 and its one line even when uvicorn's re-raised
    interrupt does not come out of `run` (asyncio's runner handles SIGINT itself): here `run` takes the signal
    and returns normally, as it did in the failing CI runs."""
    import signal

    import uvicorn

    def run(self, sockets=None):
        self.handle_exit(signal.SIGINT, None)
        assert self.should_exit

    monkeypatch.setattr(uvicorn.Server, "run", run)
    small = ["--port", "0", "--max-slots", "1", "--max-model-len", "32", "--threads", "1"]
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", *small])
    assert e.value.code == 130
    assert "stopped by SIGINT" in capsys.readouterr().err
