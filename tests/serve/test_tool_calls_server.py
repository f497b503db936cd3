"""Tool calling through `flashnext serve`'s app with the official `openai` client: a call -> tool result -> answer
loop, streamed tool-call deltas equal to the whole answer's, the history rendered as the template expects, and the
request checks (400s naming the field).

The random tiny model does not call tools by itself, so `ScriptedReplies` (a test hook on the engine's sampler)
replaces the sampled tokens of a request with a scripted answer's ids; everything after sampling (detokenizing,
stopping at `<|im_end|>`, parsing, formatting) is the server's own.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_helpers import running_server, sse_events

from flashnext.serve.chat_render import apply_defaults, generation_defaults
from flashnext.serve.engine import Engine
from flashnext.serve.loading import load_for_serving
from flashnext.serve.protocol import ChatRequest
from flashnext.serve.server import build_app

MAX_LEN = 1024  # the tools block of the system turn is ~600 tokens of the tiny vocabulary
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
CALL = "I should add them.\n</think>\n\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>"  # noqa: E501
ANSWER = "The tool said 5.\n</think>\n\n2 + 3 = 5."


class ScriptedReplies:
    """Test hook: a request's sampled tokens become `reply(prompt text)`'s ids then `<|im_end|>` (the chat turn's
    stop id); `reply` returning None leaves the request's sampling alone. Records every scripted prompt."""

    def __init__(self, engine: Engine, reply):
        self.tok, self.reply, self.prompts = engine.tokenizer, reply, []
        self.sample, self.end = engine.sampler.sample, engine.tokenizer.encode("<|im_end|>")[0]
        # keyed by id(), the request held alongside: a freed request's id could be reused by a later one, which
        # would then replay the old script and go unrecorded
        self.ids: dict[int, tuple[object, list[int] | None]] = {}
        engine.sampler.sample = self

    def __call__(self, logits, reqs):
        tokens, chosen, top, errors = self.sample(logits, reqs)
        for i, req in enumerate(reqs):
            if id(req) not in self.ids:
                prompt = self.tok.decode(req.prompt_ids, skip_special_tokens=False)
                text = self.reply(prompt)
                self.ids[id(req)] = (req, None if text is None else self.tok.encode(text) + [self.end])
                if text is not None:
                    self.prompts.append(prompt)
            script = self.ids[id(req)][1]
            if script is not None:
                tokens[i] = script[min(len(req.output_ids), len(script) - 1)]
        return tokens, chosen, top, errors


def _reply(prompt: str) -> str | None:
    if "<tools>" not in prompt:
        return None
    return ANSWER if "<tool_response>" in prompt else CALL


@pytest.fixture(scope="module")
def server():
    model, tok, name = load_for_serving(None)
    engine = Engine(model, tok, max_slots=4, max_model_len=MAX_LEN, max_num_batched_tokens=256)
    script = ScriptedReplies(engine, _reply)
    with running_server(build_app(engine, name)) as base:
        yield base, name, script


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_client_tool_loop(server, client):
    """call -> tool result -> answer, as an agent loop runs it; the second prompt holds the first turn rendered by
    the template (arguments as XML parameters, reasoning kept, the result as a <tool_response> user turn)."""
    _, name, script = server
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    first = client.chat.completions.create(model=name, messages=messages, tools=[ADD], temperature=0, max_tokens=200)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning"] == "I should add them."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert args == {"a": 2, "b": 3}  # coerced by the schema: integers, not "2"
    messages.append(choice.message.model_dump(exclude_none=True))  # arguments go back as the JSON string
    messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    second = client.chat.completions.create(model=name, messages=messages, tools=[ADD], temperature=0, max_tokens=200)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "2 + 3 = 5." and not second.choices[0].message.tool_calls
    history = (
        "<|im_start|>assistant\n<think>\nI should add them.\n</think>\n\n<tool_call>\n<function=add>\n<parameter=a>\n2"
        "\n</parameter>\n<parameter=b>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert script.prompts[-1].endswith(history)


def test_streamed_tool_call_equals_the_whole_answer(server, client):
    _, name, _ = server
    kw = dict(model=name, messages=[{"role": "user", "content": "Add 2 and 3"}], tools=[ADD], temperature=0)
    whole = client.chat.completions.create(**kw, max_tokens=200).choices[0]
    chunks = list(client.chat.completions.create(**kw, max_tokens=200, stream=True))
    calls, reasoning, reasons = {}, "", []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning") or ""
        reasons.append(chunk.choices[0].finish_reason)
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # first delta: index, id, type, name, empty arguments
                assert tc.id and tc.type == "function" and tc.function.name == "add" and tc.function.arguments == ""
                calls[tc.index] = ""
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index] += tc.function.arguments
    assert calls == {0: whole.message.tool_calls[0].function.arguments}  # byte for byte
    assert reasoning == whole.message.model_extra["reasoning"]
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


