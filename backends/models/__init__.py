"""Model registry: HF `architectures` names → our model classes (adding a model is one file + one line)."""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the model modules are imported on first use, by name
    from backends.models.base import ModelFactory, ShardedModelFactory

# HF config `architectures` name -> "module:class" of a backends.models.base.CausalLM
_MODELS = MappingProxyType({
    "LlamaForCausalLM": "backends.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "backends.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "backends.models.mixtral:MixtralForCausalLM",
    "Qwen2ForCausalLM": "backends.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "backends.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "backends.models.qwen3_moe:Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM": "backends.models.deepseek_v3:DeepseekV3ForCausalLM",
})

# Those whose class builds one rank's shard (`tp=`; backends/models/tensor_parallel.py).
_TENSOR_PARALLEL = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
                              "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"})
# Every class builds one pipeline stage's layers (`stage=`; backends/models/pipeline.py).


def supported_architectures() -> tuple[str, ...]:
    return tuple(_MODELS)


def model_class(architectures: Sequence[str] | None) -> ModelFactory:
    """The class for the first supported name in a config's `architectures`: called with the config and the
    layer kernels, it builds a backends.models.base.CausalLM."""
    for name in architectures or ():
        if name in _MODELS:
            module_name, class_name = _MODELS[name].split(":")
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(f"unsupported architectures {list(architectures or [])}; supported: {list(_MODELS)}")


def sharded_model_class(architectures: Sequence[str] | None, *, tensor_parallel: bool) -> ShardedModelFactory:
    """`model_class`, as a class that builds one pipeline stage and, with `tensor_parallel`, one rank's shard;
    ValueError for one that cannot split over a tensor-parallel group, naming those that can."""
    for name in architectures or ():
        if name in _MODELS:
            if tensor_parallel and name not in _TENSOR_PARALLEL:
                raise ValueError(f"{name} cannot be split over a tensor-parallel group yet; it can: "
                                 f"{', '.join(sorted(_TENSOR_PARALLEL))}")
            module_name, class_name = _MODELS[name].split(":")
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(f"unsupported architectures {list(architectures or [])}; supported: {list(_MODELS)}")
