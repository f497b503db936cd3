"""Structured outputs: what a grammar costs per token, how long a grammar takes to compile, and whether every
constrained output is valid; batch 1 and 16, the bundled tokenizer and a >= 32k-id one.

Model: the 31M config of `benchmarks/model_vs_reference.py` with one MTP layer, seeded random weights (vocab: the
config's 16,384, or the tokenizer's size when larger). Tokenizers: the bundled one (512 ids) and a byte-level BPE
of `--big-vocab` ids (default 32,768) trained here with `tokenizers` on generated text (words, numbers, JSON
snippets; a few seconds).

Per tokenizer and batch b in (1, 16), b prompts, greedy (the model is random, so greedy is as informative as
sampling and makes every run repeatable), in each of `--repeats` rounds, alternating in one process:
- json: `response_format` json_schema (`SCHEMA`: a list of 2-4 records);
- tool: `tool_choice: "required"` over two tools, one call (`parallel_tool_calls: false`: a random model would
  keep adding calls), in the model's XML dialect (`TOOLS`);
- free (after each): the same prompts unconstrained.
Every timed run generates exactly `--tokens` tokens per request (EOS ignored; a grammar that completes early
leaves the rest free), so constrained and free runs do the same model work and differ only by the grammar (masks,
accepting tokens). Printed per (tokenizer, batch, kind): tok/s constrained and free (medians); the grammar's
overhead: the time spent in the engine's grammar hooks (`serve.grammar`: masks, accepting tokens, draft masks)
over the rest of the constrained run's time (median over rounds); the wall-time ratio minus 1 beside it (noisier
on a shared box, and it may also hold a token-dependent model cost: the grammar changes the tokens, and a MoE
step's time can move with its routing; not separated here); and the median time to first token. Then the compile time of
each grammar with a cold cache (time to first mask; the vocabulary's first preparation is printed apart). Whole
outputs (for the tokenizers in `--check`; the random model needs a few hundred tokens per output, which on the
shared box takes minutes): `--check-prompts` per kind, until EOS, with k = 0 and k = 3 MTP drafts: each checked
(JSON parsed and validated by `jsonschema`; tool calls parsed and their arguments validated against the tool's
schema) and the k = 3 tokens compared with k = 0.

Last line: `constrained_overhead_b1=<x> constrained_overhead_b16=<y> valid_rate=<v> grammar_compile_ms=<c>
spec_constrained_identical=<yes|no>`: the overheads are the grammar's (hooks' share), the worst over kinds and
tokenizers; the compile time the slowest cold compile. Numbers on the shared 2-core box are indicative (say the
load when quoting them).

    python benchmarks/structured_output.py                  # minutes on 2 idle threads
    python benchmarks/structured_output.py --repeats 1 --check bundled,big
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import statistics
import time
from pathlib import Path

import jsonschema
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

from flashnext.config import parse_config
from flashnext.model.text import FlashNextForCausalLM
from flashnext.serve import grammar
from flashnext.serve.engine import Engine
from flashnext.serve.sampling import SamplingParams
from flashnext.serve.structured import StructuredFields, request_constraint
from flashnext.tokenizer import Tokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {
    "type": "array", "minItems": 2, "maxItems": 4,
    "items": {"type": "object", "additionalProperties": False, "required": ["id", "name", "ok"], "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999}, "name": {"type": "string", "maxLength": 10},
        "ok": {"type": "boolean"}}},
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 16}}, "required": ["query"]}}},
]  # fmt: skip
PARAM = r"<parameter=([^>\s]+)>(.*?)</parameter>"
CALL = rf"<tool_call>\s*<function=([^>\s]+)>\s*((?:{PARAM}\s*)*)</function>\s*</tool_call>"


class Body(StructuredFields):
    response_format: dict | None = None
    tools: list | None = None


def specs() -> dict:
    return {
        "json": request_constraint(Body(response_format={"type": "json_schema", "json_schema": {"name": "records",
                                                                                               "schema": SCHEMA}})),
        "tool": request_constraint(Body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)),
    }  # fmt: skip


def bench_model(vocab: int, seed: int = 0) -> FlashNextForCausalLM:
    spec = importlib.util.spec_from_file_location("model_vs_reference", ROOT / "benchmarks" / "model_vs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = {**module.CONFIG, "vocab_size": max(vocab, module.CONFIG["vocab_size"]), "mtp_num_hidden_layers": 1}
    model = FlashNextForCausalLM(parse_config(cfg).text).eval()
    model.init_weights(seed)
    return model


def big_tokenizer(size: int) -> Tokenizer:
    """A byte-level BPE of `size` ids trained on generated text (fixed seed)."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 10))) for _ in range(80000)]
    lines = [" ".join(rng.choice(words) for _ in range(10)) + f' {{"id": {rng.randint(0, 9999)}, "ok": true}}'
             for _ in range(60000)]  # fmt: skip
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    backend.train_from_iterator(lines, trainer)
    return Tokenizer(backend, {"eos_token": "<|endoftext|>"})


