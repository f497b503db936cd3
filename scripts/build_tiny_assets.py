"""Build the tiny default model's bundled assets: a text corpus, an SFT set and a byte-level BPE tokenizer.

Everything is generated here from small tables and templates with a fixed seed (no downloaded text), so running
the script again reproduces the files byte for byte:

    python scripts/build_tiny_assets.py            # writes src/flashnext/assets/
    python scripts/build_tiny_assets.py --out DIR  # somewhere else (e.g. to compare with the bundled files)

Outputs (under `--out`):
- `tiny_corpus.txt`: short factual sentences and little stories, one paragraph per line.
- `tiny_sft.jsonl`: `{"prompt", "completion"}` records (prompt `Q: ...\\nA:`, completion ` answer`) and
  `{"messages": [...]}` conversations, built from the same question generators; short and learnable (arithmetic
  on small numbers, copy/reverse/count, facts from the tables below).
- `tokenizer/tokenizer.json` + `tokenizer/tokenizer_config.json`: byte-level BPE with exactly `--vocab-size` ids
  (special tokens at 0..4, see `flashnext.tokenizer.SPECIAL_TOKENS`), trained on the corpus and the SFT texts,
  with the chat template (`flashnext.tokenizer.QWEN_TEMPLATE`: the Qwen3.8-Flash-Next format).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flashnext import tokenizer as fn_tokenizer
from flashnext.tokenizer import BOS, EOS, PAD, QWEN_TEMPLATE, SPECIAL_TOKENS

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "flashnext" / "assets"
SEED = 20261202

# animal: (sound, legs)
ANIMALS = {
    "cow": ("moo", 4), "dog": ("woof", 4), "cat": ("meow", 4), "duck": ("quack", 2), "sheep": ("baa", 4),
    "owl": ("hoot", 2), "bee": ("buzz", 6), "frog": ("croak", 4), "horse": ("neigh", 4), "lion": ("roar", 4),
    "snake": ("hiss", 0), "pig": ("oink", 4), "mouse": ("squeak", 4), "hen": ("cluck", 2), "spider": ("none", 8),
}  # fmt: skip
COLORS = {
    "the sky": "blue", "grass": "green", "snow": "white", "a banana": "yellow", "a tomato": "red", "coal": "black",
    "a plum": "purple", "a carrot": "orange", "milk": "white", "a lemon": "yellow", "a leaf": "green",
}  # fmt: skip
OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "fast": "slow", "light": "dark", "open": "closed", "early": "late",
    "happy": "sad", "full": "empty", "old": "new", "wet": "dry", "loud": "quiet", "left": "right", "in": "out",
}  # fmt: skip
WORDS = "red sun cat hat map cup box pen sea sky tree bird fish star moon rain road door book milk".split()
NAMES = "Tom Ann Sam Lia Ben Eva Max Zoe Leo Mia".split()
THINGS = "apples pears books stones coins cards shells eggs".split()
NUMBER_WORDS = "zero one two three four five six seven eight nine ten".split()
SYLLABLES = "ar den lo vi ta mor nel qu is ra bel so tor en ka lim".split()


def _a(noun: str) -> str:
    return ("An " if noun[0] in "aeiou" else "A ") + noun


def _countries(rng: random.Random, n: int = 16) -> dict[str, str]:
    """Invented country -> capital names (ours, so the facts are learnable and free of licences)."""
    out: dict[str, str] = {}
    while len(out) < n:
        country = "".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize() + "ia"
        capital = "".join(rng.choice(SYLLABLES) for _ in range(2)).capitalize()
        out.setdefault(country, capital)
    return out


def _question_makers(countries: dict[str, str]) -> list[Callable[[random.Random], tuple[str, str]]]:
    """Generators of (question, answer) pairs; each draws from its own small space so the answers are learnable."""

    def add(r):
        a, b = r.randint(0, 50), r.randint(0, 50)
        return f"What is {a} plus {b}?", f"{a + b}."

    def sub(r):
        a = r.randint(0, 60)
        b = r.randint(0, a)
        return f"What is {a} minus {b}?", f"{a - b}."

    def larger(r):
        a, b = r.sample(range(100), 2)
        return f"Which is larger, {a} or {b}?", f"{max(a, b)}."

    def words(r):
        return r.sample(WORDS, r.randint(2, 5))

    def copy(r):
        w = words(r)
        return "Repeat: " + " ".join(w), " ".join(w)

    def reverse(r):
        w = words(r)
        return "Reverse: " + " ".join(w), " ".join(reversed(w))

    def count_words(r):
        w = words(r)
        return "How many words are in: " + " ".join(w) + "?", f"{len(w)}."

    def count_up(r):
        a = r.randint(0, 20)
        b = a + r.randint(2, 7)
        return f"Count from {a} to {b}.", " ".join(str(i) for i in range(a, b + 1)) + "."

    def after(r):
        if r.random() < 0.5:
            i = r.randrange(25)
            return f"What letter comes after {chr(65 + i)}?", f"{chr(66 + i)}."
        n = r.randint(0, 98)
        return f"What number comes after {n}?", f"{n + 1}."

    def animal(r):
        name, (sound, legs) = r.choice(sorted(ANIMALS.items()))
        if r.random() < 0.5 and sound != "none":
            return f"What sound does {_a(name).lower()} make?", f"{_a(name)} says {sound}."
        return f"How many legs does {_a(name).lower()} have?", f"{_a(name)} has {NUMBER_WORDS[legs]} legs."

    def color(r):
        thing, c = r.choice(sorted(COLORS.items()))
        return f"What color is {thing}?", f"{thing[0].upper() + thing[1:]} is {c}."

    def opposite(r):
        a, b = r.choice(sorted(OPPOSITES.items()))
        if r.random() < 0.5:
            a, b = b, a
        return f"What is the opposite of {a}?", f"The opposite of {a} is {b}."

    def capital(r):
        country, city = r.choice(sorted(countries.items()))
        return f"What is the capital of {country}?", f"The capital of {country} is {city}."

    def story(r):
        name, thing = r.choice(NAMES), r.choice(THINGS)
        a, b = r.randint(1, 9), r.randint(1, 9)
        return f"{name} has {a} {thing} and finds {b} more. How many {thing} does {name} have?", f"{a + b}."

    return [add, sub, larger, copy, reverse, count_words, count_up, after, animal, color, opposite, capital, story]


def build_sft(rng: random.Random, makers, n_prompt: int, n_chat: int) -> list[dict]:
    """Prompt/completion records, then multi-turn chats (optional system prompt, 1-2 exchanges)."""
    records: list[dict] = []
    for _ in range(n_prompt):
        q, a = rng.choice(makers)(rng)
        records.append({"prompt": f"Q: {q}\nA:", "completion": f" {a}"})
    systems = [None, "You are a helpful assistant.", "Answer briefly."]
    for _ in range(n_chat):
        system = rng.choice(systems)
        messages = [{"role": "system", "content": system}] if system else []
        for _ in range(rng.randint(1, 2)):
            q, a = rng.choice(makers)(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        records.append({"messages": messages})
    rng.shuffle(records)
    return records


def build_corpus(rng: random.Random, countries: dict[str, str], n_paragraphs: int) -> list[str]:
    """Plain-text paragraphs stating the tables' facts and small counting stories."""
    facts = [f"{_a(a)} says {s}." for a, (s, _) in ANIMALS.items() if s != "none"]
    facts += [f"{_a(a)} has {NUMBER_WORDS[n]} legs." for a, (_, n) in ANIMALS.items()]
    facts += [f"{t[0].upper() + t[1:]} is {c}." for t, c in COLORS.items()]
    facts += [f"The opposite of {a} is {b}." for a, b in OPPOSITES.items()]
    facts += [f"The capital of {c} is {k}." for c, k in countries.items()]
    paragraphs = []
    for _ in range(n_paragraphs):
        if rng.random() < 0.5:
            paragraphs.append(" ".join(rng.sample(facts, rng.randint(3, 6))))
        else:
            name, thing = rng.choice(NAMES), rng.choice(THINGS)
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            paragraphs.append(
                f"{name} has {a} {thing}. {rng.choice(NAMES)} gives {name} {b} more. Now {name} has {a + b} {thing}."
            )
    return paragraphs


