"""Model registry: HF `architectures` names → our model classes (adding a model is one file + one line)."""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import MappingProxyType

from torch import nn

_MODELS = MappingProxyType({
    "LlamaForCausalLM": "backends.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "backends.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "backends.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "backends.models.qwen3:Qwen3ForCausalLM",
})


def supported_architectures() -> tuple[str, ...]:
    return tuple(_MODELS)


def model_class(architectures: Sequence[str] | None) -> type[nn.Module]:
    """The class for the first supported name in a config's `architectures`."""
    for name in architectures or ():
        if name in _MODELS:
            module_name, class_name = _MODELS[name].split(":")
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(f"unsupported architectures {list(architectures or [])}; supported: {list(_MODELS)}")
