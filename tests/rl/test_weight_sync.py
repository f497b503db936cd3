"""Weight sync: after a sync every engine tensor equals the trainer's bitwise (copies) and the engine's log-probs
equal the trainer model's forward (fp32, to rounding: different kernels), in one process with no model-sized
allocation, and through the server's admin endpoint (tensor by tensor, row pieces), where a sync under load of 16
clients loses no request and each request runs on exactly one version of the weights."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from rl_helpers import text_model

sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))
from serve_helpers import StepFault, running_server  # noqa: E402

from flashnext.build import build_model  # noqa: E402
from flashnext.errors import FlashNextError  # noqa: E402
from flashnext.rl import weights  # noqa: E402
from flashnext.rl.inference import post_json  # noqa: E402
from flashnext.serve.engine import Engine  # noqa: E402
from flashnext.serve.sampling import SamplingParams  # noqa: E402
from flashnext.serve.server import build_app  # noqa: E402
from flashnext.tokenizer import load_tokenizer  # noqa: E402

KEY = "admin-secret"
# The engine's fused/skinny serving GEMMs and cached decode vs the trainer's plain forward: fp32 rounding, not bits.
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def tok():
    torch.set_num_threads(2)
    return load_tokenizer()


def _fresh_engine_model(trainer):
    """A second instance with different weights (as a server that has not been synced yet)."""
    return build_model(trainer.config, seed=123)


def _train_a_little(model, seed: int = 0):
    """An AdamW step on a random next-token loss: every trainable tensor moves."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 500, (24,), generator=torch.Generator().manual_seed(seed))
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _forward_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor(prompt + tokens)).logits[len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def _assert_engine_matches(engine, trainer, tok, seed=0):
    prompts = [tok.encode("Q: Reverse: cat sun map\nA:"), tok.encode("Q: What is 3 plus 4?\nA:")]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, logprobs=0, ignore_eos=True)
    for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
        ref = _forward_logprobs(trainer, prompt, out.token_ids)
        assert (ref - torch.tensor(out.logprobs)).abs().max().item() <= LOGPROB_TOL


def _assert_bitwise(engine_model, trainer, buffers: bool = True):
    mine = {**dict(engine_model.named_parameters()), **(dict(engine_model.named_buffers()) if buffers else {})}
    theirs = {**dict(trainer.named_parameters()), **(dict(trainer.named_buffers()) if buffers else {})}
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_local_sync_copies_every_tensor_in_place(tok):
    trainer = text_model().train()
    engine = Engine(_fresh_engine_model(trainer), tok, 4, 128, 64)
    before = {k: v.data_ptr() for k, v in engine.model.named_parameters()}
    stats = weights.sync_local(trainer, engine, full=True, version=0)
    _assert_bitwise(engine.model, trainer)
    _assert_engine_matches(engine, trainer, tok)
    _train_a_little(trainer)
    stats = weights.sync_local(trainer, engine, version=1)
    assert stats.tensors == sum(1 for p in trainer.parameters() if p.requires_grad)
    assert stats.bytes == sum(p.numel() * p.element_size() for p in trainer.parameters())
    assert stats.peak_extra_bytes == 0  # copy_ into the engine's own tensors: no copy of a tensor, let alone a model
    assert {k: v.data_ptr() for k, v in engine.model.named_parameters()} == before  # in place
    assert engine.weight_version == 1
    _assert_bitwise(engine.model, trainer)
    _assert_engine_matches(engine, trainer, tok, seed=1)  # the fused serving weights were rebuilt, not stale


def test_peak_bytes_sees_allocations_but_not_in_place_copies():
    a, b = torch.zeros(1000), torch.ones(1000)
    with weights.PeakBytes() as mem:
        a.copy_(b)
    assert mem.peak == 0
    with weights.PeakBytes() as mem:
        c = b * 2
        d = c + 1
        del c, d
        e = b * 3
    assert mem.peak == 2 * 4000 and e.sum() == 3000


def _server(engine, admin_key=KEY, **kw):
    return running_server(build_app(engine, "tiny", admin_key=admin_key, log_every=1e9, **kw))


