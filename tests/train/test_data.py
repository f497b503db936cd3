"""JSONL datasets: the three line kinds, loss only on completion/assistant tokens, file:line errors."""

import json

import pytest

from flashnext.errors import InputError
from flashnext.train.data import IGNORE, Example, ModelLimits, load_jsonl, parse_record


class ByteTokenizer:
    """UTF-8 bytes shifted by 3 (0 = pad, 1 = bos, 2 = eos), like a tiny HF tokenizer's `encode`."""

    eos_token_id = 2

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode()]


class ChatTokenizer(ByteTokenizer):
    """`apply_chat_template` with a ChatML-like layout: `<role>\\ncontent<end>\\n` per message."""

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>\n{m['content']}<end>\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>\n"
        return self.encode(text) if tokenize else text


class RewritingChatTokenizer(ChatTokenizer):
    """A template that drops earlier assistant turns' content (not prefix-stable)."""

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        kept = [m if m["role"] != "assistant" or i == last else {**m, "content": ""} for i, m in enumerate(messages)]
        return super().apply_chat_template(kept, tokenize, add_generation_prompt)


def _write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def _decode(ids):
    return bytes(t - 3 for t in ids if t >= 3).decode()


def test_prompt_completion_loss_only_on_completion(tmp_path):
    path = _write(tmp_path, [{"prompt": "Q: 1+1?", "completion": " 2"}, "", {"prompt": "", "completion": "x"}])
    tok = ByteTokenizer()
    first, second = load_jsonl(path, tok)
    assert first.input_ids == tok.encode("Q: 1+1? 2") + [2]
    assert first.labels == [IGNORE] * 7 + tok.encode(" 2") + [2]
    assert second == Example(tok.encode("x") + [2], tok.encode("x") + [2])
    assert load_jsonl(path, tok, add_eos=False)[0].input_ids == tok.encode("Q: 1+1? 2")


def test_messages_loss_only_on_assistant_turns(tmp_path):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    (ex,) = load_jsonl(_write(tmp_path, [{"messages": messages}]), ChatTokenizer())
    assert _decode(ex.input_ids) == "".join(f"<{m['role']}>\n{m['content']}<end>\n" for m in messages)
    trained = [_decode([t]) if t != IGNORE else "|" for t in ex.labels]
    spans = [s for s in "".join(trained).split("|") if s]
    assert spans == ["hello<end>\n", "ciao<end>\n"]  # the role header is prompt, the end marker is trained


def test_messages_rejects_templates_that_rewrite_earlier_turns():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    with pytest.raises(InputError, match=r"prefix-stable at messages\[1\]"):
        parse_record({"messages": messages}, RewritingChatTokenizer())


def test_pretokenized_with_and_without_labels(tmp_path):
    path = _write(tmp_path, [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9]}])
    a, b = load_jsonl(path)  # no tokenizer needed
    assert a == Example([5, 6, 7], [-100, 6, 7])
    assert b == Example([8, 9], [8, 9])


@pytest.mark.parametrize(
    "line, problem",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ({"text": "hi"}, "unknown record with keys \\['text'\\]"),
        ({"prompt": "a", "completion": 3}, "'completion' must be a string"),
        ({"input_ids": [1, "2"]}, "'input_ids' must be a list of integers"),
        ({"input_ids": [1, 2], "labels": [1]}, "'labels' has 1 entries, 'input_ids' has 2"),
        ({"input_ids": []}, "record has no tokens"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\] must be an object"),
    ],
    ids=["json", "not-object", "unknown-kind", "completion-type", "ids-type", "labels-len", "empty", "no-msgs", "msg"],
)
def test_malformed_line_names_file_and_line(tmp_path, line, problem):
    path = _write(tmp_path, [{"input_ids": [1]}, "", line])
    with pytest.raises(InputError, match=rf"data\.jsonl:3: {problem}"):
        load_jsonl(path, ChatTokenizer())


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match=r"data\.jsonl:1: .*need a tokenizer with `encode`"):
        load_jsonl(_write(tmp_path, [{"prompt": "a", "completion": "b"}]))
    with pytest.raises(InputError, match=r"need a tokenizer with `apply_chat_template`"):
        load_jsonl(_write(tmp_path, [{"messages": [{"role": "user", "content": "a"}]}]), ByteTokenizer())


