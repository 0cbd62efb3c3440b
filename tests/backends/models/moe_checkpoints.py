"""Tiny random MoE checkpoints built with transformers' own config classes and `from_config`, saved as
transformers saves them (safetensors, per-expert tensors): the model tests' and the served test's weights."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, PreTrainedModel, Qwen3MoeConfig

from tests.backends.numerics import float64_copy

_COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, num_experts_per_tok=2)
# Mixtral: 8 experts, top-2 renormalized, every layer sparse. Qwen3-MoE: 8 experts, top-2 not renormalized
# (norm_topk_prob False, its class default), the second of 3 layers dense (mlp_only_layers) with its own width.
TINY_MOE: dict[str, tuple[type, dict[str, Any]]] = {
    "mixtral": (MixtralConfig, dict(_COMMON, intermediate_size=48, num_local_experts=8, rope_theta=10000.0)),
    "qwen3-moe": (Qwen3MoeConfig, dict(_COMMON, num_hidden_layers=3, head_dim=16, intermediate_size=80,
                                       moe_intermediate_size=40, num_experts=8, mlp_only_layers=[1])),
}


def tiny_moe(name: str, folder: Path, **overrides: Any) -> PreTrainedModel:
    """transformers' tiny model `name` in float32, eval mode, with large random weights (so every expert, norm
    and routing choice matters), saved into `folder`; returned for reference forwards."""
    config_cls, fields = TINY_MOE[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_cls(**{**fields, **overrides}), dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            noise, router = torch.randn_like(param), ".gate." in param_name
            param.copy_(1.0 + 0.2 * noise if "norm" in param_name else (0.5 if router else 0.15) * noise)
    model.save_pretrained(folder)
    return model


def float64_twin(model: PreTrainedModel) -> torch.nn.Module:
    """numerics.float64_copy of a transformers MoE model, its experts on the eager path: the default grouped_mm
    takes no float64. (Its routers still softmax in float32, as transformers writes them.)"""
    twin = float64_copy(model)
    twin.set_experts_implementation("eager")
    return twin
