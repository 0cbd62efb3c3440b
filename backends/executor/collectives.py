"""A worker's group of ranks over torch.distributed: gloo on the CPU, NCCL on CUDA, every collective bounded by
the group's timeout (a rank that dies or stops makes the others' collectives raise instead of waiting forever).

Ranks are laid out stage-major: rank r is tensor-parallel rank r % tp of pipeline stage r // tp, so rank 0 is
stage 0's first rank. Each stage's ranks form a tensor-parallel group (`DistributedTP`, the models'
`TensorParallel`); the stages pass activations point to point (backends/executor/pipeline.py). Both count what
they move, so that docs/parallelism.md can hold the bytes per step against the theory.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from backends.core.engine_config import EngineConfig
from backends.executor.pipeline import PipelineLinks
from backends.models.model_config import load_model_config
from backends.models.pipeline import PipelineStage

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
    """This process's rank in its stage's tensor-parallel group: the steps' collectives run on `steps`, a group
    whose timeout is the worker's `distributed_timeout_s`."""

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



@dataclass(slots=True)
class GroupPlace:
    """Where this process sits in its worker's group (the worker's `RankPlace`): its rank, its stage's
    tensor-parallel group (None with one rank per stage), its stage and the links to the next and previous
    (None with one stage)."""
    rank: int
    world_size: int
    tensor_parallel: DistributedTP | None
    stage: PipelineStage | None
    links: PipelineLinks | None

    def traffic(self) -> str:
        """What this rank moved since start, for its log."""
        reduced = CollectiveCounts() if self.tensor_parallel is None else self.tensor_parallel.counts
        sent = self.links.counts if self.links is not None else None
        return (f"{reduced.num_all_reduces} all-reduces, {reduced.all_reduce_bytes / 1e6:.1f} MB reduced; "
                f"{sent.num_sends if sent else 0} sends, {sent.send_bytes / 1e6 if sent else 0.0:.1f} MB sent")

    def agree_min(self, value: int) -> int:
        """Over the default group, whose timeout covers the ranks' slowest start (start-up only)."""
        tensor = torch.tensor([value], dtype=torch.long, device=_collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())


def master_store(world_size: int) -> dist.TCPStore:
    """Rank 0's store on a free port (its `.port`), where the other ranks meet it."""
    return dist.TCPStore(STORE_HOST, 0, world_size, is_master=True, timeout=timedelta(seconds=START_TIMEOUT_S),
                         wait_for_workers=False)


@dataclass(frozen=True, slots=True)
class GroupShape:
    """How a worker's ranks split its model."""
    tensor_parallel_size: int   # ranks per stage
    pipeline_stages: int        # stages
    num_layers: int             # the model's decoder layers, split over the stages
    expert_parallel: bool       # MoE layers: whole experts per tensor-parallel rank

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_stages


def group_shape(config: EngineConfig, model_dir: Path) -> GroupShape:
    """The split an engine's configuration asks for, of the model in `model_dir`."""
    layers = int(load_model_config(model_dir).num_hidden_layers)
    return GroupShape(config.tensor_parallel_size, config.pipeline_parallel_size, layers, config.enable_expert_parallel)


def join_group(rank: int, shape: GroupShape, store: dist.Store | None, store_port: int, device: str,
               timeout_s: float) -> GroupPlace:
    """Join the worker's group (rank 0 passes its master store; the others dial `store_port`); the steps'
    collectives and sends time out after `timeout_s`."""
    start = timedelta(seconds=START_TIMEOUT_S)
    world, size = shape.world_size, shape.tensor_parallel_size
    if store is None:
        store = dist.TCPStore(STORE_HOST, store_port, world, is_master=False, timeout=start)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=start)
    steps = timedelta(seconds=timeout_s)
    # every rank creates every group, in the same order (torch.distributed's rule), and keeps its own stage's
    stage_groups = [dist.new_group(list(range(s * size, (s + 1) * size)), timeout=steps, backend=backend)
                    for s in range(shape.pipeline_stages)]
    index = rank // size
    tp = None if size == 1 else DistributedTP(rank % size, size, stage_groups[index], shape.expert_parallel)
    if shape.pipeline_stages == 1:
        return GroupPlace(rank, world, tp, None, None)
    everyone = dist.new_group(list(range(world)), timeout=steps, backend=backend)
    stage = PipelineStage.of(shape.num_layers, index, shape.pipeline_stages)
    return GroupPlace(rank, world, tp, stage, PipelineLinks(rank, size, stage, everyone, timeout_s))


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
