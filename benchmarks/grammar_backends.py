"""xgrammar vs llguidance on this box: grammar compile time and per-step mask time for one JSON schema, with the
bundled tokenizer (512 ids) and a 32,768-id byte-level BPE trained here with `tokenizers` (how `serve/grammar.py`'s
library was chosen; the result is in benchmarks/RESULTS.md).

Per library and tokenizer: the vocabulary's preparation (once per server), the schema's compile (xgrammar's
compiler; llguidance's grammar plus its first matcher, which is where it does its work), and the time of every
mask fill while the matcher walks one valid document token by token (mean, median, max), plus xgrammar's CPU apply
kernel on one fp32 row. Needs both libraries (`pip install xgrammar llguidance`; llguidance is not a dependency of
flashnext) and transformers (llguidance reads a fast tokenizer).

    python benchmarks/grammar_backends.py
"""

from __future__ import annotations

import json
import random
import statistics
import time

import llguidance
import llguidance.hf
import llguidance.numpy as llg_np
import torch
import xgrammar as xgr
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from flashnext.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
}  # fmt: skip
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engine", "poetry"], "ok": True})


def big_tokenizer(size: int = 32768) -> PreTrainedTokenizerFast:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 12))) for _ in range(60000)]
    lines = [" ".join(rng.choice(words) for _ in range(12)) + ' {"k": [1, 2.5, "x"]}' for _ in range(40000)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    backend.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def us(xs: list[float]) -> str:
    mean, median, top = statistics.mean(xs) * 1e6, statistics.median(xs) * 1e6, max(xs) * 1e6
    return f"mean {mean:.0f} us, median {median:.0f} us, max {top:.0f} us"


def measure(name: str, tok: PreTrainedTokenizerFast) -> None:
    vocab, eos = len(tok), tok.eos_token_id
    ids = tok.encode(DOCUMENT, add_special_tokens=False) + [eos]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
    t_vocab = time.perf_counter() - t0
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t_compile = time.perf_counter() - t0
    matcher, bitmask, fills = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab), []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        fills.append(time.perf_counter() - t0)
        assert matcher.accept_token(t)
    logits = torch.randn(1, vocab)
    t0 = time.perf_counter()
    for _ in range(100):
        xgr.apply_token_bitmask_inplace(logits, bitmask)
    t_apply = (time.perf_counter() - t0) / 100
    print(f"{name} ({vocab} ids) xgrammar: vocabulary {t_vocab * 1e3:.1f} ms, compile {t_compile * 1e3:.1f} ms, "
          f"mask {us(fills)}, apply (1 row, fp32) {t_apply * 1e6:.0f} us")  # fmt: skip
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t_vocab = time.perf_counter() - t0
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    t_compile = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    mask, fills = llg_np.allocate_token_bitmask(1, vocab), []
    for t in ids:
        t0 = time.perf_counter()
        llg_np.fill_next_token_bitmask(matcher, mask, 0)
        fills.append(time.perf_counter() - t0)
        assert matcher.consume_token(t), matcher.get_error()
    print(f"{name} ({vocab} ids) llguidance: vocabulary {t_vocab * 1e3:.1f} ms, compile {t_compile * 1e3:.1f} ms, "
          f"mask {us(fills)}")  # fmt: skip


def main() -> None:
    bundled = PreTrainedTokenizerFast(tokenizer_object=load_tokenizer().backend, eos_token="<|endoftext|>")
    measure("bundled", bundled)
    measure("bpe32768", big_tokenizer())


if __name__ == "__main__":
    main()
