"""Tiny random MoE checkpoints (Mixtral, Qwen3-MoE, DeepSeek-V3) built with transformers' own config classes and
`from_config`, saved as transformers saves them (safetensors, per-expert tensors): the model tests' and the
served test's weights."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, MixtralConfig, PreTrainedModel, Qwen3MoeConfig

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


# DeepSeek-V3: latent attention (kv_lora_rank 32, rope 16), YaRN, a dense first layer, then sparse layers of 8
# experts, top-2, 2 groups of which 1 is kept, a shared expert, the correction bias.
TINY_DEEPSEEK_V3 = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                        max_position_embeddings=256,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                                         "mscale": 1.0, "mscale_all_dim": 1.0})


def tiny_deepseek_v3(folder: Path, q_lora_rank: int | None, **overrides: Any) -> PreTrainedModel:
    """A tiny random DeepSeek-V3 saved to `folder` with save_pretrained; transformers' model, float32, its experts
    on the eager loop (which also runs in float64; grouped_mm does not)."""
    torch.manual_seed(0)
    config = DeepseekV3Config(**{**TINY_DEEPSEEK_V3, "q_lora_rank": q_lora_rank, **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # large random weights (norms, router and correction bias included) so every term matters
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.2 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(folder)
    model.config._experts_implementation = "eager"
    return model


def float64_twin(model: PreTrainedModel) -> torch.nn.Module:
    """numerics.float64_copy of a transformers MoE model, its experts on the eager path: the default grouped_mm
    takes no float64. (Its routers still softmax in float32, as transformers writes them.)"""
    twin = float64_copy(model)
    twin.set_experts_implementation("eager")
    return twin
