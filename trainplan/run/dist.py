"""torch.distributed set-up for torchrun: gloo on CPU, NCCL on GPU; DDP, ZeRO-1 and FSDP2."""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistEnv:
    """This process in the job. dp, dp_rank: the data-parallel degree and this rank's replica (the
    world and the rank until the layout is known, `for_layout`): the tp ranks of one replica see the
    same batches and compute the same loss, so sums over the data take one rank of each replica."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    dp: int = 0
    dp_rank: int = -1

    def __post_init__(self):
        if self.dp == 0:
            object.__setattr__(self, "dp", self.world)
        if self.dp_rank < 0:
            object.__setattr__(self, "dp_rank", self.rank)

    def for_layout(self, dims) -> DistEnv:
        """The same process with the layout's data-parallel degree and this rank's replica."""
        import dataclasses

        # the cp ranks of a replica share its batches: they are one data-parallel rank
        return dataclasses.replace(self, dp=dims.data_dp, dp_rank=dims.coords(self.rank)[1] // dims.cp)

    @property
    def replicas(self) -> int:
        """How many ranks hold each data-parallel replica's copy of a value (its tp or cp ranks)."""
        return self.world // self.dp

    def data_sum(self, t: torch.Tensor) -> torch.Tensor:
        """A per-replica value summed over the data-parallel replicas (once each, not once per tp rank)."""
        if self.world == 1:
            return t
        total = self.all_reduce_sum(t)
        return total / self.replicas if self.replicas > 1 else total

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        out = t.detach().to(self.device, torch.float64 if self.device.type == "cpu" else torch.float32).clone()
        dist.all_reduce(out)
        return out.cpu()

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        out = t.detach().to(self.device, torch.float32).clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out.cpu()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order (on every rank)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def configure_cuda_allocator(expandable_segments: bool) -> str | None:
    """Set the CUDA caching allocator's mode for this process, as the plan assumed it
    (memory.expandable_segments), unless the user set PYTORCH_CUDA_ALLOC_CONF: theirs wins, and the
    record says what ran. Read by torch when CUDA initializes, so it must run before that. Returns the
    value in force."""
    if ALLOC_CONF not in os.environ and expandable_segments:
        os.environ[ALLOC_CONF] = "expandable_segments:True"
    return os.environ.get(ALLOC_CONF)


def backend(device: torch.device, host_tensors: bool = False) -> str:
    """NCCL on CUDA, gloo on the CPU. host_tensors: some collectives run on tensors in host memory
    (FSDP2's CPUOffloadPolicy: gradient clipping's norm, full tensors of the CPU shards), which
    NCCL cannot take: gloo serves those beside NCCL."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if host_tensors else "nccl"


def init(timeout_s: int = 600, *, host_tensors: bool = False) -> DistEnv:
    """Join the torchrun job if there is one (WORLD_SIZE > 1), else a single process. A collective
    that waits `timeout_s` for a peer raises on the waiting ranks (see `peer_timeout`).
    host_tensors: see `backend`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend(device, host_tensors), timeout=timedelta(seconds=timeout_s))
    return DistEnv(rank=rank, world=world, local_rank=local, device=device)


_OWN_GROUP = False  # this process made a one-rank group (join_alone) and leaves it (leave_alone)


def join_alone(env: DistEnv, timeout_s: int = 600) -> None:
    """A process group of this one process: FSDP2 on one device (parallel.offload_optimizer) needs
    a mesh. Its store is in memory: no port, no network."""
    global _OWN_GROUP
    if env.world == 1 and not dist.is_initialized():
        dist.init_process_group(
            backend(env.device, host_tensors=True),
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=timeout_s),
        )
        _OWN_GROUP = True


def leave_alone() -> None:
    """Destroy the group join_alone made, if it did."""
    global _OWN_GROUP
    if _OWN_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWN_GROUP = False


def is_peer_timeout(e: BaseException) -> bool:
    """A collective gave up waiting for a peer (gloo and NCCL word it differently)."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("timed out" in text or "timeout" in text)


# how gloo and NCCL say that the other end of a connection is gone (its process died, its node was lost)
LOST_CONNECTION = ("connection reset by peer", "connection closed by peer", "broken pipe", "remote process exited")


def lost_peer(e: BaseException, env: DistEnv) -> str | None:
    """One line naming the peer a collective lost (gloo gives its address), or None when e is not that."""
    text = str(e)
    if env.world == 1 or not isinstance(e, RuntimeError) or not any(k in text.lower() for k in LOST_CONNECTION):
        return None
    where = re.search(r"\[([0-9A-Fa-f.:]+)\]:(\d+)", text)
    peer = f"the peer at {where[1]}:{where[2]}" if where else "a peer"
    if env.world == 2:
        peer = f"rank {1 - env.rank} ({peer})"
    reason = next(k for k in LOST_CONNECTION if k in text.lower())
    return (
        f"rank {env.rank} on node {socket.gethostname()} lost {peer}: {reason}; that rank died or its node was lost "
        "(its own log says why), so every rank stops. Relaunch every node with checkpoint.resume=auto to continue "
        "from the last valid checkpoint"
    )


def finish(env: DistEnv, code: int) -> int:
    """Leave the process group. A gloo rank can abort at interpreter exit after a clean
    destroy_process_group, so a multi-process run ends its ranks with os._exit."""
    if env.world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def wrap(model: nn.Module, dims, env: DistEnv) -> nn.Module:
    """DDP for ddp/zero1 (ZeRO-1 shards only the optimizer); FSDP2 is applied by the builder.
    dims: the layout's ParallelDims."""
    if env.world == 1 or not dims.keeps_grad_buckets:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [env.local_rank] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)


def mesh(env: DistEnv, dims=None):
    """The run's device mesh: one axis over every rank, or (dp, tp) named "dp" and "tp" under tensor
    parallelism (tp innermost, spec/parallel.py's rank order), (pp, dp) under pipeline parallelism, and
    (pp, dp, tp) under both."""
    from torch.distributed.device_mesh import init_device_mesh

    if dims is not None and dims.tp > 1 and dims.pp > 1:
        shape = (dims.pp, dims.dp, dims.tp)
        return init_device_mesh(env.device.type, shape, mesh_dim_names=("pp", "dp", "tp"))
    if dims is not None and dims.tp > 1:
        return init_device_mesh(env.device.type, (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))
    if dims is not None and dims.pp > 1:
        return init_device_mesh(env.device.type, (dims.pp, dims.dp), mesh_dim_names=("pp", "dp"))
    return init_device_mesh(env.device.type, (env.world,))


def to_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2, TP); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank must call it in order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
