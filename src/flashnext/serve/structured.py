"""What a request asks its output to match: the OpenAI / vLLM fields read, checked, turned into one grammar.

Accepted (exactly one source per request; two are a 400 naming both):
- `response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}`, `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (enforced whether `strict` is true or not);
- vLLM's `structured_outputs`: exactly one of `json` (a schema, object or JSON text), `regex`, `choice` (strings),
  `grammar` (xgrammar EBNF), `json_object` (true), `structural_tag` (xgrammar's `{"type": "structural_tag",
  "format": ...}`);
- the legacy spellings `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM removed them and
  now ignores them silently; here they keep working);
- tools: `tool_choice: "required"`, a named function (`{"type": "function", "function": {"name": ...}}`), or
  `"auto"` with a tool marked `strict: true`, enforced in the model's own XML dialect (`<tool_call>\\n<function=NAME>
  \\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`, xgrammar's Qwen XML structural tag).
Every schema is checked (JSON Schema meta-schema when `jsonschema` is installed) and refused when it uses a keyword
the grammar library would not enforce (`UNENFORCED`), rather than answered with output that may break it.

Thinking: when the prompt leaves a `<think>` block open (the chat template's generation prompt), the grammar lets
the reasoning run free up to `</think>`, then expects the template's `\\n\\n` and the constrained answer
(`grammar_format`): the constraint starts after the reasoning, in one grammar, so speculative drafts that cross
`</think>` are masked and rolled back like any others.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from flashnext.serve import grammar
from flashnext.serve.sampling import FieldError

LEGACY = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
UNENFORCED = ("not", "if", "then", "else", "allOf", "dependentRequired", "dependentSchemas", "dependencies",
              "uniqueItems", "unevaluatedItems", "contentSchema")  # fmt: skip
"""JSON Schema keywords xgrammar accepts but does not enforce (measured: output breaking them was allowed)."""
FORMATS = ("date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
           "uuid", "json-pointer")  # fmt: skip
"""String `format`s xgrammar enforces; any other is refused."""
MAX_WHITESPACE = 16
"""Longest whitespace run allowed between JSON tokens (and around XML tool parameters): enough for a document
indented 2 spaces per level down to 7 levels, and a weak model cannot loop on newlines forever."""
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "contains", "propertyNames", "additionalItems")


class StructuredFields(BaseModel):
    """The request fields read here besides `response_format` and `tools` (declared by the protocol's body)."""

    model_config = ConfigDict(extra="ignore")

    structured_outputs: Any = None
    """vLLM: `{json | regex | choice | grammar | json_object | structural_tag: ...}`."""
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    tool_choice: Any = None
    """"none" | "auto" | "required" | {"type": "function", "function": {"name": NAME}}."""
    parallel_tool_calls: bool | None = None


@dataclass(frozen=True)
class Structured:
    """A request's constraint: `content`, an xgrammar structural-tag format (a JSON-able dict) for the answer,
    and `field`, the request field it came from (errors name it)."""

    content: dict
    field: str


def request_constraint(body) -> Structured | None:
    """The constraint a request body asks for (None: unconstrained); `FieldError` naming the field and the reason
    for anything malformed, conflicting or not enforceable. Reads `response_format`, `structured_outputs`, the
    legacy `guided_*` fields, `tools` and `tool_choice`."""
    sources = []
    rf = getattr(body, "response_format", None)
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        sources.append(("response_format", lambda: _response_format(rf)))
    so = body.structured_outputs
    if so is not None:
        sources.append(("structured_outputs", lambda: _structured_outputs(so)))
    for name in LEGACY:
        value = getattr(body, name)
        if value is not None:
            sources.append((name, lambda n=name, v=value: _kind(n.removeprefix("guided_"), v, n)))
    tools = _tool_constraint(body)
    if tools is not None:
        sources.append(("tool_choice", lambda: tools))
    if len(sources) > 1:
        names = " and ".join(n for n, _ in sources)
        raise FieldError(f"{names} both constrain the output; give only one of them", sources[1][0])
    if not sources:
        return None
    spec = sources[0][1]()  # its own checks first: a malformed request is refused for that, library or not
    grammar.require(sources[0][0])
    return spec


def _response_format(rf) -> Structured:
    if not isinstance(rf, dict):
        raise FieldError(f"response_format must be an object, got {_show(rf)}", "response_format")
    kind = rf.get("type")
    if kind == "json_object":
        return _json({"type": "object"}, "response_format")
    if kind != "json_schema":
        raise FieldError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {_show(kind)}",
            "response_format.type",
        )
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise FieldError("response_format.json_schema must be an object with a 'schema'", "response_format.json_schema")
    return _json(spec["schema"], "response_format.json_schema.schema")


