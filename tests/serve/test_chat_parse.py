"""Chat answers split into reasoning, content and tool calls: a table of the dialects' quirks (the bugs users of other
engines hit, AGENT.md section 4), schema coercion, and streaming == non-streaming byte for byte."""

from __future__ import annotations

import json
import random

import pytest

from flashnext.serve.chat_parse import OutputParser, StreamState, coerce, message, template_dialect, think_open
from flashnext.tokenizer import QWEN_TEMPLATE

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "number"}, "b": {"type": "integer"}, "note": {"type": "string"},
        "opts": {"type": "object"}, "tags": {"type": "array"}, "flag": {"type": "boolean"},
        "maybe": {"type": ["integer", "null"]}}}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}},
]  # fmt: skip


def xml_call(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# (id, think_open, dialect, answer, reasoning, content, [(name, arguments dict)])
CASES = [
    ("plain-reasoning-then-content", True, "xml", "Let me see.\n</think>\n\nIt is 5.", "Let me see.", "It is 5.", []),
    ("thinking-off-prompt", False, "xml", "It is 5.", "", "It is 5.", []),
    ("no-end-of-thinking-all-reasoning", True, "xml", "hmm, still thinking", "hmm, still thinking", "", []),
    ("answer-opens-its-own-think", False, "xml", "<think>\nplan\n</think>\n\nok", "plan", "ok", []),
    ("duplicate-end-think-dropped", True, "xml", "a</think>\n\nb</think> c", "a", "b c", []),
    ("call-after-reasoning", True, "xml", "use add\n</think>\n\n" + xml_call("add", a="2", b="3"),
     "use add", "", [("add", {"a": 2, "b": 3})]),
    ("call-inside-think-ends-reasoning (vllm#39056)", True, "xml", "I will call.\n" + xml_call("add", a="1.5", b="2"),
     "I will call.", "", [("add", {"a": 1.5, "b": 2})]),
    ("content-before-call", False, "xml", "Checking.\n\n" + xml_call("get_weather", city="Paris"),
     "", "Checking.", [("get_weather", {"city": "Paris"})]),
    ("two-calls", False, "xml", xml_call("get_weather", city="Paris") + "\n" + xml_call("get_weather", city="Rome"),
     "", "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    ("missing-end-tool-call", False, "xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
     "</parameter>\n</function>", "", "", [("get_weather", {"city": "Oslo"})]),
    ("missing-end-function-and-call", False, "xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
     "</parameter>\n", "", "", [("get_weather", {"city": "Oslo"})]),
    ("missing-end-parameter", False, "xml", "<tool_call>\n<function=add>\n<parameter=a>\n1\n<parameter=b>\n2\n"
     "</function>\n</tool_call>", "", "", [("add", {"a": 1, "b": 2})]),
    ("function-without-tool-call", False, "xml", "<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n"
     "</function>", "", "", [("get_weather", {"city": "Lima"})]),
    ("multiline-string-keeps-inner-newlines", False, "xml", xml_call("add", note="line 1\nline 2\n"),
     "", "", [("add", {"note": "line 1\nline 2\n"})]),
    ("string-typed-digits-stay-strings", False, "xml", xml_call("get_weather", city="2024"),
     "", "", [("get_weather", {"city": "2024"})]),
    ("object-array-boolean-null", False, "xml", xml_call("add", opts='{"x": [1, 2]}', tags='["a"]', flag="True",
     maybe="null"), "", "", [("add", {"opts": {"x": [1, 2]}, "tags": ["a"], "flag": True, "maybe": None})]),
    ("unparseable-typed-value-stays-text", False, "xml", xml_call("add", b="three"), "", "", [("add", {"b": "three"})]),
    ("unknown-parameter-kept-as-text", False, "xml", xml_call("add", extra="7"), "", "", [("add", {"extra": "7"})]),
    ("repeated-parameter-keeps-first", False, "xml", "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
     "<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>", "", "", [("add", {"a": 1})]),
    ("text-after-call-dropped", False, "xml", xml_call("get_weather", city="Oslo") + "\nDone!", "", "",
     [("get_weather", {"city": "Oslo"})]),
    ("call-block-without-function-stays-content", False, "xml", "<tool_call>\nnot a call", "",
     "<tool_call>\nnot a call", []),
    ("cut-inside-a-parameter", False, "xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nBer", "", "",
     [("get_weather", {"city": "Ber"})]),
    ("tag-like-text-in-content", False, "xml", "Use a <tool> here.", "", "Use a <tool> here.", []),
    ("hermes-json", False, "hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
     "</tool_call>", "", "Sure.", [("get_weather", {"city": "Oslo"})]),
    ("hermes-missing-end", False, "hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}', "", "",
     [("add", {"a": 1})]),
    ("hermes-bad-json-stays-content", False, "hermes", "<tool_call>\n{oops}\n</tool_call>", "",
     "<tool_call>\n{oops}\n</tool_call>", []),
    ("no-dialect-calls-stay-content", False, None, xml_call("get_weather", city="X"), "",
     xml_call("get_weather", city="X"), []),
]  # fmt: skip


def _streamed(parser: OutputParser, text: str, cuts: list[int]) -> list[dict]:
    state, out, last = StreamState(parser), [], 0
    for cut in [*cuts, len(text)]:
        out += state.deltas(text[:cut], final=False) if cut < len(text) else []
        last = cut
    assert last == len(text)
    return out + state.deltas(text, final=True)


def _join(deltas: list[dict]) -> tuple[str, str, list[dict]]:
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    assert reasoning == "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict] = []
    for d in deltas:
        for c in d.get("tool_calls", []):
            if c["index"] == len(calls):  # a call's first delta: everything but argument text
                assert set(c) == {"index", "id", "type", "function"} and c["type"] == "function"
                assert c["function"]["arguments"] == "" and c["function"]["name"]
                calls.append({"name": c["function"]["name"], "arguments": ""})
            else:  # later deltas: argument text only
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[c["index"]]["arguments"] += c["function"]["arguments"]
    return reasoning, content, calls


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dialect_quirks(case):
    _, open_, dialect, text, reasoning, content, calls = case
    parser = OutputParser(True, open_, dialect, TOOLS)
    msg, has_calls = message(parser, text)
    assert (msg["reasoning"] or "", msg["content"] or "") == (reasoning, content)
    assert msg["reasoning_content"] == msg["reasoning"]
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
    assert got == calls and has_calls == bool(calls)
    if calls:
        assert msg["content"] == (content or None)
    # streamed in every split of one character, and in random pieces: the concatenation is the whole answer's
    full = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    rng = random.Random(len(text))
    for cuts in (list(range(1, len(text))), sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))):
        r, c, streamed_calls = _join(_streamed(parser, text, cuts))
        assert (r, c) == (msg["reasoning"] or "", msg["content"] or "")
        assert [(x["name"], x["arguments"]) for x in streamed_calls] == full  # byte for byte


