"""Weight-only int8 / int4 serving on the CPU (`flashnext serve --weights ...`) against bf16: memory, speed, agreement.

Configs: `31m`, the ~31M-param config of `model_vs_reference.py` (hidden 256, 8 layers with 2 QSA, 16 experts top-4,
width 128, vocab 16384); `64e`, the same with 64 experts (the experts dominate the quantizable bytes). Random weights
from the reference's init (`build_model`, seed 0), bf16. Schemes: bf16 (as loaded), int8 (trunk and experts int8
per output channel), int4 (experts int4 g64, trunk int8). No fp8 column: the official FP8 checkpoint path is
another branch's work (issue 24 item 1); its benchmark belongs there.

Each (config, scheme) runs in its own process (`--worker`, under `OMP_WAIT_POLICY=PASSIVE` unless set, as
`flashnext serve` runs: on a shared box spinning OpenMP threads made every step ~1 s), so RSS belongs to that scheme
alone:
- rss_mb: resident bytes added by building the model and quantizing it (after `malloc_trim`), weight_mb: bytes of
  its parameters and buffers (each storage once). Embeddings and n-gram tables keep their bf16 storage in every
  scheme, so the ratio of the whole served model is above that of the quantized parts (`quant_mb`: the bytes of the
  parts a scheme quantizes, bf16 vs quantized);
- decode tok/s at batch 1 and 16: b prompts of 32 random tokens, 32 greedy new tokens, tok/s = b / median decode-only
  step; eager, and (`31m` unless `--graph-configs`) with the compiled decode step (inductor, one bucket per batch,
  compiled before timing, compile seconds printed);
- top-1 agreement and mean KL(bf16 || scheme) of the next-token distributions over 16 x 128 = 2,048 teacher-forced
  positions (random tokens, the plain forward). For scale, the bf16 process also prints fp32 vs bf16 on the same
  positions: random-init logits are flat, so agreement here is a floor for a trained model, whose margins are wider.

Output (per config and scheme, then one line):
    config=<c> weights=<s> rss_mb=<x> weight_mb=<x> quant_mb=<x> top1=<x> kl=<x> b1=<tok/s> b16=<tok/s>
        b1_graph=<tok/s> b16_graph=<tok/s> load=<1-min load>
    rss_int8_ratio=... rss_int4_ratio=... top1_int8=... top1_int4=... kl_int8=... decode_b1_int8_vs_bf16=...
        decode_b16_int8_vs_bf16=... decode_b1_int4_vs_bf16=...      (last line: the 64e config's RSS, 31m's others;
                                                                    decode ratios eager, the graph's on a line before)

    python benchmarks/quantized.py
    python benchmarks/quantized.py --configs 31m --graph-configs none
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PROMPT, NEW, TF_SEQS, TF_LEN = 32, 32, 16, 128
SCHEMES = ("bf16", "int8", "int4")


def config(name: str) -> dict:
    spec = importlib.util.spec_from_file_location("model_vs_reference", HERE / "model_vs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = dict(module.CONFIG)
    if name == "64e":
        cfg["num_experts"] = 64
    return cfg


def rss_bytes() -> int:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def decode_tok_s(model, batch: int, graph: bool, seed: int) -> tuple[float, float]:
    """(tok/s of decode-only steps, compile seconds) for `batch` greedy prompts."""
    from flashnext.serve.engine import Engine
    from flashnext.serve.sampling import SamplingParams

    engine = Engine(model, max_slots=batch, max_model_len=PROMPT + NEW + 1, decode_graph=graph,
                    decode_buckets=[batch])  # fmt: skip
    took = engine.decode_graph.warmup()[batch] if graph else 0.0
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    steps: list[float] = []
    for _ in range(2):  # the first round warms up (allocations, oneDNN primitives)
        steps.clear()
        for p in torch.randint(0, vocab, (batch, PROMPT), generator=gen).tolist():
            engine.add_request(p, params)
        while engine.has_unfinished():
            prefill = any(r.num_cached < len(r.prompt_ids) for r in engine.running) or engine.waiting
            t0 = time.perf_counter()
            engine.step()
            if not prefill:
                steps.append(time.perf_counter() - t0)
    return batch / statistics.median(steps), took


def worker(args) -> dict:
    """Measure one (config, scheme); every result is also written to `args.out` as soon as it is known (a worker
    stopped early still reports what it measured)."""
    out: dict = {}

    def note(**kv) -> None:
        out.update(kv)
        Path(args.out).write_text(json.dumps(out))

    measure(args, note)
    return out


def measure(args, note) -> None:
    from flashnext.build import build_model
    from flashnext.config import parse_config
    from flashnext.model.moe import Experts
    from flashnext.quant.apply import QuantScheme, quantize_model, weight_bytes

    torch.set_num_threads(args.threads)
    cfg = parse_config(config(args.config)).text
    scheme = QuantScheme.from_flags(args.weights)
    base = rss_bytes()
    model = build_model(cfg, seed=0, dtype=torch.bfloat16)
    quant_bf16 = sum(  # no reference to these modules may outlive this line: quantizing frees them
        t.numel() * t.element_size()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear | Experts)
        for t in m.parameters(recurse=False)
    )
    quantize_model(model, scheme)
    model.eval()
    note(rss_mb=(rss_bytes() - base) / 2**20, weight_mb=weight_bytes(model) / 2**20, quant_mb=quant_bf16 / 2**20)
    after = {id(m) for m in model.modules()}
    if scheme.enabled:
        from flashnext.quant.int_experts import QuantExperts
        from flashnext.quant.int_linear import Int8Linear

        qmods = [m for m in model.modules() if isinstance(m, Int8Linear | QuantExperts) and id(m) in after]
        seen, total = set(), 0
        for m in qmods:
            for t in m.buffers(recurse=False):
                if t is not None and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
        note(quant_mb=total / 2**20)
    ids = torch.randint(0, cfg.vocab_size, (TF_SEQS, TF_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits.float().log_softmax(-1)
    ref_path = Path(args.tmp) / f"{args.config}-bf16.pt"
    if args.weights == "bf16":
        torch.save(logits, ref_path)
        fp32 = build_model(cfg, seed=0, dtype=torch.float32).eval()
        with torch.no_grad():
            top1, kl = agreement(fp32(ids).logits.float().log_softmax(-1), logits)
        note(top1_fp32=top1, kl_fp32=kl)
        del fp32
    else:
        top1, kl = agreement(torch.load(ref_path), logits)
        note(top1=top1, kl=kl)
    del logits
    for b in (1, 16):
        note(**{f"b{b}": decode_tok_s(model, b, False, args.seed)[0], "load": os.getloadavg()[0]})
    if args.graph:
        for b in (1, 16):
            tok_s, took = decode_tok_s(model, b, True, args.seed)
            note(**{f"b{b}_graph": tok_s, f"b{b}_compile_s": took, "load": os.getloadavg()[0]})


def agreement(ref_logp: torch.Tensor, logp: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(ref || this)) of per-position log-distributions [..., V]."""
    top1 = float((ref_logp.argmax(-1) == logp.argmax(-1)).float().mean())
    kl = float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
    return top1, kl


