"""`POST /inference/v1/generate` as verifiers' training client calls it: the exact body verifiers 0.4.0 sends
(through `renderers.client.generate`, renderers 0.1.12) is answered with vLLM's log-prob shape, each field's meaning
honoured; values the server cannot honour are refused naming the field. flashnext's own shape stays as it was."""

from __future__ import annotations

import httpx
import pytest
import torch
from serve_helpers import running_server

from flashnext.serve.engine import Engine
from flashnext.serve.loading import load_for_serving
from flashnext.serve.server import build_app

PROMPT = [40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module")
def server():
    """The tiny default model (seeded weights + bundled tokenizer) on a free 127.0.0.1 port."""
    model, tok, name = load_for_serving(None)
    engine = Engine(model, tok, max_slots=4, max_model_len=64, max_num_batched_tokens=64)
    with running_server(build_app(engine, name)) as base:
        yield base, name, model, tok


def _post(base: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/inference/v1/generate", json=body, timeout=60)


def verifiers_body(model_name: str, eos: int) -> dict:
    """What verifiers 0.4.0's `TrainClient.get_response` posts for one chat turn (read from its source):
    `renderers.client.generate` sends `model`, `token_ids` (the renderer's prompt) and `sampling_params` = the
    run's `SamplingConfig.model_dump(exclude_none=True)` (temperature, top_p, max_tokens) plus
    `stop_token_ids` (the renderer's), `logprobs: 1` and `skip_special_tokens: False`, which it always sets; a
    later turn of a multi-turn rollout adds `routed_experts_prompt_start`, and a run with a cache salt adds
    `cache_salt`."""
    return {
        "model": model_name,
        "token_ids": PROMPT,
        "sampling_params": {
            "temperature": 1.0,
            "top_p": 1.0,
            "max_tokens": 8,
            "stop_token_ids": [eos],
            "logprobs": 1,
            "skip_special_tokens": False,
            "routed_experts_prompt_start": 3,
        },
        "cache_salt": "run-7",
    }


def _model_logprobs(model, prompt: list[int], completion: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each completion token, top-1 log-prob at its position) from one plain forward."""
    ids = torch.tensor(prompt + completion)
    with torch.no_grad():
        logits = model(ids, cu_seqlens=torch.tensor([0, len(ids)], dtype=torch.int32)).logits.float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0], lp.max(dim=-1).values


def test_verifiers_training_body_is_answered_with_its_logprobs(server):
    base, name, model, tok = server
    reply = _post(base, verifiers_body(name, tok.eos_token_id))
    assert reply.status_code == 200, reply.text
    data = reply.json()
    # What renderers.client.generate reads: request_id, usage, prompt_token_ids, choices[0].token_ids,
    # .logprobs.content[i].token == "token_id:<id>" with a finite .logprob, .finish_reason, .routed_experts.
    assert data["request_id"] and data["prompt_token_ids"] == PROMPT
    choice = data["choices"][0]
    ids = choice["token_ids"]
    assert choice["finish_reason"] in ("stop", "length") and 1 <= len(ids) <= 8
    assert data["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": len(ids),
                             "total_tokens": len(PROMPT) + len(ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
    assert all(len(e["top_logprobs"]) == 1 for e in content)  # logprobs: 1 -> one alternative per token
    want, top1 = _model_logprobs(model, PROMPT, ids)
    # The engine's cached decode steps and one full forward sum in different orders: equal to fp32 rounding.
    got = torch.tensor([e["logprob"] for e in content])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor([e["top_logprobs"][0]["logprob"] for e in content]), top1,
                               atol=1e-4, rtol=0)  # fmt: skip
    assert choice["text"] == tok.decode(ids, skip_special_tokens=False)
    assert choice["routed_experts"] is None  # not asked for (return_routed_experts is false)


def test_verifiers_train_client_end_to_end(server, tmp_path, monkeypatch):
    """verifiers 0.4.0's own training client, unmodified (`TrainClient.get_response`: its renderer renders the chat
    with the model's template, posts the body above, parses the reply), against the server."""
    train = pytest.importorskip("verifiers.v1.clients.train", reason="the verifiers extra is not installed")
    import asyncio

    import verifiers.v1 as vf
    from renderers import DefaultRendererConfig
    from verifiers.v1.dialects import ChatDialect

    base, name, model, tok = server
    tok.save(tmp_path)  # tokenizer.json + tokenizer_config.json (its chat template): what the renderer loads
    monkeypatch.setenv("FLASHNEXT_TEST_KEY", "unused")
    cfg = vf.TrainClientConfig(base_url=f"{base}/v1", api_key_var="FLASHNEXT_TEST_KEY",
                               renderer=DefaultRendererConfig(), renderer_model_name=str(tmp_path))  # fmt: skip
    messages = [{"role": "user", "content": "Say sun."}]

    async def one_turn():
        client = train.TrainClient(cfg)
        try:
            return await client.get_response(ChatDialect(), {"model": name, "messages": messages},
                                             vf.SamplingConfig(temperature=1.0, max_tokens=6))  # fmt: skip
        finally:
            await client.close()

    r = asyncio.run(one_turn())
    prompt, ids = r.tokens.prompt_ids, r.tokens.completion_ids
    assert prompt == tok.apply_chat_template(messages, add_generation_prompt=True) and 1 <= len(ids) <= 6
    torch.testing.assert_close(torch.tensor(r.tokens.completion_logprobs), _model_logprobs(model, prompt, ids)[0],
                               atol=1e-4, rtol=0)  # fmt: skip
    assert r.finish_reason in ("stop", "length") and r.usage.completion_tokens == len(ids)


class _PreferToken:
    """Makes `token` the model's most likely next token everywhere (restored on exit)."""

    def __init__(self, model, token: int):
        self.model, self.token, self.inner = model, token, model.forward_step

    def __enter__(self):
        self.model.forward_step = self
        return self

    def __exit__(self, *exc):
        del self.model.forward_step

    def __call__(self, *args, **kw):
        logits = self.inner(*args, **kw).clone()
        logits[..., self.token] += 1e4
        return logits


@pytest.mark.parametrize("skip", [False, True])
def test_skip_special_tokens_shapes_the_text(server, skip):
    base, _, model, tok = server
    eos = tok.eos_token_id
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4, "temperature": 0, "stop_token_ids": [eos],
                                                      "skip_special_tokens": skip}}  # fmt: skip
    with _PreferToken(model, eos):
        choice = _post(base, body).json()["choices"][0]
    assert choice["token_ids"] == [eos] and choice["finish_reason"] == "stop"
    assert choice["text"] == ("" if skip else "<|endoftext|>")


