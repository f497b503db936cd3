"""Run under `torchrun`: init_distributed from the launcher's environment, one all-reduce, report as JSON lines."""

import json
import sys

import torch
import torch.distributed as dist

from flashnext.parallel import destroy_distributed, init_distributed

if __name__ == "__main__":
    ctx = init_distributed(device="cpu")
    x = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(x)
    print(json.dumps({"rank": ctx.rank, "world": ctx.world_size, "main": ctx.is_main, "backend": ctx.backend,
                      "mesh": ctx.mesh.size() if ctx.mesh is not None else None, "sum": float(x)}))  # fmt: skip
    sys.stdout.flush()
    destroy_distributed(ctx)
