"""A chat request rendered the way the checkpoint's own template expects, and how its answer will be parsed.

What the template is given (`ChatPrompt`): the messages (content flattened to text, images as sentinels), an
assistant turn's `tool_calls` with `function.arguments` turned from the OpenAI JSON string into an object (templates
iterate it with `|items`), a `tool` message's `tool_call_id`, an incoming `reasoning` / `reasoning_content` as
`reasoning_content` (what Qwen templates read); the variables `tools`, `tool_choice`, and `chat_template_kwargs`
(`enable_thinking`, `preserve_thinking`, `reasoning_effort`, ...). OpenAI's top-level `reasoning_effort` is mapped
onto the template's values (`OPENAI_EFFORTS`: none / minimal turn thinking off, high and max are the template's
xhigh) unless `chat_template_kwargs` sets them. A template's `raise_exception` is a 400 carrying its message.

`tool_choice`: auto (default with tools), none (tools still rendered, no calls parsed), required, or a named
function, which must be one of `tools` (400 naming the field otherwise). `parallel_tool_calls: false` keeps the
answer's first call only. Enforcing required / named calls is the
grammar's job; parsing works for any of them.

Sampling defaults: a checkpoint's `generation_config.json` (`temperature`, `top_p`, `top_k`) replaces the server's
defaults for the fields a request leaves out (`generation_defaults`, `apply_defaults`), as vLLM does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from flashnext.errors import ConfigError, InputError
from flashnext.serve.chat_parse import OutputParser, think_open
from flashnext.serve.protocol import BadRequest, show

# OpenAI's reasoning_effort -> the template's (None: thinking off)
OPENAI_EFFORTS: dict[str, str | None] = {
    "none": None, "minimal": None, "low": "low", "medium": "medium", "high": "xhigh", "xhigh": "xhigh", "max": "xhigh",
}  # fmt: skip
RESERVED = ("messages", "add_generation_prompt", "tools", "tool_choice", "tokenize")  # not chat_template_kwargs
TOOL_CHOICES = ("auto", "none", "required")
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
GENERATION_FIELDS = ("temperature", "top_p", "top_k")


@dataclass
class ChatPrompt:
    """What the chat template renders, and what the answer's parser needs."""

    messages: list[dict]
    variables: dict[str, Any] = field(default_factory=dict)  # template variables besides messages
    tools: list[dict] | None = None
    tool_choice: str | dict = "none"
    parallel_tool_calls: bool = True

    def render(self, tok) -> str:
        """The rendered prompt text (generation prompt included); `BadRequest` for what the template refuses."""
        try:
            return tok.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False, **self.variables)
        except InputError as e:  # the template's raise_exception
            raise BadRequest(str(e), "messages") from None
        except jinja2.TemplateError as e:
            raise BadRequest(f"the chat template cannot render these messages: {e}", "messages") from None

    def parser(self, prompt: str, reasoning: bool, dialect: str | None) -> OutputParser:
        """The answer's parser: reasoning from the rendered `prompt`'s open think block, tool calls unless
        `tool_choice` is none or there are no tools."""
        calls = dialect if self.tools and self.tool_choice != "none" else None
        return OutputParser(reasoning, think_open(prompt), calls, self.tools, None if self.parallel_tool_calls else 1)


def _arguments(value: Any, where: str) -> dict:
    if isinstance(value, dict):
        return value
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise BadRequest(f"{where} must be a JSON object string, got {show(value)}: {e}", where) from None
        if isinstance(parsed, dict):
            return parsed
    raise BadRequest(f"{where} must be a JSON object (or its JSON text), got {show(value)}", where)


