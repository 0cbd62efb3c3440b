"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before rotary (biases per `attention_bias`)."""
from __future__ import annotations

from backends.models.kernels.base import LayerKernels
from backends.models.llama import LlamaForCausalLM
from backends.models.model_config import ModelConfig
from backends.models.pipeline import PipelineStage
from backends.models.tensor_parallel import TensorParallel


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, kernels: LayerKernels, *, tp: TensorParallel | None = None,
                 stage: PipelineStage | None = None) -> None:
        super().__init__(config, kernels, qk_norm=True, tp=tp, stage=stage)
