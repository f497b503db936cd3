"""Per-rank bodies of the context-parallel tests (spawned in one gloo group per world size) and their references.

`run_rank(rank, world, root)` runs every check of a world size in one group (spawning costs seconds, the checks
milliseconds) and returns what the tests compare:
- each boundary exchange alone against the unsplit op (GDN affine pairs, PLE conv halo, n-gram context, QSA
  gathered blocks and keys/values), forward and backward, as max errors computed on the rank itself;
- the model on packed batches split over the whole world as one CP group: logits, loss, every parameter gradient
  and the QSA selection, gathered on rank 0, against `reference_model_run` (one process, no process group);
- the chunked LM head and the MTP head's loss under CP (labels shifted across the slice's edges by the model):
  loss sums and gradients against `reference_heads_run`;
- training: `Trainer` with `parallel.cp = CP_TRAIN` (the world as `world / CP_TRAIN` groups, FSDP2 over all ranks),
  three steps of Muon/ExpertMuon/AdamW with the RL loss and the MTP loss, against `reference_trainer_run` (one
  process).
"""

from __future__ import annotations

import functools
import json
from importlib import resources

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from flashnext import save_pretrained
from flashnext.batch import PackedBatch, make_segments
from flashnext.config import TextConfig, parse_config
from flashnext.model.text import FlashNextForCausalLM
from flashnext.parallel import OwnerRoutedEmbedding, init_distributed
from flashnext.parallel.context import DistributedShard, plan_layout
from flashnext.train.config import load_run_config
from flashnext.train.loss import count_label_tokens, sft_loss, shifted_sft_loss
from flashnext.train.trainer import Trainer

SEED, CP_TRAIN = 0, 2


@functools.cache
def model_config() -> TextConfig:
    """The embedded tiny config cut to 3 layers: GDN with PLE, QSA, GDN; 4 experts; vocab 256."""
    raw = json.loads(resources.files("flashnext").joinpath("configs/tiny.json").read_text())
    raw.update(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"])
    raw.update(ple_layer_ids=[1], num_experts=4, vocab_size=256)
    return parse_config(raw).text


def build(seed: int = SEED) -> FlashNextForCausalLM:
    """`init_weights(seed)` plus a seeded perturbation of every float parameter: the zero-initialised PLE conv and
    the identity norms would hide a wrong halo or a wrong boundary state. GDN decays are set moderate
    (A = exp(A_log) in [0.05, 0.37]): with the init's A up to 16 the state fades within a token, which would hide a
    wrong incoming state, and the decay gradients are then so small that fp32 rounding alone moves them by 1e-2
    (one process, chunk size 16 vs 64)."""
    model = FlashNextForCausalLM(model_config())
    model.init_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-3, -1, generator=g))
            else:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def batch(name: str) -> PackedBatch:
    """Packed batches: `packed` has one sequence spanning every rank (at world 2 and 4), sequences shorter than a
    QSA block, sequences ending inside a rank and EOS ids near the rank edges; `short` has slices shorter than
    the PLE conv halo at world 4."""
    lengths = {"packed": [3, 61, 2, 7], "short": [5, 2, 6]}[name]
    g = torch.Generator().manual_seed(len(name))
    ids = [torch.randint(4, 256, (n,), generator=g) for n in lengths]
    eos = model_config().eos_id
    for x in ids:
        x[torch.randint(0, 2, (len(x),), generator=g).bool() & (torch.rand(len(x), generator=g) < 0.15)] = eos
    labels = [x.clone() for x in ids]
    for lab in labels:
        lab[:2] = -100
    return PackedBatch.from_sequences([x.tolist() for x in ids], [lab.tolist() for lab in labels])


def _selection_hook(store: list):
    def hook(module, args, out):
        store.append((out[0].clone(), out[1].clone()))

    return hook


def selections(sel: torch.Tensor, ok: torch.Tensor, row_token: torch.Tensor | None = None) -> list[list[int]]:
    """Sorted selected token indices of every query (rows mapped to input tokens by `row_token` if given)."""
    out = []
    for s, k in zip(sel.tolist(), ok.tolist(), strict=True):
        picked = [x for x, o in zip(s, k, strict=True) if o]
        out.append(sorted(int(row_token[x]) if row_token is not None else x for x in picked))
    return out