def test_every_prefix_parse_is_a_prefix_of_the_whole():
    """The streaming invariant itself: a field of any prefix's parse never needs to be taken back."""
    parser = OutputParser(True, True, "xml", TOOLS)
    text = (
        "a b\n</think>\n\nI'll call.\n" + xml_call("add", a="1", note="x\ny") + "\n" + xml_call("get_weather", city="Z")
    )
    whole = parser.parse(text, final=True)
    for cut in range(len(text) + 1):
        part = parser.parse(text[:cut], final=False)
        assert whole.reasoning.startswith(part.reasoning) and whole.content.startswith(part.content)
        assert len(part.calls) <= len(whole.calls)
        for p, w in zip(part.calls, whole.calls, strict=False):
            assert p.name == w.name and w.arguments.startswith(p.arguments)


def test_no_tool_calls_finish_without_a_parsed_call():
    parser = OutputParser(True, False, "xml", TOOLS)
    msg, calls = message(parser, "<tool_call>\n<function=")
    assert not calls and "tool_calls" not in msg and msg["content"] == "<tool_call>\n<function="


@pytest.mark.parametrize(
    "raw, schema, want",
    [("7", {"type": "integer"}, 7), ("7.0", {"type": "integer"}, 7), ("7.5", {"type": "integer"}, "7.5"),
     ("-2e3", {"type": "number"}, -2000.0), ("true", {"type": "boolean"}, True), ("null", {"type": "string"}, "null"),
     ("null", {"type": ["string", "null"]}, None), ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
     ("x", {"enum": ["x", "y"]}, "x"), ("3", {"enum": [1, 3]}, 3), ('{"a": 1}', None, '{"a": 1}'),
     ("[1]", {"type": "object"}, "[1]")],
)  # fmt: skip
def test_coerce_by_schema(raw, schema, want):
    got = coerce(raw, schema)
    assert got == want and type(got) is type(want)


def test_state_from_the_rendered_prompt_and_template():
    assert think_open("<|im_start|>assistant\n<think>\n")
    assert not think_open("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not think_open("<|im_start|>user\n<think>\n<|im_end|>\n<|im_start|>assistant\n")
    assert template_dialect(QWEN_TEMPLATE) == "xml"
    assert template_dialect("{{ '<tool_call>' }}") == "hermes" and template_dialect("{{ x }}") is None


def test_inactive_parser_leaves_the_text_alone():
    parser = OutputParser(False, True, None)
    assert message(parser, "  <think>x</think> y ")[0] == {"role": "assistant", "content": "  <think>x</think> y "}
    state = StreamState(parser)
    assert state.deltas(" a", False) + state.deltas(" a b ", True) == [{"content": " a"}, {"content": " b "}]


def test_parallel_tool_calls_false_keeps_the_first_call():
    from flashnext.serve.chat_render import chat_prompt
    from flashnext.serve.protocol import ChatRequest

    text = xml_call("get_weather", city="Paris") + "\n" + xml_call("get_weather", city="Rome")
    for parallel, want in ((None, ["Paris", "Rome"]), (True, ["Paris", "Rome"]), (False, ["Paris"])):
        body = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                           parallel_tool_calls=parallel)  # fmt: skip
        parser = chat_prompt(body, []).parser("<|im_start|>assistant\n<think>\n\n</think>\n\n", True, "xml")
        msg, _ = message(parser, text)
        assert [json.loads(c["function"]["arguments"])["city"] for c in msg["tool_calls"]] == want
        streamed = _join(_streamed(parser, text, list(range(1, len(text)))))[2]
        assert [json.loads(c["arguments"])["city"] for c in streamed] == want
