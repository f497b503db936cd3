"""A chat answer's text split the way agents read it: `reasoning`, `content` and `tool_calls` (streamed too).

Reasoning: whether the answer starts inside a think block is read from the rendered prompt (`think_open`: the
Qwen3.8 generation prompt ends in `<think>\\n` when thinking is on, in a closed empty block when it is off), not from
request flags. Inside it, `</think>` ends the reasoning, and so does a `<tool_call>` (models emit calls without
closing the block); an answer that itself starts with `<think>` opens one. A second `</think>` is dropped.

Tool calls, two dialects: `xml` (Qwen3-Coder, what Qwen3.5+ and Qwen3.8 templates ask for)
`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>` and `hermes`
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. XML values lose one leading and one trailing
newline and are converted by the tool's JSON schema (`coerce`); a missing `</parameter>`, `</function>` or
`</tool_call>` is tolerated where the next tag (or the end of the answer) says where it ended, and `<function=`
without `<tool_call>` starts a call. Content is the text before the first call; text after the calls is dropped (the
template asks for no suffix); a call block that never names a function stays in the content.

Streaming: `parse(text, final=False)` of a growing text only ever grows each field (text that may still turn out
to be a tag, and trailing whitespace, is held back), so `StreamState` sends the differences: a call's first delta
carries index, id, type, name and `arguments: ""`, later ones only argument text, and the concatenated arguments
equal the non-streamed ones byte for byte. Arguments are built as `{"k": v, ...}` (`json.dumps` of each key and
value, ensure_ascii off), a parameter at a time once it is complete; a repeated parameter name keeps the first.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

THINK, END_THINK, CALL, END_CALL = "<think>", "</think>", "<tool_call>", "</tool_call>"
FUNC, END_FUNC, PARAM, END_PARAM = "<function=", "</function>", "<parameter=", "</parameter>"
DIALECTS = ("xml", "hermes")


def template_dialect(template: str | None) -> str | None:
    """The tool-call dialect a chat template asks for: "xml" when it shows `<function=`, "hermes" when it only
    shows `<tool_call>`, else None (no tool calls are parsed)."""
    if not template:
        return None
    if FUNC in template:
        return "xml"
    return "hermes" if CALL in template else None


def think_open(prompt: str) -> bool:
    """Does the rendered prompt end inside an open think block (the answer starts as reasoning)?"""
    start = prompt.rfind(THINK)
    return start >= 0 and prompt.rfind(END_THINK) < start and prompt.rfind("<|im_start|>") < start


def _partial_tail(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `tags` (it may become that tag)."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def _held(text: str, tags: tuple[str, ...], final: bool) -> str:
    """`text` without what may still change: a possible tag beginning and trailing whitespace (none when final)."""
    if final:
        return text.rstrip()
    text = text[: len(text) - _partial_tail(text, tags)]
    return text.rstrip()


# ------------------------------------------------------------------------------------------------ value coercion
def _types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    out = [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)] if isinstance(kind, list) else []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out += [t for t in _types(sub) if t not in out]
    if not out and "enum" in schema:
        out = sorted({_json_kind(v) for v in schema["enum"]}, key=lambda t: t == "string")
    return out


def _json_kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    return "string" if isinstance(v, str) else "object"


def _convert(raw: str, kind: str) -> tuple[bool, Any]:
    s = raw.strip()
    if kind == "string":
        return True, raw
    if kind == "null":
        return (True, None) if s == "null" else (False, None)
    if kind == "boolean":
        return (True, s.lower() == "true") if s.lower() in ("true", "false") else (False, None)
    if kind == "integer":
        if re.fullmatch(r"[+-]?\d+", s):
            return True, int(s)
        try:  # 3.0 is an integer in JSON Schema
            f = float(s)
        except ValueError:
            return False, None
        return (True, int(f)) if f.is_integer() and abs(f) < 2**53 else (False, None)
    if kind == "number":
        try:
            value = json.loads(s)
        except ValueError:
            return False, None
        return (True, value) if isinstance(value, (int, float)) and not isinstance(value, bool) else (False, None)
    if kind in ("object", "array"):
        try:
            value = json.loads(s)
        except ValueError:
            return False, None
        want = dict if kind == "object" else list
        return (True, value) if isinstance(value, want) else (False, None)
    return False, None


def coerce(raw: str, schema: Any) -> Any:
    """An XML parameter's text as the JSON value its schema asks for: the schema's types tried in order, `string`
    last (so `["integer", "string"]` reads "7" as 7); no schema, or no type that fits, keeps the text."""
    kinds = _types(schema)
    for kind in sorted(kinds, key=lambda k: k == "string"):
        ok, value = _convert(raw, kind)
        if ok:
            return value
    return raw


def _xml_param(text: str, pos: int, final: bool) -> tuple[str, str, int] | None:
    """The `<parameter=KEY>VALUE</parameter>` starting at `pos`: (key, raw value without the newline that opens and
    the one that closes it, position after it), or None while it may still be incomplete (streaming, not `final`).
    A value ends at `</parameter>`, or at the next tag when the model left that out (the end of a `final` text)."""
    close = text.find(">", pos)
    if close < 0:
        return None
    key = text[pos + len(PARAM) : close].strip()
    start = close + 1
    ends = [(i, t) for t in (END_PARAM, PARAM, END_FUNC, END_CALL) if (i := text.find(t, start)) >= 0]
    if ends:
        at, tag = min(ends)
        nxt = at + len(END_PARAM) if tag == END_PARAM else at
    elif final:
        at, nxt = len(text), len(text)
    else:
        return None
    raw = text[start:at]
    raw = raw[1:] if raw.startswith("\n") else raw
    raw = raw[:-1] if raw.endswith("\n") else raw
    return key, raw, nxt


# ------------------------------------------------------------------------------------------------------ parsing
@dataclass
class Call:
    name: str
    arguments: str  # JSON text so far (complete when `closed`)
    closed: bool = False


@dataclass
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)


class OutputParser:
    """Splits an answer into reasoning, content and tool calls (see the module docstring).

    Args:
        reasoning: a reasoning parser is on (the template has think blocks).
        think_open: the prompt ends inside a think block (`think_open(prompt)`).
        dialect: "xml", "hermes" or None (no tool calls parsed: `tool_choice: "none"`, no tools).
        tools: the request's tools (OpenAI objects); their `parameters` schemas convert XML values.
        max_calls: keep at most this many calls (`parallel_tool_calls: false`: 1); None: all.
    """

    def __init__(
        self, reasoning: bool, think_open: bool, dialect: str | None, tools: list | None = None,
        max_calls: int | None = None,
    ):  # fmt: skip
        if dialect not in (None, *DIALECTS):
            raise ValueError(f"tool-call dialect {dialect!r} is not one of {DIALECTS}")
        self.reasoning, self.think_open, self.dialect = reasoning, reasoning and think_open, dialect
        self.max_calls = max_calls
        self.schemas: dict[str, dict] = {}
        for tool in tools or []:
            fn = tool.get("function", tool) if isinstance(tool, dict) else {}
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                params = fn.get("parameters")
                self.schemas[fn["name"]] = params.get("properties", {}) if isinstance(params, dict) else {}

    @property
    def active(self) -> bool:
        """Does this parser change the text at all (otherwise the content is the text as generated)?"""
        return self.reasoning or self.dialect is not None

    def _starts(self) -> tuple[str, ...]:
        if self.dialect == "xml":
            return (CALL, FUNC)
        return (CALL,) if self.dialect == "hermes" else ()

    def parse(self, text: str, final: bool = True) -> Parsed:
        """The fields of `text` (a whole answer when `final`, else a prefix of one: only settled text)."""
        out = Parsed()
        if not self.active:
            out.content = text
            return out
        body = text
        inside = self.think_open
        if self.reasoning and not inside and text.lstrip().startswith(THINK):
            inside, body = True, text.lstrip()[len(THINK) :]
        elif self.reasoning and not inside and not final and THINK.startswith(text.lstrip()):
            return out  # the answer may be opening a think block
        if inside:
            ends = [(i, tag) for tag in (END_THINK, *self._starts()) if (i := body.find(tag)) >= 0]
            if not ends:
                out.reasoning = _held(body, (END_THINK, *self._starts()), final).lstrip()
                return out
            at, tag = min(ends)
            out.reasoning = body[:at].strip()
            body = body[at + len(END_THINK) :] if tag == END_THINK else body[at:]
        if self.reasoning:
            body = body.replace(END_THINK, "")  # a duplicate end of thinking is dropped
        starts = [(i, tag) for tag in self._starts() if (i := body.find(tag)) >= 0]
        if not starts:
            out.content = _held(body, (*self._starts(), END_THINK), final).lstrip()
            return out
        at = min(starts)[0]
        out.content = body[:at].strip()
        calls = self._calls(body[at:], final)
        if final and not calls:  # a call block that names no function: the text stays content
            out.content = body.strip()
        out.calls = calls
        return out

    # -------------------------------------------------------------------------------------------- dialects
    def _calls(self, text: str, final: bool) -> list[Call]:
        calls, pos = [], 0
        while self.max_calls is None or len(calls) < self.max_calls:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if not (text.startswith(CALL, pos) or (self.dialect == "xml" and text.startswith(FUNC, pos))):
                return calls
            call, pos = (self._xml if self.dialect == "xml" else self._hermes)(text, pos, final)
            if call is None:
                return calls
            calls.append(call)
            if not call.closed:
                return calls
        return calls

    def _xml(self, text: str, pos: int, final: bool) -> tuple[Call | None, int]:
        if text.startswith(CALL, pos):
            pos += len(CALL)
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if not text.startswith(FUNC, pos):
            return None, pos
        close = text.find(">", pos)
        if close < 0:
            return None, pos
        name = text[pos + len(FUNC) : close].strip()
        if not name:
            return None, pos
        schema = self.schemas.get(name, {})
        pos = close + 1
        pairs, seen = [], set()
        call = Call(name, "")
        while True:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if text.startswith(PARAM, pos):
                param = _xml_param(text, pos, final)
                if param is None:
                    break
                key, raw, pos = param
                if key not in seen:
                    seen.add(key)
                    value = coerce(raw, schema.get(key))
                    pairs.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
                continue
            if text.startswith(END_FUNC, pos):
                pos += len(END_FUNC)
                call.closed = True
                while pos < len(text) and text[pos].isspace():
                    pos += 1
                if text.startswith(END_CALL, pos):
                    pos += len(END_CALL)
                break
            if text.startswith(END_CALL, pos):  # `</function>` left out
                pos += len(END_CALL)
                call.closed = True
                break
            rest = text[pos:]
            if not final and (not rest or any(tag.startswith(rest) for tag in (PARAM, END_FUNC, END_CALL))):
                break  # may still become a tag
            call.closed = True  # stray text (or the end of the whole answer) ends the call
            break
        call.closed = call.closed or final  # a whole answer cut inside the call: what was complete counts
        call.arguments = "{" + ", ".join(pairs) + ("}" if call.closed else "")
        return call, pos

    def _hermes(self, text: str, pos: int, final: bool) -> tuple[Call | None, int]:
        start = pos + len(CALL)
        end = text.find(END_CALL, start)
        if end < 0 and not final:
            return None, pos
        raw = text[start:end] if end >= 0 else text[start:]
        try:
            obj = json.loads(raw)
        except ValueError:
            return None, pos
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, pos
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models double-encode
            try:
                args = json.loads(args)
            except ValueError:
                pass
        call = Call(obj["name"], json.dumps(args, ensure_ascii=False), closed=True)
        return call, (end + len(END_CALL) if end >= 0 else len(text))


# ---------------------------------------------------------------------------------------------------- output
def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def message(parser: OutputParser, text: str) -> tuple[dict, bool]:
    """The non-streamed chat `message` of a whole answer, and whether it holds tool calls."""
    if not parser.active:
        return {"role": "assistant", "content": text}, False
    p = parser.parse(text, final=True)
    msg: dict[str, Any] = {"role": "assistant", "content": p.content if (p.content or not p.calls) else None}
    if parser.reasoning:
        msg["reasoning"] = msg["reasoning_content"] = p.reasoning or None
    if p.calls:
        msg["tool_calls"] = [
            {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in p.calls
        ]
    return msg, bool(p.calls)


class StreamState:
    """One streamed choice: what was sent of each field, so each update sends only the growth."""

    def __init__(self, parser: OutputParser):
        self.parser = parser
        self.reasoning, self.content = 0, 0
        self.calls: list[tuple[str, int]] = []  # (id, argument characters sent)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def deltas(self, text: str, final: bool) -> list[dict]:
        """The delta objects that bring the client from what was sent to `parse(text, final)`, in order."""
        if not self.parser.active:
            new, self.content = text[self.content :], len(text)
            return [{"content": new}] if new else []
        p = self.parser.parse(text, final)
        out = []
        if len(p.reasoning) > self.reasoning:
            new = p.reasoning[self.reasoning :]
            out.append({"reasoning": new, "reasoning_content": new})
            self.reasoning = len(p.reasoning)
        if len(p.content) > self.content:
            out.append({"content": p.content[self.content :]})
            self.content = len(p.content)
        for i, call in enumerate(p.calls):
            if i == len(self.calls):
                cid = new_call_id()
                self.calls.append((cid, 0))
                fn = {"name": call.name, "arguments": ""}
                out.append({"tool_calls": [{"index": i, "id": cid, "type": "function", "function": fn}]})
            cid, sent = self.calls[i]
            if len(call.arguments) > sent:
                out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments[sent:]}}]})
                self.calls[i] = (cid, len(call.arguments))
        return out
