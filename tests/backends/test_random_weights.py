"""The random checkpoint that gpu_bench's Llama-3-8B-shaped model loads (backends/worker/random_weights.py):
it names and shapes every tensor exactly as a real checkpoint of the same config does (checked against the
bundled SmolLM2's own files), and a runner built on it computes finite logits."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from backends.core.batch import ForwardBatch, SeqChunk
from backends.models.model_config import load_model_config
from backends.worker.model_runner import ModelRunner
from backends.worker.random_weights import RandomCheckpoint


def test_names_and_shapes_are_a_real_checkpoints(smollm2_dir: Path) -> None:
    real: dict[str, tuple[int, ...]] = {}
    for file in smollm2_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            real |= {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118  (a safetensors handle: keys() but no iteration)
    config = load_model_config(smollm2_dir)
    random = RandomCheckpoint(config, torch.float32, torch.device("cpu"))
    real.pop("lm_head.weight", None)   # tied to the embedding in SmolLM2: a loader ignores a stored copy
    assert set(random) == set(real)
    for name in ("model.embed_tokens.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.norm.weight"):
        assert tuple(random[name].shape) == real[name], name
    assert torch.equal(random["model.layers.2.input_layernorm.weight"], torch.ones(real["model.norm.weight"]))
    weight = random["model.layers.1.mlp.up_proj.weight"]
    assert 0.015 < weight.std().item() < 0.025 and abs(weight.mean().item()) < 1e-3


def test_a_runner_on_random_weights_computes_finite_logits(tmp_path: Path) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
              "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))   # no weights on disk at all
    runner = ModelRunner(tmp_path, dtype=torch.float32, device="cpu", num_blocks=8, random_weights=True)
    logits = runner.execute(ForwardBatch((SeqChunk(tuple(range(1, 20)), 0, (0, 1)),)))
    assert logits.shape == (1, 512) and torch.isfinite(logits).all() and logits.std() > 0