def _structured_outputs(so) -> Structured:
    if not isinstance(so, dict):
        raise FieldError(f"structured_outputs must be an object, got {_show(so)}", "structured_outputs")
    unknown = sorted(k for k in so if k not in KINDS and k not in ("backend", "disable_fallback"))
    if unknown:
        raise FieldError(f"structured_outputs.{unknown[0]} is not supported (supported: {', '.join(KINDS)})",
                         f"structured_outputs.{unknown[0]}")  # fmt: skip
    given = [k for k in KINDS if so.get(k) is not None and so.get(k) is not False]
    if len(given) != 1:
        raise FieldError(f"structured_outputs needs exactly one of {', '.join(KINDS)}, got {given or 'none'}",
                         "structured_outputs")  # fmt: skip
    return _kind(given[0], so[given[0]], f"structured_outputs.{given[0]}")


def _kind(kind: str, value, field: str) -> Structured:
    if kind == "json":
        return _json(value, field)
    if kind == "json_object":
        return _json({"type": "object"}, field)
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise FieldError(f"{field} must be a non-empty string, got {_show(value)}", field)
        key = "pattern" if kind == "regex" else "grammar"
        return Structured({"type": kind, key: value}, field)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise FieldError(f"{field} must be a non-empty list of non-empty strings, got {_show(value)}", field)
        return Structured({"type": "or", "elements": [{"type": "const_string", "value": c} for c in value]}, field)
    tag = _json_value(value, field)  # structural_tag
    if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or not isinstance(tag.get("format"), dict):
        raise FieldError(f"{field} must be {{'type': 'structural_tag', 'format': {{...}}}}, got {_show(value)}", field)
    return Structured(tag["format"], field)


def _json_value(value, field: str):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise FieldError(f"{field} is not valid JSON: {e}", field) from None
    return value


def _json(value, field: str) -> Structured:
    schema = _json_value(value, field)
    check_schema(schema, field)
    fmt = {"type": "json_schema", "json_schema": bounded_strings(schema), "max_whitespace_cnt": MAX_WHITESPACE}
    return Structured(fmt, field)


