"""The bundled tokenizer's files read by transformers give the same ids, decoding and chat rendering as ours."""

import shutil
from importlib import resources

import pytest

from flashnext.tokenizer import TOKENIZER_FILE, load_tokenizer

TEXTS = [
    "Hello, world!",
    "  two  spaces\tand\nnewlines\n",
    "unicode: héllo, 日本語, 🙂👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]
CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "5."},
    {"role": "user", "content": "Reverse: cat dog"},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_transformers_reads_the_same_files(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "tok"
    shutil.copytree(resources.files("flashnext").joinpath("assets/tokenizer"), directory)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / TOKENIZER_FILE))
    auto = transformers.AutoTokenizer.from_pretrained(str(directory))
    for text in TEXTS:
        ours = tok.encode(text)
        assert fast.encode(text, add_special_tokens=False) == ours
        assert auto.encode(text, add_special_tokens=False) == ours
        assert auto.decode(ours, skip_special_tokens=True) == tok.decode(ours)
    assert (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id, len(auto)) == (2, 1, 0, 512)
    for gen in (False, True):
        assert auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen) == tok.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=gen
        )
        ids = auto.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=gen)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        assert list(ids) == tok.apply_chat_template(CHAT, add_generation_prompt=gen)


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <a> & 'b'", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]  # fmt: skip
TOOL_CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "", "reasoning_content": "add them",
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "5.", "reasoning_content": "done"},
    {"role": "user", "content": "And 2 plus 4?"},
]  # fmt: skip


@pytest.mark.parametrize(
    "kwargs", [{}, {"enable_thinking": False}, {"preserve_thinking": False}, {"reasoning_effort": "low"}],
    ids=["default", "thinking-off", "no-preserve", "effort-low"],
)  # fmt: skip
def test_transformers_renders_tools_and_thinking_the_same(tok, tmp_path, kwargs):
    """Tools (the `tojson` of HF templates: keys in order, no HTML escaping), tool calls, tool results, reasoning and
    the template variables render the same through transformers."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "tok"
    shutil.copytree(resources.files("flashnext").joinpath("assets/tokenizer"), directory)
    auto = transformers.AutoTokenizer.from_pretrained(str(directory))
    ours = tok.apply_chat_template(TOOL_CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs)
    theirs = auto.apply_chat_template(TOOL_CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs)
    assert ours == theirs
    assert '"description": "Add <a> & \'b\'"' in ours  # not escaped
