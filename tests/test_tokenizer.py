"""The bundled tokenizer and SFT set: ids fit the tiny config, chat rendering (the Qwen3.8 format), HF-compatible
files."""

import json
from importlib import resources

import pytest

from flashnext.errors import ConfigError
from flashnext.tokenizer import CONFIG_FILE, TOKENIZER_FILE, bundled_corpus_path, bundled_sft_path, load_tokenizer
from flashnext.train.data import IGNORE, load_jsonl

TEXTS = [
    "Hello, world!",
    "What is 17 plus 25?\nA: 42.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n",
    "unicode: héllo wörld, ñandú, Ελληνικά, 日本語, emoji 🙂👍🏽",
    "",
]
CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "5."},
    {"role": "user", "content": "Reverse: cat dog"},
    {"role": "assistant", "content": "dog cat"},
]
CHAT_TEXT = (  # thinking on by default: the effort line, and every past assistant turn keeps its (empty) think block
    "<|im_start|>system\nReasoning effort: xhigh.\n\nAnswer briefly.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n5.<|im_end|>\n"
    "<|im_start|>user\nReverse: cat dog<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\ndog cat<|im_end|>\n"
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def tiny_config():
    return json.loads(resources.files("flashnext").joinpath("configs/tiny.json").read_text())


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(isinstance(i, int) for i in ids)


def test_merges_compress_common_text(tok):
    text = "The opposite of hot is cold."
    assert len(tok.encode(text)) < len(text.encode()) / 2


def test_vocab_and_special_ids_match_tiny_config(tok, tiny_config):
    assert tok.vocab_size == tiny_config["vocab_size"] == 512
    assert tok.eos_token_id == tiny_config["eos_token_id"] == 2
    assert tok.bos_token_id == tiny_config["bos_token_id"] == 1
    assert tok.pad_token_id == 0
    specials = ["<|pad|>", "<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert [tok.encode(s) for s in specials] == [[0], [1], [2], [3], [4]]
    assert tok.decode([3, *tok.encode("hi"), 4, 2]) == "hi"
    assert tok.decode([3, *tok.encode("hi"), 4], skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_bundled_text_ids_fit_the_vocab(tok, tiny_config):
    ids = tok.encode(bundled_corpus_path().read_text(encoding="utf-8"))
    ids += tok.encode(bundled_sft_path().read_text(encoding="utf-8"))
    assert 0 <= min(ids) and max(ids) < tiny_config["vocab_size"]


def test_chat_template_renders_the_qwen_format(tok):
    assert tok.apply_chat_template(CHAT, tokenize=False) == CHAT_TEXT
    prompt = tok.apply_chat_template(CHAT[:2], add_generation_prompt=True, tokenize=False)
    assert prompt == CHAT_TEXT.split("\n</think>")[0] and prompt.endswith("<|im_start|>assistant\n<think>\n")
    ids = tok.apply_chat_template(CHAT[:2], add_generation_prompt=True)
    assert ids == tok.encode(prompt)
    assert ids.count(3) == 3 and ids.count(4) == 2 and ids[-1] == tok.encode("\n")[0]


def test_bundled_sft_loads_with_loss_only_on_answers(tok):
    lines = bundled_sft_path().read_text(encoding="utf-8").splitlines()
    examples = load_jsonl(bundled_sft_path(), tok)
    assert len(examples) == len(lines) >= 2000
    # short: chat records carry the template's system effort line and empty think blocks, hence the looser bound
    assert sum(len(ex) < 96 for ex in examples) > 0.8 * len(examples) and max(map(len, examples)) < 160
    assert bundled_sft_path().stat().st_size < 1_000_000
    kinds = set()
    for line, ex in zip(lines, examples, strict=True):
        rec = json.loads(line)
        assert max(ex.input_ids) < tok.vocab_size
        trained = [t for t in ex.labels if t != IGNORE]
        if "messages" in rec:
            kinds.add("messages")
            answers = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
            # the generation prompt opened the think block: the model learns to close it (empty) and answer
            want = "".join("\n</think>\n\n" + a + "<|im_end|>\n" for a in answers)
            assert tok.decode(trained, skip_special_tokens=False) == want
        else:
            kinds.add("prompt")
            assert trained == tok.encode(rec["completion"]) + [tok.eos_token_id]
            assert ex.input_ids[: len(ex.input_ids) - len(trained)] == tok.encode(rec["prompt"])
    assert kinds == {"messages", "prompt"}


def test_save_then_load_is_equivalent(tok, tmp_path):
    tok.save(tmp_path / "tok")
    again = load_tokenizer(tmp_path / "tok")
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    assert again.apply_chat_template(CHAT, tokenize=False) == CHAT_TEXT
    assert (again.eos_token_id, again.bos_token_id, again.pad_token_id, again.vocab_size) == (2, 1, 0, 512)
    assert again.config == tok.config


@pytest.mark.parametrize("missing", [TOKENIZER_FILE, CONFIG_FILE])
def test_missing_file_error_names_the_path(tok, tmp_path, missing):
    directory = tok.save(tmp_path / "tok")
    (directory / missing).unlink()
    with pytest.raises(ConfigError, match=str(directory / missing)):
        load_tokenizer(directory)
    with pytest.raises(ConfigError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")


def test_no_chat_template_is_a_clear_error(tok, tmp_path):
    directory = tok.save(tmp_path / "tok")
    config = json.loads((directory / CONFIG_FILE).read_text())
    del config["chat_template"]
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="chat_template"):
        load_tokenizer(directory).apply_chat_template(CHAT)


def test_chat_template_jinja_file_is_the_template(tok, tmp_path):
    """Checkpoints saved by newer transformers keep the template in `chat_template.jinja`: it is the one used."""
    directory = tok.save(tmp_path / "tok")
    (directory / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert (
        load_tokenizer(directory).apply_chat_template(CHAT[:2], tokenize=False)
        == "[system]Answer briefly.[user]What is 2 plus 3?"
    )