def fmt(x) -> str:
    return "nan" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["64e", "31m"], choices=["31m", "64e"])
    p.add_argument("--graph-configs", nargs="+", default=["31m"], help="configs also timed with the decode graph")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", nargs=2, metavar=("CONFIG", "WEIGHTS"), help=argparse.SUPPRESS)
    p.add_argument("--graph", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.config, args.weights = args.worker
        worker(args)
        return 0
    res: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="flashnext-quant-bench-") as tmp:
        for c in args.configs:
            for s in SCHEMES:
                out = Path(tmp) / f"{c}-{s}.json"
                cmd = [
                    sys.executable,
                    __file__,
                    "--worker",
                    c,
                    s,
                    "--tmp",
                    tmp,
                    "--threads",
                    str(args.threads),
                    "--seed",
                    str(args.seed),
                    "--out",
                    str(out),
                ] + (["--graph"] if c in args.graph_configs else [])
                env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}  # as `flashnext serve` runs (cli/_env.py)
                run = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if run.returncode:  # report what it measured before it stopped
                    print(f"# {c} {s}: worker exited {run.returncode}: {run.stderr[-500:]}", file=sys.stderr)
                r = res[c, s] = json.loads(out.read_text()) if out.exists() else {}
                keys = ["rss_mb", "weight_mb", "quant_mb", "top1", "kl", "top1_fp32", "kl_fp32", "b1", "b16",
                        "b1_graph", "b16_graph", "b1_compile_s", "b16_compile_s", "load"]  # fmt: skip
                print(f"config={c} weights={s} " + " ".join(f"{k}={fmt(r[k])}" for k in keys if k in r), flush=True)
    mem = "64e" if ("64e", "int8") in res else args.configs[-1]
    spd = "31m" if ("31m", "int8") in res else args.configs[-1]

    def ratio(c, s, key):
        a, b = res.get((c, s), {}).get(key), res.get((c, "bf16"), {}).get(key)
        return None if a is None or b is None else a / b

    def get(c, s, key):
        return res.get((c, s), {}).get(key)

    print(
        f"# decode graph: b1_int8_vs_bf16={fmt(ratio(spd, 'int8', 'b1_graph'))} "
        f"b16_int8_vs_bf16={fmt(ratio(spd, 'int8', 'b16_graph'))} "
        f"b1_int4_vs_bf16={fmt(ratio(spd, 'int4', 'b1_graph'))} "
        f"b16_int4_vs_bf16={fmt(ratio(spd, 'int4', 'b16_graph'))}"
    )
    graph = ""  # the last line's decode ratios are the eager engine's (the graph's are the line above)
    print(
        f"rss_int8_ratio={fmt(ratio(mem, 'int8', 'rss_mb'))} rss_int4_ratio={fmt(ratio(mem, 'int4', 'rss_mb'))} "
        f"top1_int8={fmt(get(spd, 'int8', 'top1'))} top1_int4={fmt(get(spd, 'int4', 'top1'))} "
        f"kl_int8={fmt(get(spd, 'int8', 'kl'))} "
        f"decode_b1_int8_vs_bf16={fmt(ratio(spd, 'int8', 'b1' + graph))} "
        f"decode_b16_int8_vs_bf16={fmt(ratio(spd, 'int8', 'b16' + graph))} "
        f"decode_b1_int4_vs_bf16={fmt(ratio(spd, 'int4', 'b1' + graph))}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
