"""Prefix cache on vs off (issue 25): multi-turn chat, few-shot evaluation, RL groups; TTFT, hit rate, exactness.

Model: the tiny default (`configs/tiny.json`: hidden 64, 4 layers (3 GDN, 1 QSA), PLE, one MTP layer; seeded
weights), fp32, one engine with the cache and one without over the same weights, in one process; each workload runs
off, on, off, on, ... (`--repeats` pairs; the shared box's load drifts alike for both). Greedy, EOS ignored, so
every request's tokens must be the same with and without the cache (`identical`). Token ids are random in
[4, vocab) from fixed seeds (the cache sees only ids; text would add nothing).

Workloads (requests of one workload share nothing with another's: a fresh engine pair per repeat):
- chat: `--conversations` conversations (default 2) with one `--system`-token system prompt (default 2048), each
  `--turns` turns (default 8) of a ~`--user`-token user message (default 100, +-20) and a `--reply`-token answer
  (default 16); turn t's prompt resends the whole history (system, every earlier message and answer). Sequential:
  a turn is sent when the previous answer is complete (TTFT per turn).
- fewshot: one `--fewshot-prefix`-token prefix (default 1536) and `--questions` questions (default 32) of ~50
  tokens, sent one after another (an evaluation harness with one request in flight).
- rl: `--groups` prompts (default 8) of ~300 tokens (a shared 256-token instruction, then the task), each sent as
  `--samples` separate requests (default 8), all submitted at once (an RL rollout step): total time.
- unique: `--unique` prompts (default 16) of ~600 tokens sharing nothing, one after another: what the cache costs
  where it cannot help (the aim: not slower than off by more than 3%).

Per workload and mode: TTFT median and p90 (ms), total seconds, hit rate (cached / prompt tokens, the engine's
counters) next to the ideal (tokens shared with an earlier request of the workload / prompt tokens: what a
token-exact cache could skip; a block cache rounds a hit down to its block grid), the cache's bytes. Speedups are
off / on of the TTFT medians (chat, fewshot) and of the total time (rl).

Output (last line):
    ttft_speedup_chat=<x> ttft_speedup_fewshot=<x> hit_rate_chat=<x> hit_rate_fewshot=<x> identical=<yes|no>

    python benchmarks/prefix_cache.py
    python benchmarks/prefix_cache.py --repeats 1 --conversations 1 --questions 8 --groups 4   (short)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashnext.serve.engine import Engine
from flashnext.serve.loading import load_for_serving
from flashnext.serve.sampling import SamplingParams


def rand_ids(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def lengths(seed: int, mean: int, spread: int, count: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(mean - spread, mean + spread + 1, (count,), generator=g)).tolist()


def run_sequential(engine: Engine, prompts, params) -> list:
    """Each prompt after the previous finished; returns the finished requests."""
    done = []
    for prompt in prompts:
        req = engine.add_request(prompt, params)
        while not req.finished:
            engine.step()
        done.append(req)
    return done


def chat(engine: Engine, args, vocab: int) -> tuple[list, list[list[int]]]:
    """Conversations turn by turn (the next prompt needs this answer); returns requests and prompts."""
    system = rand_ids(1, args.system, vocab)
    reqs, prompts = [], []
    params = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
    for c in range(args.conversations):
        history = list(system)
        for t, n in enumerate(lengths(100 + c, args.user, 20, args.turns)):
            prompt = history + rand_ids(1000 * c + t + 2, n, vocab)
            req = run_sequential(engine, [prompt], params)[0]
            reqs.append(req)
            prompts.append(prompt)
            history = prompt + req.output_ids
    return reqs, prompts


def fewshot(engine: Engine, args, vocab: int) -> tuple[list, list[list[int]]]:
    prefix = rand_ids(3, args.fewshot_prefix, vocab)
    prompts = [prefix + rand_ids(5000 + q, n, vocab) for q, n in enumerate(lengths(4, 50, 10, args.questions))]
    params = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
    return run_sequential(engine, prompts, params), prompts


def rl(engine: Engine, args, vocab: int) -> tuple[list, list[list[int]]]:
    instruction = rand_ids(6, 256, vocab)
    tasks = [instruction + rand_ids(7000 + g, n, vocab) for g, n in enumerate(lengths(7, 44, 10, args.groups))]
    prompts = [p for p in tasks for _ in range(args.samples)]
    params = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while not all(r.finished for r in reqs):
        engine.step()
    return reqs, prompts


def unique(engine: Engine, args, vocab: int) -> tuple[list, list[list[int]]]:
    """Prompts that share nothing (the cache's cost where it cannot help: a chunk cut at a snapshot point, keys,
    block copies)."""
    prompts = [rand_ids(9000 + i, n, vocab) for i, n in enumerate(lengths(8, 600, 100, args.unique))]
    params = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
    return run_sequential(engine, prompts, params), prompts


def ideal(prompts: list[list[int]], earlier_outputs=None) -> int:
    """Tokens of each prompt shared with an earlier prompt (or an earlier prompt + its answer)."""
    seen: list[list[int]] = []
    total = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in seen:
            k = 0
            while k < min(len(p), len(q)) and p[k] == q[k]:
                k += 1
            best = max(best, k)
        total += min(best, len(p) - 1)
        seen.append(p + (earlier_outputs[i] if earlier_outputs else []))
    return total


def pct(values: list[float], q: float) -> float:
    vals = sorted(values)
    return vals[min(len(vals) - 1, int(q * len(vals)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2, help="off/on pairs per workload (default 2)")
    p.add_argument("--system", type=int, default=2048)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user", type=int, default=100)
    p.add_argument("--reply", type=int, default=16)
    p.add_argument("--conversations", type=int, default=2)
    p.add_argument("--fewshot-prefix", type=int, default=1536)
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--unique", type=int, default=16, help="prompts of the no-sharing workload (default 16)")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--max-slots", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, _, _ = load_for_serving(None)
    vocab = model.config.vocab_size
    max_len = args.system + args.turns * (args.user + 20 + args.reply) + 64
    summary, identical = {}, True
    for name, workload in (("chat", chat), ("fewshot", fewshot), ("rl", rl), ("unique", unique)):
        res = {"off": [], "on": []}
        outputs: dict[str, list] = {}
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                engine = Engine(model, None, max_slots=args.max_slots, max_model_len=max_len,
                                max_num_batched_tokens=args.max_batched_tokens, prefix_cache=mode == "on",
                                prefix_block_size=args.block_size)  # fmt: skip
                t0 = time.perf_counter()
                reqs, prompts = workload(engine, args, vocab)
                total = time.perf_counter() - t0
                ttft = [r.first_token_time - r.arrival for r in reqs]
                out = [r.output_ids for r in reqs]
                if outputs.setdefault(mode, out) != out or outputs.get("off", out) != out:
                    identical = False
                pc = engine.prefix_cache
                hit = pc.stats.hit_rate if pc is not None else 0.0
                n_prompt = sum(map(len, prompts))
                best = ideal(prompts, out if name == "chat" else None) / n_prompt
                res[mode].append((statistics.median(ttft), pct(ttft, 0.9), total, hit, best,
                                  pc.nbytes if pc is not None else 0))  # fmt: skip
                print(f"{name} {mode}: ttft median {1e3 * statistics.median(ttft):.1f} ms p90 "
                      f"{1e3 * pct(ttft, 0.9):.1f} ms, total {total:.2f} s, hit rate {hit:.3f} (ideal {best:.3f}), "
                      f"cache {0 if pc is None else pc.nbytes / 2**20:.1f} MiB, "
                      f"{len(prompts)} requests, {n_prompt} prompt tokens", flush=True)  # fmt: skip
        med = {m: [statistics.median(r[k] for r in res[m]) for k in range(6)] for m in res}
        summary[name] = {
            "ttft_speedup": med["off"][0] / med["on"][0],
            "total_speedup": med["off"][2] / med["on"][2],
            "hit_rate": med["on"][3],
            "ideal": med["on"][4],
        }
        s = summary[name]
        of_ideal = s["hit_rate"] / s["ideal"] if s["ideal"] else float("nan")
        print(f"{name}: ttft speedup {s['ttft_speedup']:.2f}x, total speedup {s['total_speedup']:.2f}x, hit rate "
              f"{s['hit_rate']:.3f} of ideal {s['ideal']:.3f} ({of_ideal:.0%})", flush=True)  # fmt: skip
    print(
        f"ttft_speedup_chat={summary['chat']['ttft_speedup']:.2f} "
        f"ttft_speedup_fewshot={summary['fewshot']['ttft_speedup']:.2f} "
        f"hit_rate_chat={summary['chat']['hit_rate']:.3f} hit_rate_fewshot={summary['fewshot']['hit_rate']:.3f} "
        f"identical={'yes' if identical else 'no'}"
    )


if __name__ == "__main__":
    main()
