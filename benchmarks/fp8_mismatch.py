"""Sampler-learner mismatch with FP8 routed experts in the engine: the tiny RL recipe's model and task, the trainer in
fp32 (or --trainer-dtype) and the engine holding the experts in 128x128 block FP8, filled by the weight sync
(`copy_pieces` requantises the trainer's experts on arrival, as `flashnext rl` syncs them).

    python benchmarks/fp8_mismatch.py --model runs/tiny-sft/final    # the tiny recipe's warm start (SFT export)
    python benchmarks/fp8_mismatch.py --steps 3 --fp32-engine          # the same with a plain fp32 engine (baseline)

For each step it samples the recipe's rollouts (reverse task, batch 16 x group 8, temperature 1, experts recorded
and replayed by the trainer), recomputes the trainer's log-probs and reports the RL metrics' `mismatch_kl`
(`train/loss.py` `rl_loss`). No optimizer step is taken: the weights stay the warm start's, so each step is one more
sample of the same mismatch. Last line: `mismatch_kl_mean=<x> mismatch_kl_max=<y> engine=<fp8|fp32> steps=<n>`.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import flashnext
from flashnext.batch import make_segments, next_token_targets
from flashnext.model.multimodal import on_meta
from flashnext.model.quant_experts_fp8 import use_fp8_experts
from flashnext.rl.envs import ReverseEnv
from flashnext.rl.inference import LocalInference, SamplingSpec
from flashnext.rl.orchestrator import Orchestrator
from flashnext.rl.rollouts import pack_samples
from flashnext.rl.weights import local_pieces
from flashnext.serve.engine import Engine
from flashnext.serve.weight_update import copy_pieces
from flashnext.tokenizer import load_tokenizer
from flashnext.train.loss import rl_loss, token_logprobs


def engine_model(trainer: torch.nn.Module, fp8: bool) -> torch.nn.Module:
    """A second instance of the trainer's model, its experts in FP8 when `fp8`, filled by a full weight sync."""
    model = on_meta(trainer.model_config, torch.float32)
    if fp8:
        names = {n: torch.bfloat16 for n, m in model.named_modules() if n.endswith("mlp.experts") and "mtp" not in n}
        use_fp8_experts(model, names, torch.float32)
    model.to_empty(device="cpu")
    model.reset_buffers()
    model.model_config = trainer.model_config
    with torch.no_grad():
        copy_pieces(model, local_pieces(trainer, full=True))
    return model.eval()


def step_kl(trainer, samples, temperature: float) -> float:
    cfg = trainer.config
    kls, weights = [], []
    for b in pack_samples(samples, 4096, cfg.num_hidden_layers, cfg.num_experts_per_tok, None):
        with torch.no_grad():
            out = trainer(b.input_ids, cu_seqlens=b.cu_seqlens, position_ids=b.position_ids,
                          routed_experts=b.routed_experts)  # fmt: skip
        seg = make_segments(b.cu_seqlens, b.num_tokens, b.position_ids)
        targets = next_token_targets(b.labels, seg)
        mask = targets != -100
        lp_train, _ = token_logprobs(out.logits, torch.where(mask, targets, 0), temperature)
        lp_infer = next_token_targets(b.inference_logprobs, seg, 0.0)
        _, metrics = rl_loss(lp_train, lp_infer, torch.zeros_like(lp_train), mask, int(mask.sum()))
        kls.append(float(metrics["mismatch_kl"]))
        weights.append(int(mask.sum()))
    return sum(k * w for k, w in zip(kls, weights, strict=True)) / max(sum(weights), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="runs/tiny-sft/final", help="the warm-start checkpoint (tiny SFT export)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fp32-engine", action="store_true", help="baseline: the engine keeps fp32 experts")
    args = p.parse_args()
    torch.manual_seed(0)
    tok = load_tokenizer(args.model)
    trainer = flashnext.from_pretrained(args.model).eval()
    env = ReverseEnv()
    env.setup(tok, trainer.model_config)
    engine = Engine(engine_model(trainer, not args.fp32_engine), tok, 16, 256, 128)
    spec = SamplingSpec(32, 1.0, [tok.eos_token_id], routed_experts=True)
    orch = Orchestrator(env, LocalInference(engine), spec, 16, 8, seed=7, drop_zero=False)
    kls = []
    for step in range(1, args.steps + 1):
        kls.append(step_kl(trainer, orch.rollouts(step=step, policy_step=0).samples, 1.0))
        print(f"step {step}: mismatch_kl={kls[-1]:.3g}", flush=True)
    print(f"mismatch_kl_mean={statistics.mean(kls):.4g} mismatch_kl_max={max(kls):.4g} "
          f"engine={'fp32' if args.fp32_engine else 'fp8'} steps={args.steps}")  # fmt: skip


if __name__ == "__main__":
    main()