def _tool_calls(calls: list, where: str) -> list[dict]:
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{at} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}, "
                             f"got {show(call)}", at)  # fmt: skip
        args = _arguments(fn.get("arguments"), f"{at}.function.arguments")
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def check_tools(tools: list | None) -> list[dict] | None:
    """The request's tools, each `{"type": "function", "function": {"name": ..., "parameters": {...}}}`."""
    if not tools:
        return None
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise BadRequest(f"{at} must be a function tool {{'type': 'function', 'function': {{...}}}}, "
                             f"got {show(tool)}", at)  # fmt: skip
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise BadRequest(f"{at}.function must be an object with a name, got {show(fn)}", f"{at}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise BadRequest(f"{at}.function.name must be 1-128 letters, digits, _ . : -, got {show(name)}",
                             f"{at}.function.name")  # fmt: skip
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise BadRequest(f"{at}.function.parameters must be a JSON schema object, got {show(params)}",
                             f"{at}.function.parameters")  # fmt: skip
    return list(tools)


def check_tool_choice(choice: Any, tools: list[dict] | None) -> str | dict:
    """`tool_choice` checked against `tools`: auto / none / required, or a named function that is one of them."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise BadRequest(f"tool_choice={show(choice)} is not one of {', '.join(TOOL_CHOICES)} or "
                             "{'type': 'function', 'function': {'name': ...}}", "tool_choice")  # fmt: skip
        if choice == "required" and not tools:
            raise BadRequest("tool_choice='required' needs tools", "tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise BadRequest(f"tool_choice={show(choice)} must name a function: "
                         "{'type': 'function', 'function': {'name': ...}}", "tool_choice")  # fmt: skip
    known = [t["function"]["name"] for t in tools or []]
    if name not in known:
        raise BadRequest(f"tool_choice names function {name!r}, which is not in tools ({', '.join(known) or 'none'})",
                         "tool_choice")  # fmt: skip
    return choice


def _variables(body) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    for key in kwargs:
        if key in RESERVED:
            raise BadRequest(f"chat_template_kwargs.{key} is set by the request itself, not here",
                             f"chat_template_kwargs.{key}")  # fmt: skip
    effort = body.reasoning_effort
    if effort is not None:
        if effort not in OPENAI_EFFORTS:
            raise BadRequest(f"reasoning_effort={show(effort)} is not one of {', '.join(OPENAI_EFFORTS)}",
                             "reasoning_effort")  # fmt: skip
        mapped = OPENAI_EFFORTS[effort]
        if mapped is None:
            kwargs.setdefault("enable_thinking", False)
        else:
            kwargs.setdefault("reasoning_effort", mapped)
    return kwargs


def chat_prompt(body, urls: list[str]) -> ChatPrompt:
    """The `ChatPrompt` of a `ChatRequest` (`BadRequest` naming the field for a malformed one); image parts' URLs
    are appended to `urls`."""
    messages = body.template_messages(urls)
    for i, (m, out) in enumerate(zip(body.messages, messages, strict=True)):
        if m.tool_calls:
            if m.role != "assistant":
                raise BadRequest(f"messages[{i}]: only assistant messages carry tool_calls, got role {m.role!r}",
                                 f"messages[{i}].tool_calls")  # fmt: skip
            out["tool_calls"] = _tool_calls(m.tool_calls, f"messages[{i}].tool_calls")
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            out["name"] = m.name
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
    tools = check_tools(body.tools)
    choice = check_tool_choice(body.tool_choice, tools)
    variables = _variables(body)
    if tools:
        variables["tools"] = tools
        variables["tool_choice"] = choice
    return ChatPrompt(messages, variables, tools, choice, body.parallel_tool_calls is not False)


def generation_defaults(model_dir: str | Path | None) -> dict[str, Any]:
    """`temperature`, `top_p`, `top_k` of a checkpoint's `generation_config.json` (those present; {} without one)."""
    if model_dir is None:
        return {}
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        return {}
    return {k: config[k] for k in GENERATION_FIELDS if isinstance(config.get(k), (int, float))}


def apply_defaults(body, defaults: dict[str, Any]) -> None:
    """Set each default the request did not send itself (request values win)."""
    for key, value in defaults.items():
        if key not in body.model_fields_set:
            setattr(body, key, type(getattr(body, key))(value))
