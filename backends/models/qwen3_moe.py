"""Qwen3-MoE: the Qwen3 decoder (per-head q/k RMSNorm) whose layers are sparse MLPs (softmax top-k router,
renormalized when `norm_topk_prob`), except those in `mlp_only_layers` or off the `decoder_sparse_step`
stride, which keep the dense MLP of `intermediate_size`."""
from __future__ import annotations

from torch import nn

from backends.models.kernels.base import LayerKernels
from backends.models.llama import LlamaForCausalLM, LlamaMLP
from backends.models.model_config import ModelConfig
from backends.models.moe import QWEN_NAMES, MoEBlock, MoEConfig
from backends.models.pipeline import PipelineStage
from backends.models.tensor_parallel import TensorParallel


def qwen3_moe_mlp(config: ModelConfig, layer: int, kernels: LayerKernels, tp: TensorParallel | None) -> nn.Module:
    """Defaults as Qwen3MoeConfig's, for a config.json that leaves them out."""
    num_experts = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 128)
    dense_layers = getattr(config, "mlp_only_layers", None) or ()
    if layer in dense_layers or (layer + 1) % int(getattr(config, "decoder_sparse_step", 1)) != 0:
        return LlamaMLP(config, kernels, tp)
    return MoEBlock(MoEConfig(
        hidden_size=config.hidden_size, num_experts=num_experts,
        top_k=int(getattr(config, "num_experts_per_tok", 8)),
        intermediate_size=int(getattr(config, "moe_intermediate_size", 768)),
        renormalize=bool(getattr(config, "norm_topk_prob", False)), names=QWEN_NAMES), kernels, tp)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, kernels: LayerKernels, *, tp: TensorParallel | None = None,
                 stage: PipelineStage | None = None) -> None:
        if getattr(config, "use_sliding_window", False):
            raise NotImplementedError("Qwen3-MoE with a sliding window is not supported")
        super().__init__(config, kernels, qk_norm=True, mlp=qwen3_moe_mlp, tp=tp, stage=stage)