def bounded_strings(node):
    """`node` with every length-bounded plain string (`minLength` / `maxLength`, no pattern, format, enum or
    const) given the same bounds as a `pattern` over unescaped characters: xgrammar 0.2.9 lets raw control
    characters (U+0000-U+001F but \\n, \\r) into such strings, which is not JSON (measured; without the bounds,
    or with a pattern, it does not). The output is narrowed to strings without quotes, backslashes or control
    characters, which every such schema still accepts."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_strings(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_strings(sub) for sub in out[key]]
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = bounded_strings(out[key])
    bounded = "minLength" in out or "maxLength" in out
    if bounded and out.get("type") == "string" and not any(k in out for k in ("pattern", "format", "enum", "const")):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = '^[^"\\\\\\x00-\\x1f]{' + f"{lo},{hi}" + "}$"
    return out


def check_schema(schema, field: str) -> None:
    """`FieldError` naming `field` for a schema that is not a JSON Schema (meta-schema check) or that uses a
    keyword or string format the grammar library does not enforce."""
    if not isinstance(schema, dict | bool):
        raise FieldError(f"{field} must be a JSON Schema (an object), got {_show(schema)}", field)
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            at = "/".join(str(p) for p in e.path)
            raise FieldError(f"{field} is not a valid JSON Schema: {e.message}" + (f" (at {at})" if at else ""),
                             field) from None  # fmt: skip
    _check_enforceable(schema, field, "")


def _check_enforceable(node, field: str, at: str) -> None:
    if not isinstance(node, dict):
        return
    for key in UNENFORCED:
        if key in node and not (key == "uniqueItems" and node[key] is False):
            raise FieldError(f"{field}: the JSON Schema keyword {key!r} (at {at or '/'}) cannot be enforced by the "
                             "grammar library; remove it or validate the output yourself", field)  # fmt: skip
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in FORMATS:
        raise FieldError(f"{field}: string format {fmt!r} (at {at or '/'}) cannot be enforced (supported: "
                         f"{', '.join(FORMATS)})", field)  # fmt: skip
    for key in _SUBSCHEMA_MAPS:
        for name, sub in (node.get(key) or {}).items() if isinstance(node.get(key), dict) else ():
            _check_enforceable(sub, field, f"{at}/{key}/{name}")
    for key in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(node.get(key) or []) if isinstance(node.get(key), list) else ():
            _check_enforceable(sub, field, f"{at}/{key}/{i}")
    for key in _SUBSCHEMAS:
        _check_enforceable(node.get(key), field, f"{at}/{key}")


# ---- tools ---------------------------------------------------------------------------------------------------
def check_tools(tools) -> list[dict]:
    """The request's function tools, checked: `[{"type": "function", "function": {"name", "parameters"?,
    "strict"?}}]` with unique names and valid, enforceable parameter schemas; `FieldError` naming the tool."""
    if not isinstance(tools, list):
        raise FieldError(f"tools must be a list, got {_show(tools)}", "tools")
    names = set()
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise FieldError(f"{at} must be {{'type': 'function', 'function': {{'name': ...}}}}, got {_show(tool)}", at)
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise FieldError(f"{at}.function.name must be a non-empty string, got {_show(name)}", f"{at}.function.name")
        if name in names:
            raise FieldError(f"{at}.function.name {name!r} is given twice", f"{at}.function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None:
            check_schema(params, f"{at}.function.parameters")
            if isinstance(params, dict) and params.get("type", "object") != "object":
                raise FieldError(f"{at}.function.parameters must describe an object (type 'object'), got type "
                                 f"{_show(params.get('type'))}", f"{at}.function.parameters")  # fmt: skip
    return tools


def _strict(tool: dict) -> bool:
    return bool(tool.get("strict") or tool["function"].get("strict"))


def _tool_constraint(body) -> Structured | None:
    """The tool-call grammar when `tool_choice` asks for one (required, named, or auto with a strict tool)."""
    tools, choice = getattr(body, "tools", None), body.tool_choice
    if tools:
        check_tools(tools)
    if choice is None or choice == "auto":
        if not tools or not any(_strict(t) for t in tools):
            return None
        mode = "auto"
    elif choice == "none":
        return None
    elif choice == "required":
        if not tools:
            raise FieldError("tool_choice='required' needs a non-empty tools list", "tool_choice")
        mode = "required"
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        known = [t["function"]["name"] for t in tools or []]
        if name not in known:
            raise FieldError(f"tool_choice names function {_show(name)}, which is not in tools (tools: "
                             f"{', '.join(known) or 'none'})", "tool_choice")  # fmt: skip
        mode = {"type": "function", "function": {"name": name}}
    else:
        raise FieldError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                         f"{{'name': ...}}}}, got {_show(choice)}", "tool_choice")  # fmt: skip
    grammar.require("tool_choice")
    return Structured(_qwen_xml_format(tools, mode, body.parallel_tool_calls is not False), "tool_choice")


def _qwen_xml_format(tools: list[dict], mode, parallel: bool) -> dict:
    """xgrammar's Qwen XML tool-call format for `tools` (without its reasoning part: `grammar_format` adds
    ours): `auto` lets text and calls mix (the calls of non-strict tools held to any object, the strict ones to
    their schema); `required` is one or more calls and nothing else; a named function is one call of it."""
    fns = []
    for t in tools:
        fn = {"name": t["function"]["name"], "parameters": t["function"].get("parameters") or {"type": "object"}}
        if mode == "auto" and not _strict(t):
            fn["parameters"] = {"type": "object"}
        fns.append({"type": "function", "function": fn})
    tag = grammar.xgr.get_model_structural_tag(
        grammar.QWEN_XML, tools=fns, tool_choice=mode, reasoning="disabled", parallel_tool_calls=parallel,
        max_whitespace_cnt=MAX_WHITESPACE,
    )  # fmt: skip
    fmt = tag.model_dump(mode="json")["format"]
    if mode == "required":  # calls only, one per line, as the template asks ("ONLY reply ... with NO suffix")
        fmt = {"type": "tags_with_separator", "tags": fmt["tags"], "separator": "\n", "at_least_one": True,
               "stop_after_first": not parallel}  # fmt: skip
    return fmt


# ---- the grammar of a request ---------------------------------------------------------------------------------
def think_open(text: str) -> bool:
    """The prompt's text leaves a `<think>` block open (its last `<think>` comes after its last `</think>`)."""
    return text.rfind("<think>") > text.rfind(grammar.THINK_END)


def grammar_format(spec: Structured, reasoning: bool) -> dict:
    """The structural-tag format compiled for a request: `spec.content`, after free reasoning up to `</think>`
    and the template's `\\n\\n` when the prompt leaves a think block open (`reasoning`)."""
    if not reasoning:
        return spec.content
    think = {"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": grammar.THINK_EXCLUDES},
             "end": grammar.THINK_END}  # fmt: skip
    suffix = {"type": "const_string", "value": grammar.REASONING_SUFFIX}
    return {"type": "sequence", "elements": [think, suffix, spec.content]}


def _show(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def attach(parent, ids: list[int], grammars: grammar.Grammars, tokenizer) -> None:
    """Compile `parent.params.structured` for this prompt (`Grammars.compile`: cached, off the engine thread, with
    a time limit) and give each of the request's choices its own `Constraint`. `FieldError` when it cannot."""
    params = parent.params
    spec: Structured = params.structured
    if tokenizer is None:
        raise FieldError(f"{spec.field}: structured outputs need the model's tokenizer", spec.field)
    reasoning = think_open(tokenizer.decode(ids, skip_special_tokens=False))
    compiled = grammars.compile(grammar_format(spec, reasoning), spec.field)
    stops = list(params.stop_token_ids) + ([] if params.ignore_eos or grammars.eos_id is None else [grammars.eos_id])
    for choice in parent.choices:
        choice.constraint = grammar.Constraint(compiled, stops)