def test_flashnext_shape_unchanged_without_logprobs(server):
    base, _, model, _ = server
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                                      "return_routed_experts": True}}  # fmt: skip
    choice = _post(base, body).json()["choices"][0]
    assert isinstance(choice["logprobs"], list) and len(choice["logprobs"]) == 5
    torch.testing.assert_close(torch.tensor(choice["logprobs"]), _model_logprobs(model, PROMPT, choice["token_ids"])[0],
                               atol=1e-4, rtol=0)  # fmt: skip
    full = choice["routed_experts"]["shape"]
    body["sampling_params"]["routed_experts_prompt_start"] = 4
    cut = _post(base, body).json()["choices"][0]["routed_experts"]["shape"]
    assert cut == [full[0] - 4, *full[1:]]


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"sampling_params": {"repetition_penalty": -1.1}}, "sampling_params.repetition_penalty"),
        ({"sampling_params": {"min_tokens": -2}}, "sampling_params.min_tokens"),
        ({"sampling_params": {"min_p": 1.05}}, "sampling_params.min_p"),
        ({"sampling_params": {"presence_penalty": 2.5}}, "sampling_params.presence_penalty"),
        ({"sampling_params": {"reasoning_effort": "high"}}, "sampling_params.reasoning_effort"),
        ({"sampling_params": {"routed_experts_prompt_start": 99}}, "sampling_params.routed_experts_prompt_start"),
        ({"priority": 3}, "priority"),
        ({"content_parts": [{"type": "image_url", "url": "x"}]}, "content_parts"),
        ({"sampling_params": {"no_such_knob": 1}}, "sampling_params.no_such_knob"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_values_it_cannot_honour_are_refused_by_name(server, patch, param):
    base, name, _, tok = server
    body = verifiers_body(name, tok.eos_token_id)
    for key, value in patch.items():
        body[key] = {**body[key], **value} if isinstance(value, dict) else value
    reply = _post(base, body)
    assert reply.status_code == 400, reply.text
    err = reply.json()["error"]
    assert err["param"] == param and param.rsplit(".", 1)[-1] in err["message"]


@pytest.mark.parametrize(
    "defaults",
    [{"min_tokens": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}],
)
def test_vllm_defaults_are_accepted(server, defaults):
    base, name, _, tok = server
    body = verifiers_body(name, tok.eos_token_id)
    body["sampling_params"].update(defaults)
    body["priority"] = 0
    assert _post(base, body).status_code == 200
