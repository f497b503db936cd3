"""flashnext's engine vs llama.cpp on the same weights in the same dtype (only where a llama.cpp build exists).

    LLAMA_CPP_DIR=/path/to/llama.cpp/build python benchmarks/vs_llamacpp.py [--dtype bfloat16] [--decode-graph]
        [--freeze-weights] [--decode-run K]

`LLAMA_CPP_DIR` is a llama.cpp build with the `qwen4exp` architecture (e.g. the one vendored in the
`llama-cpp-python` 0.3.36 source distribution), holding `llama-batched-bench` and `llama-simple` (in it, `bin/` or
`build/bin/`). Without it the script says so and exits 0: it is never a test or CI dependency.

Config: the 31M benchmark config of `model_vs_reference.py` cut to what llama.cpp implements (vocab 4096, one PLE
layer with `ple_embed_dim = hidden`, the sigmoid output gate; `gguf_convert.check_supported`), weights randomised
by the reference harness, saved, loaded by `flashnext.from_pretrained`, converted to GGUF by `gguf_convert.py`.

1. Agreement first: `llama-simple` generates 32 greedy tokens after a byte-token prompt; our engine does the same
   from the same ids; the texts (byte tokens as bytes, others as `<t{i}>`) must match, else the script stops (exit
   1) without timing: a wrong conversion or a llama.cpp that computes another function is not a comparison — unless
   the first difference comes after half the tokens and is a near tie (llama.cpp's token within `TIE_MARGIN` = 0.05
   of our top logit: its F16 KV cache and other sum orders round differently); an exact tie (gap 0, as bf16 logits often
   are) counts at any position, and so does a near tie from which llama.cpp's whole continuation, fed to our model,
   has each token within the margin of our top logit (`tie_gaps`; bf16 on an AVX2 CPU: a first difference at
   token 15 with a gap of 0.031). Caveat
   (llama.cpp is not exact): past the QSA budget it attends its top tokens rather than whole blocks, so beyond 128
   tokens of context outputs may drift; the prompts here stay below that.
2. Timing, alternating ours and llama.cpp, `--repeats` times per batch size: 32-token prompts and 64 new tokens
   per sequence, prefill + decode, `--threads` threads on both sides. llama.cpp: `llama-batched-bench -npp 32
   -ntg 64 -npl B` (its total time T: tok/s = B * 64 / T); ours: `Engine.generate` of B prompts. The machine's load
   average is printed beside each line: numbers taken at a load above the thread count are not results.

3. `--quant q8_0`: after the agreement check on the float weights, llama.cpp's `llama-quantize` turns the GGUF into
   Q8_0 (int8 in blocks of 32 with a scale each) and our model is quantized in memory to weight-only int8
   (`flashnext.quant`, per output channel, trunk and experts): the two quantizations differ, so outputs are not
   compared token by token; the timing is the same as 2. (`LLAMA_CPP_DIR` must also hold `llama-quantize`.)

Output:
    # agreement: 32/32 greedy tokens equal (or k/32, then a tie)
    batch=<b> ours=<tok/s> llama.cpp=<tok/s> ratio=<ours/llama.cpp> load=<1-min load> prefill_ours=<tok/s>
        prefill_llama.cpp=<tok/s> prefill_ratio=<ours/llama.cpp>      (one line per batch size)
    dtype=<dtype> prefill_b<b>=<prefill ratio> ...

The prefill figures time the 32-token prompts alone: llama.cpp's S_PP column (T_PP: its one `llama_decode` of
the B prompts) against ours as `Engine.generate(max_tokens=1)` (the prompt steps plus one greedy sample, see
`ours_prefill_seconds`), timed in the same alternating rounds.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PROMPT_LEN, NEW_TOKENS = 32, 64


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def find_tool(root: Path, name: str) -> Path | None:
    for sub in ("", "bin", "build/bin"):
        path = root / sub / name
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def variant_config() -> dict:
    """The benchmark config cut to llama.cpp's qwen4exp: vocab 4096, PLE on layer 2 only, ple_embed_dim = hidden,
    sigmoid output gate."""
    cfg = dict(_load("model_vs_reference", HERE / "model_vs_reference.py").CONFIG)
    cfg.update(vocab_size=4096, ple_layer_ids=[2], ple_embed_dim=cfg["hidden_size"], output_gate_type="sigmoid")
    return cfg


def build(dtype: torch.dtype, seed: int, out: Path):
    """(our model, GGUF path): the reference harness's randomised weights, saved and loaded by us, converted."""
    import flashnext

    gg = _load("gguf_convert", HERE / "gguf_convert.py")
    harness = _load("flashnext_reference_harness", HERE.parent / "tests" / "reference" / "conftest.py")
    ref = harness.build_reference(variant_config(), seed=seed)
    ref.save_pretrained(out / "hf")
    model = flashnext.from_pretrained(out / "hf", dtype=dtype).eval()
    metadata, tensors = gg.convert(model, dtype)
    path = out / "model.gguf"
    gg.write_gguf(path, metadata, tensors)
    print(f"# converted: {path.stat().st_size / 1e6:.1f} MB, {len(tensors)} tensors, {dtype}", flush=True)
    return model, path


