"""A checkpoint of random weights for a Llama-family config: HF-named tensors made when asked for.

For benchmarks of model shapes whose weights cannot be had here (a Llama-3-8B-shaped model on a GPU):
a decode step reads the same bytes whatever their values. Norm weights are ones and every matrix is
drawn from N(0, 0.02), as transformers initialises Llama, so activations stay finite.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from backends.models.model_config import ModelConfig

_INIT_STD = 0.02


class RandomCheckpoint(Mapping[str, torch.Tensor]):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        self._dtype, self._device = dtype, device
        self._generator = torch.Generator(device=device).manual_seed(seed)
        hidden, inter = int(config.hidden_size), int(config.intermediate_size)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        self._shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (int(config.vocab_size), hidden), "model.norm.weight": (hidden,)}
        if not getattr(config, "tie_word_embeddings", False):
            self._shapes["lm_head.weight"] = (int(config.vocab_size), hidden)
        for i in range(int(config.num_hidden_layers)):
            p = f"model.layers.{i}"
            self._shapes |= {
                f"{p}.self_attn.q_proj.weight": (heads * head_dim, hidden),
                f"{p}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                f"{p}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                f"{p}.self_attn.o_proj.weight": (hidden, heads * head_dim),
                f"{p}.mlp.gate_proj.weight": (inter, hidden),
                f"{p}.mlp.up_proj.weight": (inter, hidden),
                f"{p}.mlp.down_proj.weight": (hidden, inter),
                f"{p}.input_layernorm.weight": (hidden,),
                f"{p}.post_attention_layernorm.weight": (hidden,),
            }

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self._dtype, device=self._device)
        out = torch.empty(shape, dtype=self._dtype, device=self._device)
        return out.normal_(0.0, _INIT_STD, generator=self._generator)

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)