# ---- ids checked against the model at load time, invalid bytes: file:line and the field -------------------
LIMITS = ModelLimits(vocab_size=64, num_layers=2, num_experts=4, top_k=2)
ROUTE = [[0, 1], [2, 3]]  # one token: [layers][top_k]


def _rl(n, routed):
    return {"input_ids": list(range(5, 5 + n)), "advantages": 1.0, "inference_logprobs": [0.0] * n, **routed}


@pytest.mark.parametrize(
    "line, problem",
    [
        ({"input_ids": [5, 64, 7]}, r"'input_ids' has id 64 at position 1 >= the model's vocab_size=64"),
        ({"input_ids": [5, 6], "labels": [-100, 99]}, r"'labels' has 99 at position 1; expected -100 \(no loss\)"),
        ({"input_ids": [5, 6], "labels": [-1, 6]}, r"'labels' has -1 at position 0"),
        ({"input_ids": [5, -2]}, r"'input_ids' has a negative id -2"),
        (_rl(2, {"routed_experts": [ROUTE, [[0, 1], [2, 4]]]}), r"'routed_experts' token 1 layer 1 has expert id 4"),
        (_rl(1, {"routed_experts": [[[0, -1], [2, 3]]]}), r"'routed_experts' token 0 layer 0 has expert id -1"),
        (_rl(1, {"routed_experts": [[[0, 1]]]}), r"'routed_experts' token 0 has 1 layer rows; .*num_hidden_layers=2"),
        (_rl(1, {"routed_experts": [[[0], [1]]]}), r"'routed_experts' token 0 layer 0 has 1 experts; .*=2"),
        (_rl(2, {"routed_experts": [ROUTE]}), r"'routed_experts' must be \[2 tokens\]\[moe layers\]\[top_k\]"),
        (_rl(1, {"routed_experts": [[[0, 1.5], [2, 3]]]}), r"'routed_experts' must be \[1 tokens\]"),
    ],
    ids=["id>=vocab", "label>=vocab", "label<0", "id<0", "expert>=E", "expert<0", "layers", "top_k", "tokens", "float"],
)
def test_ids_outside_the_model_are_refused_at_load_naming_file_line_and_field(tmp_path, line, problem):
    path = _write(tmp_path, [{"input_ids": [1, 2]}, _rl(1, {"routed_experts": [ROUTE]}), line])
    with pytest.raises(InputError, match=rf"data\.jsonl:3: {problem}"):
        load_jsonl(path, limits=LIMITS)


def test_ids_inside_the_model_load_and_without_limits_only_the_types_are_checked(tmp_path):
    path = _write(tmp_path, [{"input_ids": [0, 63], "labels": [-100, 63]}, _rl(1, {"routed_experts": [ROUTE]})])
    plain, rl = load_jsonl(path, limits=LIMITS)
    assert plain == Example([0, 63], [-100, 63]) and rl.routed_experts == [ROUTE]
    assert load_jsonl(_write(tmp_path, [{"input_ids": [500]}]))[0].input_ids == [500]  # no model to check against


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"input_ids": [1]}\n\n{"prompt": "caf\xe9", "completion": "x"}\n')
    with pytest.raises(InputError, match=r"data\.jsonl:3: invalid UTF-8 \(byte 0xe9 at byte 16 of the line\)"):
        load_jsonl(path, ByteTokenizer())


def test_a_utf8_bom_is_not_an_error(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"input_ids": [1, 2]}\n')
    assert load_jsonl(path) == [Example([1, 2], [1, 2])]
