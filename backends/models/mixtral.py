"""Mixtral: the Llama decoder (GQA, no biases) with a sparse MLP in every layer: top-k of a softmax router,
the chosen weights renormalized to sum to 1 (transformers' MixtralTopKRouter), experts `block_sparse_moe.*`."""
from __future__ import annotations

from torch import nn

from backends.models.kernels.base import LayerKernels
from backends.models.llama import LlamaForCausalLM
from backends.models.model_config import ModelConfig
from backends.models.moe import MIXTRAL_NAMES, MoEBlock, MoEConfig
from backends.models.pipeline import PipelineStage
from backends.models.tensor_parallel import TensorParallel


def mixtral_moe(config: ModelConfig, layer: int, kernels: LayerKernels, tp: TensorParallel | None) -> nn.Module:
    """Defaults as MixtralConfig's, for a config.json that leaves them out."""
    return MoEBlock(MoEConfig(
        hidden_size=config.hidden_size,
        num_experts=int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 8),
        top_k=int(getattr(config, "num_experts_per_tok", 2)),
        intermediate_size=config.intermediate_size,
        renormalize=True, names=MIXTRAL_NAMES), kernels, tp)


class MixtralForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, kernels: LayerKernels, *, tp: TensorParallel | None = None,
                 stage: PipelineStage | None = None) -> None:
        if getattr(config, "sliding_window", None):
            raise NotImplementedError("Mixtral with a sliding window is not supported")
        super().__init__(config, kernels, mlp=mixtral_moe, tp=tp, stage=stage)
