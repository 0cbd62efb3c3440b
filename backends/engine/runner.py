"""The model runner as the engine drives it: the interface (`ModelRunnerLike`; tests give fakes), and how the
engine builds the real one from its config. Runs nothing itself.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

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
    from backends.worker.model_runner import ModelRunner

    kv_gb = None if config.kv_cache_memory_bytes is None else config.kv_cache_memory_bytes / 2**30
    return ModelRunner(model_dir, dtype=getattr(torch, config.dtype), device=config.device,
                       num_blocks=config.num_blocks, block_size=config.block_size,
                       attention_backend=config.attention_backend, kv_cache_memory_gb=kv_gb,
                       kv_shared_memory=config.kv_shared_memory,
                       keep_weights_compressed=config.keep_weights_compressed,
                       cuda_graph_max_batch=min(config.max_num_seqs, MAX_CUDA_GRAPH_BATCH) if config.cuda_graphs else 0,
                       fingerprint_weights=True)   # KV tiers and KV transfers name the weights by it
