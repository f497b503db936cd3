"""Parallelism applied to a plain model from outside (the model package never imports `torch.distributed`).

A trainer's use, top to bottom:
    ctx = init_distributed()                                   # torchrun env -> process group + mesh (or none)
    with torch.device("meta"):
        model = FlashNextForCausalLM(cfg)
    model = parallelize(model, ctx.mesh, ParallelConfig(ac=True, compile=False, dedup=True, seed=0))
    optimizers = shard_aware_optimizers(build_optimizer(model, optim_cfg)[0])  # Muon steps on whole matrices
    ...  # loss: sft_loss(..., num_label_tokens=<label count of the whole step, all ranks>)
    cpg = context_group(ctx.rank, ctx.world_size, cp, ratio)   # context parallelism: groups of cp ranks
    part = cpg.shard(batch)                                    # this rank's slice, targets formed on the whole stream
    model(part.input_ids, cu_seqlens=part.cu_seqlens, position_ids=part.position_ids, cp=part.shard)
    clip_grad_norm_distributed(trainable_params(optimizers), max_norm)
    save_state(dir, model, optimizers, extra)                  # extra = load_state(dir, model, optimizers)
    export_pretrained(model, out_dir)                          # official HF layout
    destroy_distributed()
"""

from flashnext.parallel.context import ContextGroup, ContextLayout, DistributedShard, context_group, plan_layout
from flashnext.parallel.dcp import load_state, save_state
from flashnext.parallel.dist import DistContext, destroy_distributed, init_distributed
from flashnext.parallel.export import export_pretrained
from flashnext.parallel.fsdp import (
    ParallelConfig,
    clip_grad_norm_distributed,
    local_row_params,
    parallelize,
    parameter_counts,
)
from flashnext.parallel.init import init_weights_local
from flashnext.parallel.optim import gather_step, shard_aware_optimizers
from flashnext.parallel.owner_embedding import OwnerRoutedEmbedding, row_ranges, swap_ngram_embeddings

__all__ = [
    "ContextGroup",
    "ContextLayout",
    "DistContext",
    "DistributedShard",
    "OwnerRoutedEmbedding",
    "ParallelConfig",
    "clip_grad_norm_distributed",
    "context_group",
    "destroy_distributed",
    "export_pretrained",
    "gather_step",
    "init_distributed",
    "init_weights_local",
    "load_state",
    "local_row_params",
    "parallelize",
    "parameter_counts",
    "plan_layout",
    "row_ranges",
    "save_state",
    "shard_aware_optimizers",
    "swap_ngram_embeddings",
]
