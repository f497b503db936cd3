"""Speculative decoding with the MTP head: greedy tok/s and acceptance for k = 0, 1, 3 draft tokens, batch 1 and 16.

Model: the tiny default (`configs/tiny.json`: hidden 64, 4 layers, one MTP layer, vocab 512), trained here from
its seeded init (`model.seed` 0) for `--train-steps` steps (default 200) with the trainer: the LM loss plus the MTP
head's next-next-token loss (`train.mtp_loss_weight` 1), AdamW/Muon as `configs/tiny-sft.toml`, on the bundled
corpus (`assets/tiny_corpus.txt`, 6 lines per example, tokenized by the bundled tokenizer): templated sentences
("The capital of X is Y.", "A dog says woof.", "Sam has 5 stones. ..."), so a trained target continues a prompt
with text its head can learn to predict. Reproducible: every seed is fixed. On the shared 2-core box the training
takes about 3-5 minutes (one thread); `--save DIR` keeps the trained model, `--model DIR` loads one instead.

Measurement: for batch b in 1, 16, b prompts (the first 4 words of b corpus lines), `--new-tokens` (default 128)
new tokens each, greedy, EOS ignored; `Engine.generate` with b slots; tok/s = b * new tokens / wall seconds
(prefill included). The runs alternate k = 0, 3, 1, auto in every repeat (the box is shared: each k sees the same load
drift); printed are the median tok/s of `--repeats`, the speedup as the median over repeats of each repeat's
tok/s ratio to its own k = 0 run (robust to load changing between repeats), the acceptance rate (accepted /
drafted) and the mean accepted length (tokens per verify step, the one the target always gives included). Every
speculative run's tokens are compared with the k = 0 run's (greedy speculation is exact; a difference can only
come from a near tie moved by float rounding).

`--prompts sft` measures what serving a model trained by `configs/tiny-sft.toml` sees instead (e.g. `--model
runs/tiny-sft/final`): the prompts are that recipe's 80 held-out examples (their text up to the first answer token:
"Q: What is 7 plus 34?\nA:", chat turns), all of them at each batch size (`--batches` sets the engine's slots),
up to `--new-tokens` each, stopping at EOS as a server does; tok/s counts the tokens actually generated.

Output:
    trained <n> steps in <s>s: loss <x>, mtp_loss <y>          (or: loaded <dir>)
    batch=<b> k=<k> tok/s=<x> speedup=<x> acceptance=<a> mean_length=<l> same_tokens=<yes|no>
    spec_speedup_batch1_k3=<x> acceptance_k3=<y> spec_auto_min=<x> [spec_auto_deep_b1=<x>]   (last line)

`auto` is `num_speculative_tokens="auto"` (`serve.spec_auto`: per-request k from its acceptance and the measured
draft/verify costs, 0 where drafting does not pay); `spec_auto_min` is its lowest speedup over the batch sizes.
`--deep` trains a deep thin variant instead (the tiny default with 24 layers: a draft step is a far smaller share
of a target step, as in the released model) and adds `spec_auto_deep_b<first batch>`.
`--decode-graph` runs plain decode steps as the compiled decode step (`Engine(decode_graph=True)`, the batch's bucket
compiled once: minutes on this box, ~6x longer for `--deep`) while speculative steps (verify and drafts) stay eager:
every k of a batch size then shares one engine (default "auto", a fixed k per request), so auto keeps what it
measured across the runs, as a server would.

    python benchmarks/spec_decode.py
    python benchmarks/spec_decode.py --train-steps 60 --repeats 3 --save /tmp/spec-tiny
    python benchmarks/spec_decode.py --model /tmp/spec-tiny
    python benchmarks/spec_decode.py --deep --train-steps 100 --batches 1 4
    python benchmarks/spec_decode.py --model runs/tiny-sft/final --prompts sft --batches 1 --new-tokens 32
    python benchmarks/spec_decode.py --model /tmp/spec-tiny --decode-graph --batches 1 --repeats 3 --new-tokens 64
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

import flashnext
from flashnext.serve.engine import Engine
from flashnext.serve.sampling import SamplingParams
from flashnext.tokenizer import load_tokenizer
from flashnext.train.config import load_run_config, toml_literal
from flashnext.train.loss import IGNORE_INDEX
from flashnext.train.setup import load_examples
from flashnext.train.trainer import Trainer

KS = (0, 3, 1, "auto")
DEEP = {"num_hidden_layers": 24, "layer_types": ["linear_attention"] * 3 + ["full_attention"], "ple_layer_ids": [2]}


def corpus_lines() -> list[str]:
    text = resources.files("flashnext").joinpath("assets/tiny_corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def write_corpus(path: Path, tok, lines_per_example: int = 6) -> None:
    """The corpus as pre-tokenized examples of a few lines each (every token a label)."""
    lines = corpus_lines()
    with open(path, "w") as f:
        for i in range(0, len(lines), lines_per_example):
            ids = tok.encode("\n".join(lines[i : i + lines_per_example]) + "\n")
            f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")


def train(steps: int, threads: int, deep: bool = False):
    """The tiny default (`deep`: 24 layers of it) trained with the LM and MTP losses; (model, summary line)."""
    tok = load_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "corpus.jsonl"
        write_corpus(data, tok)
        overrides = [
            f"--out_dir={json.dumps(str(Path(tmp) / 'run'))}", f"--data.path={json.dumps(str(data))}",
            "--data.token_budget=1024", f"--train.steps={steps}", f"--train.threads={threads}",
            "--train.mtp_loss_weight=1.0", "--optim.lr=3e-3", "--optim.mtp_lr=3e-3", "--optim.warmup_steps=5",
            "--log.progress=false", "--log.peak_flops=1e9", "--checkpoint.export=false",
        ]  # fmt: skip
        if deep:
            model = {**DEEP, "layer_types": DEEP["layer_types"] * (DEEP["num_hidden_layers"] // 4)}
            overrides.append("--model.overrides=" + toml_literal(model))
        trainer = Trainer(load_run_config(None, overrides), say=lambda *a, **k: None)
        t0 = time.perf_counter()
        for _ in range(steps):
            metrics = trainer.train_step(trainer.next_micro_batches())
        seconds = time.perf_counter() - t0
    summary = f"trained {steps} steps in {seconds:.0f}s: loss {metrics['loss']:.3f}, mtp_loss {metrics['mtp_loss']:.3f}"
    return trainer.model.eval(), summary


def prompts(tok, batch: int) -> list[list[int]]:
    lines = corpus_lines()
    step = max(1, len(lines) // batch)
    return [tok.encode(" ".join(lines[i * step].split()[:4])) for i in range(batch)]


def sft_prompts(tok) -> list[list[int]]:
    """The held-out examples of `configs/tiny-sft.toml`, each cut before its first answer token."""
    cfg = load_run_config(Path(__file__).resolve().parents[1] / "configs" / "tiny-sft.toml")
    _, held_out = load_examples(cfg, tok)
    return [ex.input_ids[: next(i for i, y in enumerate(ex.labels) if y != IGNORE_INDEX)] for ex in held_out]


def run(model, batch_prompts: list[list[int]], k: int, new_tokens: int, slots: int | None = None, eos: bool = False,
        engine: Engine | None = None):  # fmt: skip
    """(tok/s, engine stats, outputs) of one greedy generation with k draft tokens (`slots`: the engine's, default
    one per prompt; `eos`: stop at EOS, else generate `new_tokens` each). `engine`: run on this one (its default
    "auto"; a fixed k per request) instead of a new one; its speculation counters restart."""
    longest = max(len(p) for p in batch_prompts)
    fixed = None if k == "auto" else k
    if engine is None:
        engine = Engine(model, None, max_slots=slots or len(batch_prompts), max_model_len=longest + new_tokens + 1,
                        max_num_batched_tokens=512, num_speculative_tokens=k)  # fmt: skip
        fixed = None
    engine.stats.spec_drafted = engine.stats.spec_accepted = engine.stats.spec_verify_steps = 0  # this run's
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=not eos, num_speculative_tokens=fixed)
    t0 = time.perf_counter()
    outs = engine.generate(batch_prompts, params)
    seconds = time.perf_counter() - t0
    stats = copy.copy(engine.stats)  # this run's counters (a shared engine's go on counting)
    return sum(len(o.token_ids) for o in outs) / seconds, stats, [o.token_ids for o in outs]


def graph_engine(model, batch_prompts: list[list[int]], new_tokens: int, slots: int | None = None) -> Engine:
    """One engine for every k of a batch size (`--decode-graph`): plain decode steps run its compiled decode
    step (the bucket of this batch, compiled here, once), speculative ones stay eager; default k "auto", the
    fixed k per request."""
    longest = max(len(p) for p in batch_prompts)
    slots = slots or len(batch_prompts)
    engine = Engine(model, None, max_slots=slots, max_model_len=longest + new_tokens + 1, max_num_batched_tokens=512,
                    num_speculative_tokens="auto", decode_graph=True, decode_buckets=[slots])  # fmt: skip
    print(f"decode graph batch={slots}: compiled in {engine.decode_graph.warmup()[slots]:.0f}s", flush=True)
    return engine


def bench(model, tok, batch: int, new_tokens: int, repeats: int, sft: list[list[int]] | None = None,
          decode_graph: bool = False) -> dict[int, tuple[float, float, float, float, bool]]:  # fmt: skip
    """Per k: (median tok/s, median speedup over k = 0 within a repeat, acceptance, mean accepted length, same
    tokens as k = 0). `sft`: these prompts, all of them through `batch` slots, stopping at EOS. `decode_graph`:
    every run on one engine whose plain decode steps are the compiled decode step (`graph_engine`)."""
    batch_prompts = prompts(tok, batch) if sft is None else sft
    slots, eos = (None, False) if sft is None else (batch, True)
    rates: dict[int, list[float]] = {k: [] for k in KS}
    last: dict[int, tuple] = {}
    engine = graph_engine(model, batch_prompts, new_tokens, slots) if decode_graph else None
    run(model, batch_prompts[:batch], 3, 8, engine=engine)  # warm-up (first-call allocations)
    for _ in range(repeats):
        for k in KS:
            rate, stats, tokens = run(model, batch_prompts, k, new_tokens, slots, eos, engine)
            rates[k].append(rate)
            last[k] = (stats, tokens)
    out = {}
    for k in KS:
        stats, tokens = last[k]  # (auto: the acceptance of the drafts it chose to make)
        speedup = statistics.median(r / r0 for r, r0 in zip(rates[k], rates[0], strict=True))
        out[k] = (statistics.median(rates[k]), speedup, stats.acceptance_rate, stats.mean_accepted_length,
                  tokens == last[0][1])  # fmt: skip
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--model", default=None, help="a checkpoint with an MTP head instead of training one")
    p.add_argument("--save", default=None, help="save the trained model here (official layout)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--deep", action="store_true", help="a deep thin model: the tiny default with 24 layers")
    p.add_argument(
        "--decode-graph",
        action="store_true",
        help="plain decode steps as the compiled decode step (one engine per batch size for every k)",
    )
    p.add_argument(
        "--prompts",
        choices=["corpus", "sft"],
        default="corpus",
        help="corpus: the bundled corpus's lines; sft: configs/tiny-sft.toml's held-out prompts",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = load_tokenizer()
    if args.model:
        model, summary = flashnext.from_pretrained(args.model), f"loaded {args.model}"
    else:
        model, summary = train(args.train_steps, args.threads, args.deep)
        if args.save:
            flashnext.save_pretrained(model, args.save)
            tok.save(args.save)
    print(summary, flush=True)
    results = {}
    sft = sft_prompts(tok) if args.prompts == "sft" else None
    for batch in args.batches:
        results[batch] = bench(model, tok, batch, args.new_tokens, args.repeats, sft, args.decode_graph)
        for k in sorted(KS, key=str):
            rate, speedup, acc, length, same = results[batch][k]
            same = "yes" if same else "no"
            spec = "" if k == 0 else f" acceptance={acc:.3f} mean_length={length:.2f} same_tokens={same}"
            print(f"batch={batch} k={k} tok/s={rate:.1f} speedup={speedup:.2f}{spec}", flush=True)
    first = results[args.batches[0]]
    auto_min = min(results[b]["auto"][1] for b in args.batches)
    deep = f" spec_auto_deep_b{args.batches[0]}={first['auto'][1]:.2f}" if args.deep else ""
    print(f"spec_speedup_batch{args.batches[0]}_k3={first[3][1]:.2f} acceptance_k3={first[3][2]:.3f} "
          f"spec_auto_min={auto_min:.2f}{deep}")  # fmt: skip


if __name__ == "__main__":
    main()