def test_tool_choice_none_leaves_calls_in_the_content(server, client):
    _, name, _ = server
    out = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "2+3"}], tools=[ADD],
                                         tool_choice="none", max_tokens=200)  # fmt: skip
    assert out.choices[0].finish_reason == "stop" and not out.choices[0].message.tool_calls
    assert out.choices[0].message.content.startswith("<tool_call>\n<function=add>")


def _post(base: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    return r.status_code, r.json().get("error") or {}


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice",
         ["'mul'", "not in tools", "add"]),
        ({"tool_choice": "required"}, "tool_choice", ["needs tools"]),
        ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice", ["'sometimes'", "auto"]),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", ["bad name"]),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "tools[0].function.parameters", ["JSON schema"]),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", ["'extreme'", "minimal", "high"]),
        ({"chat_template_kwargs": {"reasoning_effort": "huge"}}, "messages", ["Unexpected reasoning effort huge"]),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", ["set by the request"]),
        ({"messages": [{"role": "system", "content": "s"}]}, "messages", ["No user query found"]),
        ({"messages": [*USER, {"role": "critic", "content": "x"}]}, "messages", ["Unexpected message role critic"]),
        ({"messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]},
         "messages[1].tool_calls[0].function.arguments", ["JSON object", "{not json"]),
        ({"messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": "[1, 2]"}}]}]},
         "messages[1].tool_calls[0].function.arguments", ["JSON object"]),
    ],
    ids=["named-not-in-tools", "required-without-tools", "unknown-choice", "bad-tool-name", "bad-parameters",
         "openai-effort", "template-effort", "reserved-kwarg", "template-no-user", "template-role",
         "arguments-not-json", "arguments-not-object"],
)  # fmt: skip
def test_bad_tool_requests_are_400_naming_the_field(server, extra, param, words):
    base, name, _ = server
    status, err = _post(base, {"model": name, "messages": USER, "max_tokens": 2, **extra})
    assert status == 400 and err["param"] == param, err
    assert all(w in err["message"] for w in words), err["message"]


def test_history_and_effort_reach_the_template(server):
    """`reasoning` (newer clients) is rendered as the template's reasoning_content; OpenAI's `reasoning_effort`
    maps onto the template's (high -> xhigh, low -> low, none -> thinking off)."""
    base, name, script = server
    history = [{"role": "user", "content": "2+3?"},
               {"role": "assistant", "content": "5", "reasoning": "add them"},
               {"role": "user", "content": "and 2+4?"}]  # fmt: skip
    seen = {}
    for effort in ("high", "low", "none"):
        status, _ = _post(base, {"model": name, "messages": history, "tools": [ADD], "max_tokens": 1,
                                 "reasoning_effort": effort})  # fmt: skip
        assert status == 200
        seen[effort] = script.prompts[-1]
    assert "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n5<|im_end|>" in seen["high"]
    assert seen["high"].startswith("<|im_start|>system\nReasoning effort: xhigh.\n\n# Tools")
    assert seen["low"].startswith("<|im_start|>system\nReasoning effort: low.\n\n# Tools")
    assert seen["none"].startswith("<|im_start|>system\n# Tools") and seen["none"].endswith("<think>\n\n</think>\n\n")


def test_streamed_events_carry_reasoning_content_too(server):
    base, name, _ = server
    body = {"model": name, "messages": USER, "tools": [ADD], "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    reasoning = [d for d in deltas if "reasoning" in d]
    assert reasoning and all(d["reasoning_content"] == d["reasoning"] for d in reasoning)


def test_generation_config_defaults_fill_what_the_request_leaves_out(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                                  "eos_token_id": 2}))  # fmt: skip
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    body = ChatRequest(model="m", messages=USER, top_p=0.5)
    apply_defaults(body, defaults)
    assert (body.temperature, body.top_p, body.top_k) == (0.6, 0.5, 20)  # the request's own value wins
    assert generation_defaults(None) == {} and generation_defaults(tmp_path / "nowhere") == {}