@functools.cache
def reference_model_run(name: str) -> dict:
    """One process, no process group: logits, loss, gradients and the QSA selection of every query."""
    model = build()
    b = batch(name)
    store: list = []
    model.model.layers[1].self_attn.indexer.register_forward_hook(_selection_hook(store))
    logits = model(b.input_ids, cu_seqlens=b.cu_seqlens).logits
    count = count_label_tokens(b.labels, b.cu_seqlens)
    loss = sft_loss(logits, b.labels, b.cu_seqlens, count)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits.detach(), "loss": float(loss), "grads": grads, "selection": selections(*store[0])}


def model_case(rank: int, world: int, name: str) -> dict:
    """The world as one CP group on batch `name`: rank 0 returns the gathered logits, loss, gradients, selection."""
    model = build()
    b = batch(name)
    layout = plan_layout(b.lengths, world, model_config().indexer_compress_ratio)
    lo, hi = layout.rows(rank)
    shard = DistributedShard(layout, rank)
    store: list = []
    model.model.layers[1].self_attn.indexer.register_forward_hook(_selection_hook(store))
    ids, pos = layout.pad(b.input_ids)[lo:hi], layout.pad(b.position_ids)[lo:hi]
    cu = torch.tensor(layout.local_cu(rank), dtype=torch.int32)
    logits = model(ids, cu_seqlens=cu, position_ids=pos, cp=shard).logits
    targets = layout.targets(b.labels, b.cu_seqlens)[lo:hi]
    loss = shifted_sft_loss(logits, targets, count_label_tokens(b.labels, b.cu_seqlens))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        dist.all_reduce(g)
    total = loss.detach().clone()
    dist.all_reduce(total)
    all_logits = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(all_logits, logits.detach().contiguous())
    sel = [None] * world
    dist.all_gather_object(sel, (store[0][0] + 0, store[0][1]))
    if rank != 0:
        return {}
    row_token = torch.full((layout.num_rows,), -1, dtype=torch.long)
    row_token[layout.token_rows] = torch.arange(b.num_tokens)
    rows = torch.cat([s for s, _ in sel]), torch.cat([o for _, o in sel])
    picked = selections(*rows, row_token=row_token)
    return {
        "logits": layout.unpad(torch.cat(all_logits)),
        "loss": float(total),
        "grads": grads,
        "selection": [picked[int(r)] for r in layout.token_rows],
    }


MTP_WEIGHT = 0.3


def _heads_loss(model, ids, labels, **kwargs):
    """(the chunked heads' loss sums, their weighted total) of a forward with labels and the MTP head."""
    out = model(ids, labels=labels, return_logits=False, return_mtp=True, **kwargs)
    return {"loss_sum": float(out.loss_sum), "mtp_loss_sum": float(out.mtp_loss_sum)}, (
        out.loss_sum + MTP_WEIGHT * out.mtp_loss_sum
    )


