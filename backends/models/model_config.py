"""A model folder's config.json, read without transformers' per-model config classes when it can be.

Importing one of those classes is the slowest step of a worker start: transformers 5.23's
configuration_llama pulls in its kernel hub, its model-loading machinery and torch.distributed.tensor,
1.5 s on the 2-core CI machine, to read a dozen numbers. When config.json states every field the models
read whose default differs between config classes, its plain values are used as they are (the models
read the optional ones with the same defaults as the classes); otherwise AutoConfig reads it, defaults
and all.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

# Fields the models read with no default of their own, or whose default differs between the config
# classes (num_key_value_heads: Llama's is num_attention_heads, Mistral's 8, Qwen's 32;
# tie_word_embeddings: the base class's is True, the models' classes' False). The rope theta must be
# stated too, at the top level or in rope_parameters.
REQUIRED_FIELDS = ("architectures", "hidden_size", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "num_hidden_layers", "vocab_size", "rms_norm_eps",
                   "max_position_embeddings", "tie_word_embeddings")
# Architectures whose config class derives a missing head_dim as hidden_size // num_attention_heads, as
# the models do; others (Qwen3: 128) must state it.
HEAD_DIM_DERIVED = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM"})


class ModelConfig(Protocol):
    """The fields the models read without a default; the optional ones (num_key_value_heads, head_dim,
    attention_bias, mlp_bias, tie_word_embeddings, rope_*) through getattr. Both what load_model_config
    returns, a SimpleNamespace of config.json and transformers' config object, carry them as attributes."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int


def read_config_json(model_dir: Path) -> dict[str, Any]:
    with open(Path(model_dir) / "config.json", encoding="utf-8") as file:
        return json.load(file)


def states_everything(data: dict[str, Any]) -> bool:
    rope = data.get("rope_parameters")
    has_theta = "rope_theta" in data or (isinstance(rope, dict) and "rope_theta" in rope)
    architectures = data.get("architectures") or ()
    has_head_dim = "head_dim" in data or all(name in HEAD_DIM_DERIVED for name in architectures)
    return all(field in data for field in REQUIRED_FIELDS) and has_theta and has_head_dim


def load_model_config(model_dir: Path) -> ModelConfig:
    """The config's fields as attributes: a plain namespace when config.json states them all, else
    transformers' config object."""
    data = read_config_json(model_dir)
    if states_everything(data):
        return SimpleNamespace(**data)
    from transformers import AutoConfig  # the slow import, only for configs that rely on class defaults

    return AutoConfig.from_pretrained(str(model_dir))
