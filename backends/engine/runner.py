"""The model runner as the engine drives it: the interface (`ModelRunnerLike`; tests give fakes), and how the
engine builds the real one from its config. Runs nothing itself.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from backends.core.batch import ForwardBatch
from backends.core.engine_config import EngineConfig

# Decode batches of more sequences than this run eagerly on CUDA (each captured bucket costs start time).
MAX_CUDA_GRAPH_BATCH = 256


class ModelRunnerLike(Protocol):
    config: Any                 # the HF config
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int

    def execute(self, batch: ForwardBatch) -> torch.Tensor: ...

    # Only for embedding inputs or a proposer that wants the target's hidden states (the real ModelRunner has it).
    def execute_with_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]: ...


def resolve_model_dir(config: EngineConfig) -> Path:
    from backends.worker.loader import DEFAULT_MODEL_SPEC, resolve_model

    return resolve_model(config.model_dir or DEFAULT_MODEL_SPEC)


def build_runner(config: EngineConfig, model_dir: Path) -> ModelRunnerLike:
    """One rank's runner, or, with more than one rank (tensor-parallel or pipeline), rank 0's over a group it
    spawns (backends/executor)."""
    if config.world_size > 1:
        from backends.executor.group_runner import GroupModelRunner

        return GroupModelRunner(config, model_dir)
    from backends.worker.model_runner import runner_for

    return runner_for(config, model_dir,
                      min(config.max_num_seqs, MAX_CUDA_GRAPH_BATCH) if config.cuda_graphs else 0)


@runtime_checkable
class GroupRunner(Protocol):
    """A runner over a group of ranks (backends/executor/group_runner.py): it can lose a rank, and must be closed."""

    def failure(self) -> str | None:
        """Why the group is down (a rank died or stopped answering), or None while it serves."""
        ...

    def close(self) -> None:
        """Stop the other ranks and leave the group."""
        ...
