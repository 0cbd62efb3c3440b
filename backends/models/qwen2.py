"""Qwen2: the Llama decoder with biases on q/k/v (none on o_proj)."""
from __future__ import annotations

from backends.models.kernels.base import LayerKernels
from backends.models.llama import LlamaForCausalLM
from backends.models.model_config import ModelConfig
from backends.models.pipeline import PipelineStage
from backends.models.tensor_parallel import TensorParallel


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, kernels: LayerKernels, *, tp: TensorParallel | None = None,
                 stage: PipelineStage | None = None) -> None:
        super().__init__(config, kernels, qkv_bias=True, o_bias=False, tp=tp, stage=stage)
