"""Byte-level BPE tokenizer with a Jinja chat template, stored in the Hugging Face file layout.

A tokenizer directory holds `tokenizer.json` (the `tokenizers` library's serialisation: vocab, merges,
pre-tokenizer, decoder, added tokens) and `tokenizer_config.json` (special token strings and a Jinja
`chat_template`), the two files a Hugging Face checkpoint ships, so `transformers.AutoTokenizer` reads the same
directory and produces the same ids. `load_tokenizer()` with no path returns the bundled tokenizer of the tiny
default model (`assets/tokenizer/`, vocab 512: `<|pad|>`=0, `<|bos|>`=1, `<|endoftext|>`=2, `<|im_start|>`=3,
`<|im_end|>`=4), built by `scripts/build_tiny_assets.py`; `bundled_sft_path()` is the small SFT set built beside it.

Templates see the Hugging Face variables (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, ...) and
render in a sandboxed Jinja environment with `trim_blocks` and `lstrip_blocks`, as transformers renders them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from flashnext.errors import ConfigError, InputError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # the chat template as its own file (transformers >= 4.43 writes it so)

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)  # in id order: the bundled tokenizer puts them at 0..4

# ChatML: every message is `<|im_start|>role\ncontent<|im_end|>\n`; the generation prompt opens an assistant turn.
# No BOS and no rewriting of earlier turns, so rendering a prefix of a conversation gives a prefix of the tokens
# (what `train.data` relies on to put the loss on assistant turns only).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The bundled tokenizer's template (scripts/build_tiny_assets.py writes it into tokenizer_config.json): the
# Qwen3.8-Flash-Next chat format in our own words, so the tiny model exercises what a real checkpoint's template
# does. Variables: `messages` (assistant `tool_calls[].function.arguments` as objects, `reasoning_content`; `tool`
# messages' results), `tools`, `add_generation_prompt`, `enable_thinking` (default on: the generation prompt opens
# `<think>\n`; off: an empty, closed think block), `preserve_thinking` (default on: every past assistant turn keeps
# its think block; off: only those after the last user query), `reasoning_effort` (xhigh (default) | medium | low,
# anything else raises). Past assistant turns always start with a think block, and nothing earlier is rewritten
# by a later turn, so rendering a prefix of a conversation gives a prefix of the tokens (`train.data` relies on it).
QWEN_TEMPLATE = r"""{#- flashnext's template for the tiny model, in the Qwen3.8-Flash-Next chat format: ChatML turns,
    tools listed in the system turn (one JSON object per line inside <tools>), calls in the Qwen3-Coder XML dialect,
    tool results as <tool_response> blocks in a user turn, a <think> block opened by the generation prompt unless
    thinking is off. -#}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- set effort_line = '' %}
{%- if enable_thinking is not defined or enable_thinking is none or enable_thinking %}
    {%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort is not none else 'xhigh' %}
    {%- if effort not in ('xhigh', 'medium', 'low') %}
        {{- raise_exception('Unexpected reasoning effort ' ~ effort
                            ~ '; the supported ones are xhigh (default), medium and low.') }}
    {%- endif %}
    {%- if effort == 'xhigh' %}
        {%- set effort_line = 'Reasoning effort: xhigh.' %}
    {%- elif effort == 'low' %}
        {%- set effort_line = 'Reasoning effort: low.' %}
    {%- endif %}
{%- endif %}
{%- macro text(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is none or content is not defined %}
        {{- '' }}
    {%- else %}
        {{- raise_exception('Message content must be a string.') }}
    {%- endif %}
{%- endmacro %}
{%- set system = text(messages[0].content)|trim if messages[0].role == 'system' else '' %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {%- if effort_line %}
        {{- effort_line + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nThese functions can be called:\n\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool|tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call a function, answer with this block and nothing after it:\n\n' }}
    {{- '<tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nvalue (may span lines)\n</parameter>\n</function>\n' }}
    {{- '</tool_call>\n\nGive every required argument. Explain before a call, never after it.' }}
    {%- if system %}
        {{- '\n\n' + system }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif system or effort_line %}
    {{- '<|im_start|>system\n' + effort_line + ('\n\n' if effort_line and system else '') + system + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set content = text(message.content)|trim %}
        {%- if not (content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.query = loop.index0 %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.query < 0 %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = text(message.content)|trim %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content|trim if message.reasoning_content is string else '' %}
        {%- if preserve_thinking is not defined or preserve_thinking is none or preserve_thinking
               or loop.index0 > ns.query %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for call in message.tool_calls %}
                {%- set call = call.function if call.function is defined else call %}
                {%- if not loop.first %}
                    {{- '\n' }}
                {%- elif content %}
                    {{- '\n\n' }}
                {%- endif %}
                {{- '<tool_call>\n<function=' + call.name + '>\n' }}
                {%- if call.arguments is defined and call.arguments is not none %}
                    {%- for name, value in call.arguments|items %}
                        {{- '<parameter=' + name + '>\n' + (value if value is string else value|tojson) }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role ' ~ message.role ~ '.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is not none and not enable_thinking %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}"""


def _raise_exception(message: str) -> None:
    # Templates call `raise_exception(...)` to reject conversations they cannot render (HF convention).
    raise InputError(f"chat template: {message}")


def _token_string(value: Any) -> str | None:
    if isinstance(value, Mapping):  # older configs store {"content": "<|...|>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # As Hugging Face templates expect `tojson`: plain JSON, keys in their order, no HTML escaping (Jinja's own
    # filter sorts keys and escapes `<`, `>`, `&` and `'`, which would change what the model reads).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    return env.from_string(source)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template of its `tokenizer_config.json`.

    Args:
        backend: the byte-level BPE (`tokenizers.Tokenizer`).
        config: the `tokenizer_config.json` mapping; `bos_token`, `eos_token`, `pad_token` name added tokens of
            `backend` (each may be absent or null), `chat_template` is a Jinja string (optional).

    Raises:
        ConfigError: a special token named in `config` is not in the vocabulary.
    """

    def __init__(self, backend: tokenizers.Tokenizer, config: Mapping[str, Any]):
        self.backend = backend
        self.config = dict(config)
        self._tokens = {name: _token_string(self.config.get(name)) for name in ("bos_token", "eos_token", "pad_token")}
        self._ids = {name: self._special_id(name, token) for name, token in self._tokens.items()}
        template = self.config.get("chat_template")
        self._template = _compile_template(template) if isinstance(template, str) else None

    def _special_id(self, name: str, token: str | None) -> int | None:
        if token is None:
            return None
        tid = self.backend.token_to_id(token)
        if tid is None:
            raise ConfigError(f"tokenizer_config {name}={token!r} is not in the vocabulary")
        return tid

    @property
    def bos_token_id(self) -> int | None:
        return self._ids["bos_token"]

    @property
    def eos_token_id(self) -> int | None:
        return self._ids["eos_token"]

    @property
    def pad_token_id(self) -> int | None:
        return self._ids["pad_token"]

    @property
    def vocab_size(self) -> int:
        """Number of ids, added (special) tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` [n]; nothing is added, but special-token strings in `text` map to their ids."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are dropped unless `skip_special_tokens=False`."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Render a conversation with the chat template.

        Args:
            messages: `[{"role": str, "content": str}, ...]`.
            add_generation_prompt: end with the header of an assistant turn.
            tokenize: return token ids (special-token strings recognised) instead of the string.
            **template_kwargs: extra template variables.

        Raises:
            ConfigError: the tokenizer has no chat template.
        """
        if self._template is None:
            raise ConfigError("tokenizer_config has no chat_template")
        text = self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self._tokens["bos_token"] or "",
            eos_token=self._tokens["eos_token"] or "",
            pad_token=self._tokens["pad_token"] or "",
            **template_kwargs,
        )
        return self.encode(text) if tokenize else text

    def save(self, directory: str | Path) -> Path:
        """Write `tokenizer.json` and `tokenizer_config.json` into `directory` (created); returns it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / TOKENIZER_FILE), pretty=True)
        (directory / CONFIG_FILE).write_text(json.dumps(self.config, indent=2, ensure_ascii=False) + "\n")
        return directory


def _assets() -> Traversable:
    return resources.files("flashnext").joinpath("assets")


def _read(directory: Path | Traversable, name: str) -> str:
    file = directory.joinpath(name)
    if not file.is_file():
        raise ConfigError(f"tokenizer file {name} not found: {file}")
    return file.read_text(encoding="utf-8")


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Load a tokenizer directory (`tokenizer.json` + `tokenizer_config.json`, the Hugging Face layout; a
    `chat_template.jinja` beside them is the chat template, as transformers reads it).

    Args:
        path: the directory; `None` loads the bundled tokenizer of the tiny default model.

    Raises:
        ConfigError: a file is missing or unreadable (the message names its path).
    """
    directory = _assets().joinpath("tokenizer") if path is None else Path(path)
    if isinstance(directory, Path) and not directory.is_dir():
        raise ConfigError(f"tokenizer directory not found: {directory}")
    backend_text, config_text = _read(directory, TOKENIZER_FILE), _read(directory, CONFIG_FILE)
    try:
        backend = tokenizers.Tokenizer.from_str(backend_text)
    except Exception as e:  # tokenizers raises a plain Exception on malformed files
        raise ConfigError(f"cannot parse {directory.joinpath(TOKENIZER_FILE)}: {e}") from None
    try:
        config = json.loads(config_text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"cannot parse {directory.joinpath(CONFIG_FILE)}: {e}") from None
    template = directory.joinpath(TEMPLATE_FILE)
    if isinstance(config, dict) and template.is_file():  # newer checkpoints ship it beside the config; it wins
        config["chat_template"] = template.read_text(encoding="utf-8")
    return Tokenizer(backend, config)


def bundled_sft_path() -> Path:
    """Path of the bundled SFT set (`assets/tiny_sft.jsonl`: prompt/completion and chat records)."""
    return Path(str(_assets().joinpath("tiny_sft.jsonl")))


def bundled_corpus_path() -> Path:
    """Path of the bundled plain-text corpus the tiny tokenizer was trained on (`assets/tiny_corpus.txt`)."""
    return Path(str(_assets().joinpath("tiny_corpus.txt")))
