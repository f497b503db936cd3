"""Process-group set-up from the `torchrun` environment, and a no-op single-process fallback.

`torchrun --nproc-per-node N -m flashnext train ...` sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and
`MASTER_PORT` in every process; `init_distributed()` reads them, picks the backend from the device (NCCL when CUDA
is available, gloo on CPU), initialises the default process group and a 1-D device mesh over all ranks (the FSDP
and owner-routed-embedding group). Without those variables it initialises nothing and returns a world of one, so
the same trainer code runs as a plain `python -m flashnext train`.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flashnext.errors import ConfigError

__all__ = ["DistContext", "init_distributed", "destroy_distributed"]

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in the job.

    Attributes:
        rank, world_size, local_rank: from the launcher (0, 1, 0 without one).
        device: this process's device (`cuda:<local_rank>` under NCCL, `cpu` otherwise).
        mesh: 1-D `DeviceMesh` over all ranks, or None when no process group was initialised (single process).
        backend: `"nccl"`, `"gloo"`, or None without a process group.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh | None
    backend: str | None

    @property
    def is_main(self) -> bool:
        """True on rank 0: the one process that logs, writes metrics and writes shared files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group exists (collectives are needed even at world size 1)."""
        return self.mesh is not None


def _launched() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_distributed(device: str | torch.device | None = None, timeout_s: float = 600.0) -> DistContext:
    """Initialise torch.distributed from the `torchrun` environment, or return a single-process context.

    Args:
        device: `"cpu"` forces gloo on CPU even where CUDA exists; `"cuda"` requires CUDA (NCCL); None picks CUDA
            when available. Under NCCL each process uses `cuda:<LOCAL_RANK>`.
        timeout_s: collective timeout of the process group.

    Returns:
        A `DistContext`. Without `RANK`/`WORLD_SIZE` in the environment no process group is created (`mesh` is
        None, `world_size` 1); when one already exists (e.g. a test harness made it) it is reused.

    Raises:
        ConfigError: a launcher variable is missing or malformed, or CUDA was asked for and is unavailable.
    """
    want = torch.device(device) if device is not None else None
    use_cuda = torch.cuda.is_available() if want is None else want.type == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError(f"init_distributed(device={device!r}): CUDA is not available")
    if not dist.is_initialized() and not _launched():
        dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        return DistContext(0, 1, 0, dev, None, None)
    if not dist.is_initialized():
        missing = [k for k in _ENV if k not in os.environ]
        if missing:
            raise ConfigError(f"torchrun environment incomplete: missing {', '.join(missing)}")
        backend = "nccl" if use_cuda else "gloo"
        loopback = os.environ["MASTER_ADDR"] in ("127.0.0.1", "localhost")
        if backend == "gloo" and loopback and sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one-box gloo stays on loopback
        local_rank = int(os.environ["LOCAL_RANK"])
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch.device("cuda", local_rank) if use_cuda else None,
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = dist.get_backend()
    dev = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    return DistContext(rank, world, local_rank, dev, mesh, backend)


def destroy_distributed(ctx: DistContext | None = None) -> None:
    """Tear down the default process group if one exists (idempotent; a no-op in single-process runs)."""
    if dist.is_initialized():
        dist.barrier()  # nobody leaves while a peer still needs it for a final collective
        dist.destroy_process_group()