def valid(kind: str, text: str) -> bool:
    try:
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
            return True
        if not re.fullmatch(rf"(?:\s*{CALL})+\s*", text, re.S):
            return False
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for m in re.finditer(CALL, text, re.S):
            args = {k: v.strip() for k, v in re.findall(PARAM, m.group(2), re.S)}
            schema = schemas[m.group(1)]
            typed = {k: int(v) if schema["properties"][k]["type"] == "integer" else v for k, v in args.items()}
            jsonschema.validate(typed, schema)
        return True
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


class GrammarClock:
    """Times the engine's grammar hooks (masks, accepting tokens): the constrained runs' tokens differ from the
    free runs', and a random MoE model's step time depends on its tokens (routing), so the wall-time ratio mixes
    that in; the hooks' own time is the grammar's cost."""

    def __init__(self):
        self.seconds = 0.0
        for name in ("mask_rows", "accept_emitted", "mask_verify_rows", "draft_argmax", "end_drafts"):
            setattr(grammar, name, self.timed(getattr(grammar, name)))

    def timed(self, fn):
        def wrapper(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - t0

        return wrapper


CLOCK = GrammarClock()


def run(engine: Engine, prompts: list[str], params: list[SamplingParams]):
    """(seconds, outputs, median time to first token)."""
    t0 = time.perf_counter()
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_unfinished():
        engine.step()
    dt = time.perf_counter() - t0
    outs = [r.completion(True) for r in reqs]
    return dt, outs, statistics.median(r.first_token_time - r.arrival for r in reqs)


def bench(name: str, tok: Tokenizer, args, report: dict, check: bool) -> None:
    model = bench_model(tok.vocab_size)
    engine = Engine(model, tok, max_slots=16, max_model_len=1024, max_num_batched_tokens=512)
    t0 = time.perf_counter()
    engine.intake.grammars().compiler()
    print(f"[{name}] vocab {tok.vocab_size} (model {model.config.vocab_size}): grammar vocabulary prepared in "
          f"{(time.perf_counter() - t0) * 1e3:.0f} ms")  # fmt: skip
    kinds = specs()
    for kind, spec in kinds.items():  # cold compiles (the first request of a grammar waits for this)
        t0 = time.perf_counter()
        engine.intake.grammars().compile(spec.content, kind)
        ms = (time.perf_counter() - t0) * 1e3
        report["compile_ms"].append(ms)
        print(f"[{name}] compile {kind}: {ms:.1f} ms (time to first mask)", flush=True)
    for b in (1, 16):
        prompts = [f"Request {i}: give the records of batch {b} as JSON." for i in range(b)]
        for spec in (None, *kinds.values()):  # warm-up (first steps of a batch size, first masks), not timed
            run(engine, prompts, [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, structured=spec)
                                  for _ in prompts])  # fmt: skip
        for kind, spec in kinds.items():
            ratios, shares, tps_c, tps_f, ttft = [], [], [], [], []
            for _ in range(args.repeats):  # the same token budget both ways, EOS ignored: only the grammar differs
                fixed = dict(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
                g0 = CLOCK.seconds
                dt_c, _, t_first = run(engine, prompts, [SamplingParams(**fixed, structured=spec) for _ in prompts])
                hooks = CLOCK.seconds - g0
                dt_f, _, _ = run(engine, prompts, [SamplingParams(**fixed) for _ in prompts])
                ratios.append(dt_c / dt_f)
                shares.append(hooks / (dt_c - hooks))
                tps_c.append(b * args.tokens / dt_c)
                tps_f.append(b * args.tokens / dt_f)
                ttft.append(t_first)
            over, wall = statistics.median(shares), statistics.median(ratios) - 1
            report[f"b{b}"].append(over)
            print(f"[{name}] batch={b} {kind}: tok/s constrained={statistics.median(tps_c):.1f} "
                  f"free={statistics.median(tps_f):.1f} grammar_overhead={over:.1%} (wall-time ratio {wall:+.1%}) "
                  f"ttft={statistics.median(ttft) * 1e3:.0f}ms", flush=True)  # fmt: skip
    if not check:
        return
    same = True
    for kind, spec in kinds.items():  # whole outputs: valid, and the same tokens with k = 3 drafts
        prompts = [f"Request {i}: check." for i in range(args.check_prompts)]
        outs = []
        for k in (0, 3):
            eng = Engine(model, tok, max_slots=4, max_model_len=1024, max_num_batched_tokens=512,
                         num_speculative_tokens=k)  # fmt: skip
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=spec)
            outs.append(eng.generate(prompts, params))
            report["valid"] += [valid(kind, o.text) and o.finish_reason == "stop" for o in outs[-1]]
        same_kind = [a.token_ids for a in outs[0]] == [b.token_ids for b in outs[1]]
        print(f"[{name}] {kind} whole outputs: valid {sum(valid(kind, o.text) for o in outs[0] + outs[1])}/"
              f"{2 * len(prompts)}, k=3 same tokens as k=0: {'yes' if same_kind else 'no'} (drafts accepted "
              f"{sum(o.num_accepted_tokens for o in outs[1])}/{sum(o.num_draft_tokens for o in outs[1])}, "
              f"{sum(len(o.token_ids) for o in outs[0])} tokens)", flush=True)  # fmt: skip
        same &= same_kind
    report["same"] &= same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request in the timed runs")
    parser.add_argument("--max-tokens", type=int, default=400, help="cap of the whole outputs checked")
    parser.add_argument("--check-prompts", type=int, default=2, help="whole outputs per kind and k")
    parser.add_argument("--check", default="bundled", help="tokenizers whose whole outputs are checked")
    parser.add_argument("--big-vocab", type=int, default=32768)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"b1": [], "b16": [], "valid": [], "compile_ms": [], "same": True}
    bench("bundled", load_tokenizer(), args, report, "bundled" in args.check)
    t0 = time.perf_counter()
    big = big_tokenizer(args.big_vocab)
    print(f"trained a {big.vocab_size}-id byte-level BPE in {time.perf_counter() - t0:.1f}s")
    bench(f"bpe{big.vocab_size}", big, args, report, "big" in args.check)
    print(
        f"constrained_overhead_b1={max(report['b1']):.3f} constrained_overhead_b16={max(report['b16']):.3f} "
        f"valid_rate={sum(report['valid']) / len(report['valid']):.3f} "
        f"grammar_compile_ms={max(report['compile_ms']):.1f} "
        f"spec_constrained_identical={'yes' if report['same'] else 'no'}"
    )


if __name__ == "__main__":
    main()