def test_sync_through_the_server(tok):
    trainer = text_model().train()
    _train_a_little(trainer)
    engine = Engine(_fresh_engine_model(trainer), tok, 4, 128, 64)
    with _server(engine) as url:
        client = weights.HTTPWeightSync(url, KEY, chunk_bytes=4096)  # small pieces: most tensors go in row pieces
        stats = weights.sync_distributed(trainer, client, version=5, full=True)
        assert engine.weight_version == 5 and stats.tensors > len(list(trainer.parameters()))
        # all or nothing: the server holds every byte of the update until `end`, plus the piece being received
        assert stats.bytes <= stats.server_peak_extra_bytes <= stats.bytes + stats.peak_extra_bytes
        _assert_bitwise(engine.model, trainer)
        prompt = tok.encode("Q: Reverse: cat sun map\nA:")
        body = {
            "token_ids": prompt,
            "sampling_params": {
                "max_tokens": 10,
                "temperature": 1.0,
                "seed": 3,
                "n": 2,
                "ignore_eos": True,
                "return_routed_experts": True,
            },
        }
        reply = post_json(f"{url}/inference/v1/generate", body, None, 60)
        assert reply["weight_version"] == 5 and len(reply["choices"]) == 2
        for choice in reply["choices"]:
            ref = _forward_logprobs(trainer, prompt, choice["token_ids"])
            assert (ref - torch.tensor(choice["logprobs"])).abs().max().item() <= LOGPROB_TOL
            assert choice["routed_experts"]["dtype"] == "uint16"
            assert choice["routed_experts"]["shape"] == [len(prompt) + 9, trainer.config.num_hidden_layers,
                                                         trainer.config.num_experts_per_tok]  # fmt: skip


def test_admin_routes_refuse_without_the_key(tok):
    engine = Engine(text_model(), tok, 2, 64, 32)
    with _server(engine) as url:
        with pytest.raises(FlashNextError, match="HTTP 401"):
            post_json(f"{url}/admin/weights/begin", None, "wrong", 10)
        with pytest.raises(FlashNextError, match="HTTP 409.*no weight update"):
            weights.HTTPWeightSync(url, KEY).push("nope", iter([]))
        with pytest.raises(FlashNextError, match="HTTP 400.*no tensor 'nope'"):
            uid = post_json(f"{url}/admin/weights/begin", None, KEY, 10)["update_id"]
            weights.HTTPWeightSync(url, KEY).push(uid, iter([weights.WeightPiece("nope", torch.zeros(2))]))
        with pytest.raises(FlashNextError, match="HTTP 409.*aborted.*nothing was applied"):
            post_json(f"{url}/admin/weights/end", {"update_id": uid}, KEY, 10)
        assert engine.admitting and engine.weight_version == 0
    with _server(Engine(text_model(), tok, 2, 64, 32), admin_key=None) as url:
        with pytest.raises(FlashNextError, match="HTTP 404.*--admin-key"):
            post_json(f"{url}/admin/weights/begin", None, KEY, 10)


def _stream_completion(url: str, i: int) -> tuple[int, str | None]:
    body = {
        "model": "tiny",
        "prompt": f"client {i}",
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    tokens, reason = 0, None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                tokens += 1 if choice["text"] or choice["finish_reason"] is None else 0
                reason = choice["finish_reason"] or reason
    return tokens, reason


def _wait_for(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_sync_under_load_loses_no_request(tok):
    """A sync begins while 4 token-in requests run and 16 streaming clients plus 4 more token-in requests wait or
    run: every request finishes with all its tokens; the running ones finished on the old weights (version 0, their
    log-probs those of the old model), the queued ones ran on the new ones (version 1)."""
    old = text_model().train()
    new = text_model().train()
    _train_a_little(new)
    engine_model = text_model()  # = old's weights
    engine = Engine(engine_model, tok, 6, 128, 64)
    prompt = tok.encode("Q: Reverse: red sun\nA:")

    def token_in(i):
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 8, "temperature": 1.0, "seed": i,
                                                         "ignore_eos": True}}  # fmt: skip
        return post_json(f"{url}/inference/v1/generate", body, None, 120)

    def running(prefix):
        return sum(r.request_id.startswith(prefix) for r in list(engine.running))

    slow = StepFault(engine_model, mode="none", when=lambda ids, step: False, delay=0.02)
    with _server(engine) as url, slow, ThreadPoolExecutor(24) as pool:
        first = [pool.submit(token_in, i) for i in range(4)]
        _wait_for(lambda: running("gen-") == 4)
        streams = [pool.submit(_stream_completion, url, i) for i in range(16)]
        _wait_for(lambda: len(engine.waiting) >= 10)
        later = [pool.submit(token_in, 10 + i) for i in range(4)]
        _wait_for(lambda: len(engine.waiting) >= 14)
        stats = weights.sync_distributed(new, weights.HTTPWeightSync(url, KEY), version=1)
        results = [f.result() for f in streams]
        replies = [(0, f.result()) for f in first] + [(1, f.result()) for f in later]
    assert stats.tensors > 0 and engine.weight_version == 1 and engine.admitting
    assert all(reason == "length" for _, reason in results), results
    for version, reply in replies:
        assert reply["weight_version"] == version
        ref = _forward_logprobs(new if version == 1 else old, prompt, reply["choices"][0]["token_ids"])
        assert (ref - torch.tensor(reply["choices"][0]["logprobs"])).abs().max().item() <= LOGPROB_TOL
    assert engine.stats.finish_reasons.get("length", 0) == 24
