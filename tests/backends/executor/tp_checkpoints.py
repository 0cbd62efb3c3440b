"""Tiny random Llama-family and MoE checkpoints over SmolLM2's vocabulary (transformers' config classes,
from_config, save_pretrained; SmolLM2's tokenizer beside them) for the tensor-parallel tests."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from tests.backends.models.moe_checkpoints import tiny_deepseek_v3, tiny_moe
from tests.backends.references import smollm2_vocabulary

# 4 query heads over 2 KV heads, MLP 96 wide: TP=2 splits each in two (TP=4 would replicate the KV heads).
# Biases on every projection, so that the column-parallel ones are split and the row-parallel ones added once.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, attention_bias=True, mlp_bias=True)


def tiny_llama(folder: Path, **overrides: Any) -> PreTrainedModel:
    """transformers' tiny Llama in float32 with large random weights (every term matters), saved into `folder`
    with SmolLM2's tokenizer; returned for reference forwards."""
    tokenizer, eos = smollm2_vocabulary()
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY_LLAMA, "vocab_size": len(tokenizer), "eos_token_id": list(eos), **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.2 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
    model.save_pretrained(folder)
    _copy_tokenizer(Path(tokenizer.name_or_path), folder)
    return model


# DeepSeek-V3's q through the low-rank q_a / q_b (q_lora_rank 48, as the model tests'), or one q_proj
DEEPSEEK_V3_Q_LORA = {"deepseek-v3": 48, "deepseek-v3-q-full": None}


def tiny_moe_checkpoint(family: str, folder: Path) -> PreTrainedModel:
    """The MoE tests' tiny `family` ("mixtral", "qwen3-moe": 8 experts, top-2; "deepseek-v3", "deepseek-v3-q-full":
    latent attention, a dense first layer, then 8 experts, top-2, and a shared expert; transformers' config class
    and from_config, per-expert tensors as save_pretrained writes them) over SmolLM2's vocabulary, its tokenizer
    beside it."""
    tokenizer, eos = smollm2_vocabulary()
    vocab = dict(vocab_size=len(tokenizer), eos_token_id=list(eos))
    model = (tiny_deepseek_v3(folder, DEEPSEEK_V3_Q_LORA[family], **vocab) if family in DEEPSEEK_V3_Q_LORA
             else tiny_moe(family, folder, **vocab))
    _copy_tokenizer(Path(tokenizer.name_or_path), folder)
    return model


def _copy_tokenizer(source: Path, folder: Path) -> None:
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / file, folder / file)
