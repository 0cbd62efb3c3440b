"""Checkpoints as they ship, read by the worker's loader and run by our model runner against transformers' forward:
sharded safetensors with an index (transformers' save_pretrained)."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from backends.core.batch import ForwardBatch, SeqChunk
from backends.worker.loader import SHARD_INDEX_FILE, load_weights
from backends.worker.model_runner import ModelRunner
from tests.backends.numerics import float64_copy, logit_tolerance

_TINY = dict(vocab_size=97, hidden_size=160, intermediate_size=288, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
PROMPT = tuple(random.Random(7).randrange(_TINY["vocab_size"]) for _ in range(19))


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_TINY)).eval()
    with torch.no_grad():  # large random weights (norms included) so every term matters
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.2 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def sharded_dir(tiny: LlamaForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sharded")
    tiny.save_pretrained(folder, max_shard_size="500KB")   # 1.8 MB of float32: several shards
    return folder


def read_index(folder: Path) -> dict:
    return json.loads((folder / SHARD_INDEX_FILE).read_text())


def assert_runs_like(folder: Path, reference: LlamaForCausalLM) -> tuple[torch.Tensor, float]:
    """Our runner on `folder` gives transformers' logits at every position of PROMPT, within the float32
    rounding measured on it (tests/backends/numerics.py); returns them ([tokens, vocab]) and that tolerance."""
    runner = ModelRunner(folder, dtype=torch.float32, device="cpu", num_blocks=8, block_size=4)
    ours = runner.execute(ForwardBatch((SeqChunk(PROMPT, 0, (3, 0, 6, 1, 5), num_logits=len(PROMPT)),)))
    with torch.inference_mode():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    tolerance = logit_tolerance(reference, float64_copy(reference), [PROMPT])
    assert (ours - expected).abs().max().item() <= tolerance
    return ours, tolerance


def test_every_shard_is_read(tiny: LlamaForCausalLM, sharded_dir: Path) -> None:
    assert len(set(read_index(sharded_dir)["weight_map"].values())) >= 3
    weights = load_weights(sharded_dir)
    expected = tiny.state_dict()
    assert set(weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name   # exact: the bytes save_pretrained wrote


def test_sharded_checkpoint_runs_like_transformers(tiny: LlamaForCausalLM, sharded_dir: Path) -> None:
    assert_runs_like(sharded_dir, tiny)


def test_only_the_indexed_files_are_read(tiny: LlamaForCausalLM, sharded_dir: Path, tmp_path: Path) -> None:
    """A second copy of the weights beside the shards (Mistral's consolidated.safetensors) is left alone."""
    folder = tmp_path / "with-consolidated"
    shutil.copytree(sharded_dir, folder)
    save_file({"tok_embeddings.weight": torch.zeros(3, 2)}, str(folder / "consolidated.safetensors"))
    assert set(load_weights(folder)) == set(tiny.state_dict())


def test_a_missing_shard_is_named(sharded_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "missing"
    shutil.copytree(sharded_dir, folder)
    shard = sorted(set(read_index(folder)["weight_map"].values()))[1]
    (folder / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"in {shard}, which is not in"):
        load_weights(folder)


def test_an_index_naming_an_absent_tensor_is_refused(sharded_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "absent"
    shutil.copytree(sharded_dir, folder)
    index = read_index(folder)
    shard = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = shard
    (folder / SHARD_INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"\['model.layers.9.mlp.up_proj.weight'\] in .*{shard}, which lacks them"):
        load_weights(folder)


def test_a_tensor_the_index_does_not_name_is_refused(sharded_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "unnamed"
    shutil.copytree(sharded_dir, folder)
    index = read_index(folder)
    shard = index["weight_map"].pop("model.norm.weight")
    (folder / SHARD_INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"{shard} holds \['model.norm.weight'\], which .* does not put there"):
        load_weights(folder)


def test_files_repeating_a_tensor_are_refused(tmp_path: Path) -> None:
    """Without an index every file is read; two holding one name would otherwise leave the last one's silently."""
    save_file({"a": torch.zeros(2), "b": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    save_file({"b": torch.ones(2)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(ValueError, match=r"two\.safetensors holds b, which an earlier file"):
        load_weights(tmp_path)