def _texts(corpus: list[str], sft: list[dict]) -> Iterator[str]:
    yield from corpus
    for rec in sft:
        if "messages" in rec:
            for m in rec["messages"]:
                yield f"{m['role']}\n{m['content']}"
        else:
            yield rec["prompt"] + rec["completion"]


def train_tokenizer(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: 256 byte symbols + the special tokens (ids 0..4) + merges up to `vocab_size` ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise SystemExit(f"trained vocab has {tok.get_vocab_size()} ids, wanted {vocab_size}: corpus too small")
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i, (token, tok.token_to_id(token))
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    """The Hugging Face `tokenizer_config.json` (transformers loads it as a `PreTrainedTokenizerFast`)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": QWEN_TEMPLATE,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=SEED)
    args = p.parse_args(argv)

    rng = random.Random(args.seed)
    countries = _countries(rng)
    corpus = build_corpus(rng, countries, n_paragraphs=1500)
    sft = build_sft(rng, _question_makers(countries), n_prompt=2800, n_chat=1200)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiny_corpus.txt").write_text("\n".join(corpus) + "\n", encoding="utf-8")
    (out / "tiny_sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft), encoding="utf-8")
    tok = train_tokenizer(_texts(corpus, sft), args.vocab_size)
    fn_tokenizer.Tokenizer(tok, tokenizer_config(model_max_length=4096)).save(out / "tokenizer")
    print(f"wrote {out}: {len(corpus)} paragraphs, {len(sft)} SFT records, vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