def text_of(ids: list[int]) -> bytes:
    """The bytes llama.cpp prints for `ids` in the synthetic vocabulary (byte tokens, then `<t{i}>`)."""
    return b"".join(bytes([i]) if i < 256 else f"<t{i}>".encode() for i in ids)


def agreement(model, simple: Path, gguf: Path, threads: int, n: int = 32) -> tuple[int, int, bool]:
    """(equal leading tokens, n, whether the first difference is a tie): llama.cpp's greedy continuation of a byte
    prompt against ours."""
    from flashnext.serve.engine import Engine
    from flashnext.serve.sampling import SamplingParams

    prompt = "The quick brown fox jumps over the lazy dog."
    cmd = [str(simple), "-m", str(gguf), "-n", str(n), prompt]
    proc = subprocess.run(cmd, capture_output=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode != 0:
        raise RuntimeError(f"llama-simple failed ({proc.returncode}):\n{proc.stderr.decode(errors='replace')[-3000:]}")
    theirs = proc.stdout.split(prompt.encode(), 1)[-1]
    engine = Engine(model, max_slots=1, max_model_len=128)
    ours = engine.generate([list(prompt.encode())], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    ids = ours[0].token_ids
    equal = next((i for i in range(n) if not theirs.startswith(text_of(ids[: i + 1]))), n)
    if equal < n:
        print(f"# ours: {text_of(ids)!r}\n# llama.cpp: {theirs[:400]!r}", flush=True)
        gaps, allowed = tie_gaps(
            model, list(prompt.encode()) + ids[:equal], theirs[len(text_of(ids[:equal])) :], n - equal
        )
        if gaps:
            print(
                f"# first difference at token {equal}: llama.cpp's token {gaps[0]:.4f} below our top logit", flush=True
            )
            # an exact tie (llama.cpp's token shares our top logit: common in bf16, whose logits carry 8 mantissa
            # bits) is no evidence of another function wherever it comes; a near tie only after half the tokens,
            # or anywhere when we too rank every token of llama.cpp's continuation from there within the margin of
            # our top (its whole continuation is one we could have taken up to rounding)
            whole = len(gaps) == n - equal and all(g <= a for g, a in zip(gaps, allowed, strict=True))
            if whole:
                print(f"# llama.cpp's {len(gaps)} tokens from there, fed to our model: each within the margin of our "
                      f"top ({' '.join(f'{g:.3f}' for g in gaps)})", flush=True)  # fmt: skip
            if gaps[0] == 0.0 or (gaps[0] <= TIE_MARGIN and equal >= n // 2) or whole:
                print(f"# a near tie (<= {TIE_MARGIN}): the same function up to rounding; timing it", flush=True)
                return equal, n, True
    return equal, n, False


TIE_MARGIN = 0.05  # logits: llama.cpp's F16 KV cache and sum order move logits by ~1e-3 relative


def tie_gaps(model, ids: list[int], rest: bytes, most: int) -> tuple[list[float], list[float]]:
    """Our top logit minus our logit of each token llama.cpp printed next (`rest`, read back from its text: up to
    `most` tokens, fewer where a token cannot be read), each after `ids` and llama.cpp's tokens before it; and the
    margin allowed at each: `TIE_MARGIN`, plus, for a bf16/fp16 model, twice the largest change its own rounding
    makes to a logit there (our logits against those of the same weights run in fp32: two logits each move by up
    to that much, and llama.cpp's bf16 rounds its activations in other places)."""
    toks = []
    while rest and len(toks) < most:
        if rest.startswith(b"<t") and b">" in rest and rest[2 : rest.index(b">")].isdigit():
            toks.append(int(rest[2 : rest.index(b">")]))
            rest = rest[rest.index(b">") + 1 :]
        else:
            toks.append(rest[0])
            rest = rest[1:]
    if not toks:
        return [], []
    seq, rows = torch.tensor(ids + toks), slice(len(ids) - 1, -1)  # the rows predicting toks
    with torch.no_grad():
        logits = model(seq).logits[rows].float()
        wide = logits
        if next(model.parameters()).dtype != torch.float32:  # the same weights run in fp32
            wide = copy.deepcopy(model).float()(seq).logits[rows]
    noise = (logits - wide).abs().max(-1).values
    gaps = logits.max(-1).values - logits[torch.arange(len(toks)), torch.tensor(toks)]
    return gaps.tolist(), (TIE_MARGIN + 2 * noise).tolist()


def llamacpp_seconds(bench: Path, gguf: Path, batch: int, threads: int) -> tuple[float, float]:
    """(total seconds, prompt-processing seconds T_PP) of llama-batched-bench for `batch` sequences of 32 prompt +
    64 generated tokens."""
    cmd = [str(bench), "-m", str(gguf), "-c", "4096", "-b", "2048", "-ub", "512", "-npp", str(PROMPT_LEN),
           "-ntg", str(NEW_TOKENS), "-npl", str(batch), "-t", str(threads), "-tb", str(threads)]  # fmt: skip
    for _attempt in range(3):  # now and then (~1 run in 12 on a loaded box) it prints the header and no row
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-batched-bench failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        for line in proc.stdout.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 10 and cells[2] == str(batch) and re.fullmatch(r"[\d.]+", cells[8]):
                return float(cells[8]), float(cells[4])  # columns: PP TG B N_KV T_PP S_PP T_TG S_TG T S
    raise RuntimeError(
        f"no result row for B={batch} in llama-batched-bench's output (3 runs):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-2000:]}"
    )


def ours_seconds(engine, vocab: int, batch: int, seed: int) -> float:
    from flashnext.serve.sampling import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (batch, PROMPT_LEN), generator=gen).tolist()
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - start


def ours_prefill_seconds(engine, vocab: int, batch: int, seed: int) -> float:
    """Seconds of our prefill of `batch` 32-token prompts: `Engine.generate` with `max_tokens=1`, i.e. the prompt
    steps (all B prompts in one step when they fit the token budget) plus sampling the first token greedily, the
    nearest match to llama-batched-bench's T_PP (one `llama_decode` of the B prompts, logits of each last token,
    no sampling): ours carries the one greedy sample and the request bookkeeping on top."""
    from flashnext.serve.sampling import SamplingParams

    gen = torch.Generator().manual_seed(seed + 1000)
    prompts = torch.randint(0, vocab, (batch, PROMPT_LEN), generator=gen).tolist()
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - start


def quantize_both(model, gguf: Path, root: Path) -> Path:
    """Our model to weight-only int8 in place; the GGUF to Q8_0 with `llama-quantize` (its path returned)."""
    from flashnext.quant.apply import QuantScheme, quantize_model

    tool = find_tool(root, "llama-quantize")
    if tool is None:
        raise RuntimeError(f"{root} has no llama-quantize (looked in ., bin, build/bin)")
    out = gguf.with_name("model-q8_0.gguf")
    proc = subprocess.run([str(tool), str(gguf), str(out), "q8_0"], capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-quantize failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    quantize_model(model, QuantScheme.from_flags("int8"))
    print(f"# quantized: Q8_0 GGUF {out.stat().st_size / 1e6:.1f} MB; ours weight-only int8", flush=True)
    return out


def main(argv=None) -> int:
    shared = _load("model_vs_reference", HERE / "model_vs_reference.py")  # the denormals flag and its setting
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    shared.add_denormals_arg(parser)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--decode-graph", action="store_true", help="our decode steps as the compiled decode step")
    parser.add_argument(
        "--freeze-weights",
        action="store_true",
        help="with --decode-graph: the weights frozen into our graphs (`serve.frozen`), as llama.cpp's are fixed",
    )
    parser.add_argument(
        "--decode-run", type=int, default=1, metavar="K",
        help="with --decode-graph: up to K greedy decode steps per engine step (`serve.decode_runs`; default 1)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quant",
        choices=["none", "q8_0"],
        default="none",
        help="q8_0: llama.cpp's Q8_0 GGUF against our weight-only int8 (see the module doc)",
    )
    args = parser.parse_args(argv)
    root = os.environ.get("LLAMA_CPP_DIR")
    if not root:
        print("vs_llamacpp: skipped: set LLAMA_CPP_DIR to a llama.cpp build (llama-batched-bench, llama-simple)")
        return 0
    bench, simple = find_tool(Path(root), "llama-batched-bench"), find_tool(Path(root), "llama-simple")
    if bench is None or simple is None:
        print(f"vs_llamacpp: {root} has no llama-batched-bench / llama-simple (looked in ., bin, build/bin)")
        return 1
    from flashnext.serve.engine import Engine

    torch.set_num_threads(args.threads)
    shared.set_denormals(args)
    dtype = getattr(torch, args.dtype)
    prefill = {}  # batch -> our prefill tok/s over llama.cpp's S_PP
    with tempfile.TemporaryDirectory(prefix="flashnext-vs-llamacpp-") as tmp:
        model, gguf = build(dtype, args.seed, Path(tmp))
        equal, n, tie = agreement(model, simple, gguf, args.threads)
        print(f"# agreement: {equal}/{n} greedy tokens equal" + (", then a tie (above)" if tie else ""), flush=True)
        if equal < n and not tie:
            print("vs_llamacpp: llama.cpp computes another function from this file: not timing it")
            return 1
        if args.quant == "q8_0":
            gguf = quantize_both(model, gguf, Path(root))
        for b in args.batches:
            engine = Engine(model, max_slots=b, max_model_len=PROMPT_LEN + NEW_TOKENS + 1,
                            decode_graph=args.decode_graph, decode_buckets=[b],
                            freeze_weights=args.freeze_weights, decode_run=args.decode_run)  # fmt: skip
            if engine.decode_graph is not None:
                print(f"# decode graph batch={b}: compiled in {engine.decode_graph.warmup()[b]:.1f} s", flush=True)
            if engine.chunk_graph is not None and b == 1:  # a batch-1 prompt of 32 tokens: one compiled piece
                took = engine.chunk_graph.warmup([PROMPT_LEN])[PROMPT_LEN]
                print(f"# prefill graph length={PROMPT_LEN}: compiled in {took:.1f} s", flush=True)
            times, loads = {"ours": [], "llama.cpp": [], "ours_pp": [], "llama.cpp_pp": []}, []
            ours_prefill_seconds(engine, model.config.vocab_size, b, args.seed)  # first prefill of this engine
            for rep in range(args.repeats):
                loads.append(os.getloadavg()[0])
                times["ours"].append(ours_seconds(engine, model.config.vocab_size, b, args.seed + rep))
                times["ours_pp"].append(ours_prefill_seconds(engine, model.config.vocab_size, b, args.seed + rep))
                total, pp = llamacpp_seconds(bench, gguf, b, args.threads)
                times["llama.cpp"].append(total)
                times["llama.cpp_pp"].append(pp)
            t = {k: statistics.median(v) for k, v in times.items()}
            ours, theirs = b * NEW_TOKENS / t["ours"], b * NEW_TOKENS / t["llama.cpp"]
            pp_ours, pp_theirs = b * PROMPT_LEN / t["ours_pp"], b * PROMPT_LEN / t["llama.cpp_pp"]
            prefill[b] = pp_ours / pp_theirs
            print(f"batch={b} ours={ours:.1f} llama.cpp={theirs:.1f} ratio={ours / theirs:.2f} load={max(loads):.1f}"
                  f" prefill_ours={pp_ours:.0f} prefill_llama.cpp={pp_theirs:.0f} prefill_ratio={prefill[b]:.2f}",
                  flush=True)  # fmt: skip
    print(f"dtype={args.dtype} " + " ".join(f"prefill_b{b}={r:.2f}" for b, r in prefill.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