@functools.cache
def reference_heads_run(name: str) -> dict:
    """One process: the chunked LM head's and the MTP head's loss sums over batch `name`, and the gradients of
    their weighted sum."""
    model, b = build(), batch(name)
    sums, loss = _heads_loss(model, b.input_ids, b.labels, cu_seqlens=b.cu_seqlens)
    loss.backward()
    return {**sums, "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def heads_case(rank: int, world: int, name: str) -> dict:
    """`reference_heads_run` with the world as one CP group: each rank passes its slice's own labels (the model
    shifts them, and the MTP head's next tokens, across the slice's edge); sums and gradients all-reduced."""
    model, b = build(), batch(name)
    layout = plan_layout(b.lengths, world, model_config().indexer_compress_ratio)
    lo, hi = layout.rows(rank)
    ids, pos, labels = (layout.pad(x, fill)[lo:hi] for x, fill in
                        ((b.input_ids, 0), (b.position_ids, 0), (b.labels, -100)))  # fmt: skip
    cu = torch.tensor(layout.local_cu(rank), dtype=torch.int32)
    sums, loss = _heads_loss(model, ids, labels, cu_seqlens=cu, position_ids=pos, cp=DistributedShard(layout, rank))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        dist.all_reduce(g)
    totals = torch.tensor([sums["loss_sum"], sums["mtp_loss_sum"]], dtype=torch.float64)
    dist.all_reduce(totals)
    return {"loss_sum": float(totals[0]), "mtp_loss_sum": float(totals[1]), "grads": grads} if rank == 0 else {}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def op_cases(rank: int, world: int) -> dict[str, float]:
    """Each exchange alone against the unsplit op on the same rank: max relative errors (and exact-match flags)."""
    from flashnext.model.ngram import NGramEmbedding
    from flashnext.ops import qsa
    from flashnext.ops.conv import causal_conv1d_varlen
    from flashnext.ops.deltanet import gated_delta_rule, gated_delta_rule_affine

    lengths = [6, 37, 1, 11]
    layout = plan_layout(lengths, world, 4)
    lo, hi = layout.rows(rank)
    shard = DistributedShard(layout, rank)
    R = layout.num_rows
    gseg = layout.global_segments()
    cu_local = torch.tensor(layout.local_cu(rank), dtype=torch.int32)
    lseg = make_segments(cu_local, hi - lo)
    g = torch.Generator().manual_seed(7)
    out: dict[str, float] = {}

    def both(fn_full, fn_local, *inputs):
        """Unsplit vs split outputs and input gradients under one random cotangent."""
        full_in = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
        local_in = [x[lo:hi].clone().requires_grad_(x.is_floating_point()) for x in inputs]
        y_full, y_local = fn_full(*full_in), fn_local(*local_in)
        cot = torch.randn(y_full.shape, generator=torch.Generator().manual_seed(1))
        (y_full * cot).sum().backward()
        (y_local * cot[lo:hi]).sum().backward()
        errs = [_rel(y_local, y_full[lo:hi])]
        errs += [_rel(a.grad, b.grad[lo:hi]) for a, b in zip(local_in, full_in, strict=True) if a.grad is not None]
        return max(errs)

    # GDN: the chunked delta rule continued across ranks by affine pairs.
    H, K, V = 2, 8, 4
    q, k = torch.randn(R, H, K, generator=g), torch.randn(R, H, K, generator=g)
    v, gate = torch.randn(R, H, V, generator=g), -torch.rand(R, H, generator=g)
    beta = torch.rand(R, H, generator=g)

    def gdn_local(q, k, v, gate, beta):
        o0, resp, A, U = gated_delta_rule_affine(q, k, v, gate, beta, lseg)
        return o0 + torch.einsum("thk,hkv->thv", resp, shard.incoming_state(A, U))

    out["gdn"] = both(lambda *x: gated_delta_rule(*x, gseg)[0], gdn_local, q, k, v, gate, beta)

    # Dilated conv with its left halo (PLE: width 9 > the slice at world 4), then the GDN short conv's.
    for name, C, taps, dil in (("ple_conv", 6, 4, 3), ("gdn_conv", 5, 4, 1)):
        x, w = torch.randn(R, C, generator=g), torch.randn(C, taps, generator=g)
        W = (taps - 1) * dil

        def conv_local(x, w=w, dil=dil, W=W):
            return causal_conv1d_varlen(x, lseg, w, dil, initial_window=shard.left_halo(x, W))[0]

        out[name] = both(lambda x, w=w, dil=dil: causal_conv1d_varlen(x, gseg, w, dil)[0], conv_local, x)

    # n-gram hash with the ids before the slice as context (EOS-heavy ids: the context stops at an EOS).
    emb = NGramEmbedding(model_config(), 0)
    ids = torch.randint(0, 6, (R,), generator=g)
    ids[ids == 5] = emb.eos_id
    full_rows, _ = emb.hash_ids(ids, gseg)
    local_rows, _ = emb.hash_ids(ids[lo:hi], lseg, shard.left_halo(ids[lo:hi], emb.ngram_size - 1, emb.eos_id))
    out["ngram_equal"] = float(torch.equal(local_rows, full_rows[lo:hi]))

    # QSA: local queries against every rank's blocks (exact selection) and keys/values (with gradient).
    Hi, Di, c, topk = 2, 8, 4, 2
    idx_q, raw = torch.randn(R, Hi, Di, generator=g), torch.randn(R, Di, generator=g)
    starts_full = qsa.complete_blocks(gseg, c)
    keys_full = qsa.pool_blocks(raw[qsa.block_rows(starts_full, c)])
    sel_full, ok_full = qsa.select_tokens(idx_q, keys_full, starts_full, gseg, c, topk)
    starts_local = qsa.complete_blocks(lseg, c)
    keys = shard.gather_blocks(qsa.pool_blocks(raw[lo:hi][qsa.block_rows(starts_local, c)]))
    sel, ok = qsa.select_tokens(idx_q[lo:hi], keys, starts_full, gseg, c, topk, q_offset=lo)
    out["qsa_select_equal"] = float(selections(sel, ok) == selections(sel_full[lo:hi], ok_full[lo:hi]))
    qa, ka, va = (torch.randn(R, 2, 8, generator=g) for _ in range(3))

    def attn_full(q, k, v):
        return qsa.sparse_attention(q, k, v, sel_full, ok_full, 0.3, gseg, c)

    def attn_local(q, k, v):
        k, v = shard.gather(torch.cat([k, v], dim=-1)).split(8, dim=-1)
        return qsa.sparse_attention(q, k, v, sel, ok, 0.3, gseg, c)

    out["qsa_attention"] = both(attn_full, attn_local, qa, ka, va)
    return out


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter as the full tensor (FSDP gathers; owner-routed tables' rows all-gathered)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, OwnerRoutedEmbedding)}
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            out[name] = p.full_tensor().detach().clone()
        elif id(p) in tables:
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, p.detach().clone())
            out[name] = torch.cat(parts)
        else:
            out[name] = p.detach().clone()
    return out


def write_rl_data(path: str, n: int = 24) -> str:
    """Pre-tokenized RL records (loss on the second half, the engine's log-probs, an advantage), 20-70 tokens:
    micro-batches of up to 96 tokens whose sequences cross the CP ranks' edges."""
    g = torch.Generator().manual_seed(5)
    with open(path, "w") as f:
        for _ in range(n):
            length = int(torch.randint(20, 70, (1,), generator=g))
            ids = torch.randint(3, 256, (length,), generator=g).tolist()
            half = length // 2
            record = {
                "input_ids": ids,
                "labels": [-100] * half + ids[half:],
                "inference_logprobs": (-torch.rand(length, generator=g) * 4 - 1).tolist(),
                "advantages": float(torch.randn((), generator=g)),
            }
            f.write(json.dumps(record) + "\n")
    return path


def write_checkpoint(path: str) -> str:
    """`build()` saved in the official layout: the trainers start from it (moderate GDN decays, see `build`; from
    the init's, Muon turns rounding-level decay gradients into full-size updates of `in_proj_a`)."""
    save_pretrained(build(), path)
    return path


def trainer_overrides(data: str, out_dir: str, micro_batches: int, cp: int, model: str) -> list[str]:
    """The run both sides train: 3 steps of Muon/ExpertMuon/AdamW with the RL loss and the MTP head's loss from the
    checkpoint `model`."""
    return [
        f"--model.path={model}",
        f"--data.path={data}",
        "--data.token_budget=96",
        f"--data.micro_batches={micro_batches}",
        "--train.loss=rl",
        f"--train.mtp_loss_weight={MTP_WEIGHT}",
        "--train.steps=3",
        "--train.activation_checkpointing=true",
        "--optim.warmup_steps=1",
        "--log.progress=false",
        "--log.peak_flops=1e9",
        "--checkpoint.export=false",
        f"--parallel.cp={cp}",
        f"--out_dir={out_dir}",
    ]


def trainer_case(rank: int, world: int, root: str) -> dict:
    """`Trainer` with `parallel.cp = CP_TRAIN` (FSDP2 over the world): its metrics, and rank 0's final weights."""
    data, model = f"{root}/rl.jsonl", f"{root}/start"
    if rank == 0:
        write_rl_data(data)
        write_checkpoint(model)
    dist.barrier()
    cfg = load_run_config(None, trainer_overrides(data, f"{root}/cp_ws{world}", 1, CP_TRAIN, model))
    trainer = Trainer(cfg, init_distributed())
    history = trainer.run()
    params = full_params(trainer.model)
    return {"history": history, "params": params if rank == 0 else None}


def reference_trainer_run(root: str, world: int) -> dict:
    """One process, no process group, taking the same global batch (one micro-batch per CP group)."""
    data, model = write_rl_data(f"{root}/rl_ref.jsonl"), write_checkpoint(f"{root}/start_ref")
    cfg = load_run_config(None, trainer_overrides(data, f"{root}/one_ws{world}", world // CP_TRAIN, 1, model))
    trainer = Trainer(cfg)
    return {"history": trainer.run(), "params": full_params(trainer.model)}


def run_rank(rank: int, world: int, root: str) -> dict:
    """Every check of one world size (see the module doc)."""
    return {
        "ops": op_cases(rank, world),
        "models": {name: model_case(rank, world, name) for name in ("packed", "short")},
        "heads": {name: heads_case(rank, world, name) for name in ("packed", "short")},
        "trainer": trainer_case(rank, world, root),
    }
