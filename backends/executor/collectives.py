"""The tensor-parallel group over torch.distributed: gloo on the CPU, NCCL on CUDA, every collective bounded by
the group's timeout (a rank that dies or stops makes the others' collectives raise instead of waiting forever).

Implements the models' `TensorParallel` (backends/models/tensor_parallel.py) and counts what it moves, so that
docs/parallelism.md can hold the bytes per step against the theory.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

STORE_HOST = "127.0.0.1"
# How long the ranks may take to start (import torch, meet, load their shards) at most.
START_TIMEOUT_S = 600.0


@dataclass(slots=True)
class CollectiveCounts:
    """What this rank's collectives moved since start (its own tensors' bytes, before any reduction)."""
    num_all_reduces: int = 0
    all_reduce_bytes: int = 0
    num_gathers: int = 0
    gather_bytes: int = 0


class DistributedTP:
    """This process's rank in its worker's group: the steps' collectives run on `steps`, a group whose timeout
    is the worker's `distributed_timeout_s`; start-up's (agree_min) on the default group, whose timeout covers
    the ranks' slowest load."""

    def __init__(self, rank: int, size: int, steps: dist.ProcessGroup, expert_parallel: bool) -> None:
        self.rank = rank
        self.size = size
        self.expert_parallel = expert_parallel
        self.steps = steps
        self.counts = CollectiveCounts()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.counts.num_all_reduces += 1
        self.counts.all_reduce_bytes += tensor.numel() * tensor.element_size()
        dist.all_reduce(tensor, group=self.steps)
        return tensor

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        local = local.contiguous()
        self.counts.num_gathers += 1
        self.counts.gather_bytes += local.numel() * local.element_size()
        if self.rank != 0:
            dist.gather(local, None, dst=0, group=self.steps)
            return local
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.gather(local, parts, dst=0, group=self.steps)
        return torch.cat(parts, dim=1)   # [rows, size * vocab_per_rank]

    def agree_min(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.long, device=_collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())


def master_store(world_size: int) -> dist.TCPStore:
    """Rank 0's store on a free port (its `.port`), where the other ranks meet it."""
    return dist.TCPStore(STORE_HOST, 0, world_size, is_master=True, timeout=timedelta(seconds=START_TIMEOUT_S),
                         wait_for_workers=False)


def join_group(rank: int, world_size: int, store: dist.Store | None, store_port: int, device: str,
               timeout_s: float, expert_parallel: bool) -> DistributedTP:
    """Join the worker's group (rank 0 passes its master store; the others dial `store_port`); the steps'
    collectives time out after `timeout_s`. `expert_parallel`: the models split whole experts over the ranks."""
    start = timedelta(seconds=START_TIMEOUT_S)
    if store is None:
        store = dist.TCPStore(STORE_HOST, store_port, world_size, is_master=False, timeout=start)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=start)
    steps = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=timeout_s), backend=backend)
    return DistributedTP(rank, world_size, steps, expert_parallel)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
