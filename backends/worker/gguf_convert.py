"""Convert a llama-architecture GGUF file into an HF-style folder (config.json, float32 safetensors, tokenizer).

Owns dequantization, GGUF→HF tensor naming and undoing llama.cpp's rotary row permutation of
q_proj/k_proj. It writes only into the folder it is given; atomicity is the caller's job (loader.py).
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoTokenizer, LlamaConfig

# Per-layer GGUF tensor names → HF names (the "blk.N." prefix becomes "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


@dataclass(frozen=True, slots=True)
class GGUFLlamaMeta:
    num_layers: int            # llama.block_count
    hidden_size: int           # llama.embedding_length
    intermediate_size: int     # llama.feed_forward_length
    num_heads: int             # llama.attention.head_count
    num_kv_heads: int          # llama.attention.head_count_kv (defaults to num_heads)
    head_dim: int              # llama.rope.dimension_count, else hidden_size // num_heads
    rms_norm_eps: float        # llama.attention.layer_norm_rms_epsilon
    rope_theta: float          # llama.rope.freq_base (10000 when absent)
    context_length: int        # llama.context_length → max_position_embeddings
    vocab_size: int            # llama.vocab_size, else the token list's length
    bos_token_id: int | None   # tokenizer.ggml.bos_token_id
    eos_token_id: int | None   # tokenizer.ggml.eos_token_id


# Any: gguf's `contents()` is untyped (an int, float, str or list by the field's GGUF type).
def _field(reader: GGUFReader, key: str, default: object = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return len(field.data)
    return field.contents()


def read_llama_meta(reader: GGUFReader) -> GGUFLlamaMeta:
    """The model hyper-parameters from GGUF metadata; only the llama architecture is supported."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only 'llama' is supported)")
    num_heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    vocab = _field(reader, "llama.vocab_size") or _field(reader, "tokenizer.ggml.tokens")
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    return GGUFLlamaMeta(
        num_layers=int(_field(reader, "llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // num_heads)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        context_length=int(_field(reader, "llama.context_length", 2048)),
        vocab_size=int(vocab),
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
    )


def build_config(meta: GGUFLlamaMeta, tied: bool) -> LlamaConfig:
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=meta.vocab_size,
        hidden_size=meta.hidden_size,
        intermediate_size=meta.intermediate_size,
        num_hidden_layers=meta.num_layers,
        num_attention_heads=meta.num_heads,
        num_key_value_heads=meta.num_kv_heads,
        head_dim=meta.head_dim,
        rms_norm_eps=meta.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": meta.rope_theta},  # config.json as rope_theta= wrote it
        max_position_embeddings=meta.context_length,
        tie_word_embeddings=tied,
        bos_token_id=meta.bos_token_id,
        eos_token_id=meta.eos_token_id,
        dtype="float32",
    )


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head it stores rows (pairs interleaved) instead of (halves)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])  # row (h, i, j) held HF row (h, j, i)
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weight.shape))


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None for tensors the model does not use (e.g. rope_freqs)."""
    m = _LAYER_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        hf = _LAYER_NAMES.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def convert_tensors(reader: GGUFReader, meta: GGUFLlamaMeta) -> dict[str, torch.Tensor]:
    """Dequantize every used tensor to float32 under its HF name, q/k rows un-permuted."""
    out: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="converting GGUF", unit="tensor", disable=not sys.stderr.isatty()):
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if ".q_proj." in name:
            array = unpermute_rotary_rows(array, meta.num_heads)
        elif ".k_proj." in name:
            array = unpermute_rotary_rows(array, meta.num_kv_heads)
        if not array.flags.writeable:  # F32 tensors come back as read-only views of the mmapped file
            array = array.copy()
        out[name] = torch.from_numpy(np.ascontiguousarray(array))
    return out


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer (with chat template) into `out_dir`."""
    reader = GGUFReader(str(gguf_path))
    meta = read_llama_meta(reader)
    tensors = convert_tensors(reader, meta)
    tied = "lm_head.weight" not in tensors
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    build_config(meta, tied).save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)
