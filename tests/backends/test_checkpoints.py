"""Checkpoints as they ship, read by the worker's loader and run by our model runner against transformers' forward:
sharded safetensors with an index (transformers' save_pretrained), and DeepSeek-V3's block-scaled FP8."""
from __future__ import annotations

import copy
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
from tests.backends import fp8_reference
from tests.backends.numerics import float64_copy, logit_tolerance

# Widths past one 128-wide block, so FP8 scales have partial blocks at the edges (160 = 1.25 blocks,
# 288 = 2.25, the 80 rows of k/v = 0.625).
_TINY = dict(vocab_size=97, hidden_size=160, intermediate_size=288, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
BLOCK = (128, 128)
FP8_QUANTIZATION = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "fmt": "e4m3",
                    "activation_scheme": "dynamic"}
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


@pytest.fixture(scope="module")
def fp8(tiny: LlamaForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    """A block-scaled FP8 copy of `tiny` as DeepSeek-V3 ships one (the decoder's matrices float8_e4m3fn with
    their scales, the rest bfloat16) in three shards, and transformers' model on its weights as the test
    dequantizes them."""
    tensors, dequantized = {}, {}
    for name, tensor in tiny.state_dict().items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            weight, scale_inv = fp8_reference.quantize_blocks(tensor, BLOCK)
            tensors[name], tensors[f"{name}_scale_inv"] = weight, scale_inv
            dequantized[name] = fp8_reference.dequantize_blocks(weight, scale_inv, BLOCK)
        else:
            tensors[name] = tensor.bfloat16()
            dequantized[name] = tensors[name].float()
    reference = copy.deepcopy(tiny)
    reference.load_state_dict(dequantized)
    folder = tmp_path_factory.mktemp("fp8")
    tiny.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_QUANTIZATION}))
    weight_map = write_shards(folder, tensors, num_shards=3)
    assert any(weight_map[n] != weight_map[f"{n}_scale_inv"] for n in dequantized if f"{n}_scale_inv" in tensors)
    return folder, reference.eval()


def write_shards(folder: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> dict[str, str]:
    """`tensors` dealt round the shards in name order (so a matrix and its scale land apart), with the index."""
    names = sorted(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in names[shard::num_shards]}, str(folder / file))
        weight_map.update((n, file) for n in names[shard::num_shards])
    (folder / SHARD_INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


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


def test_fp8_weights_load_dequantized(fp8: tuple[Path, LlamaForCausalLM]) -> None:
    folder, reference = fp8
    weights = load_weights(folder)
    expected = reference.state_dict()
    assert set(weights) == set(expected)   # the scales are gone
    for name, tensor in expected.items():
        assert torch.equal(weights[name].float(), tensor), name   # exact: one float32 product per element
    as_bf16 = load_weights(folder, dequantize_to=torch.bfloat16)
    name = "model.layers.1.self_attn.k_proj.weight"
    assert as_bf16[name].dtype == torch.bfloat16 and torch.equal(as_bf16[name], weights[name].bfloat16())


def test_fp8_checkpoint_runs_like_transformers_on_its_dequantized_weights(
        tiny: LlamaForCausalLM, fp8: tuple[Path, LlamaForCausalLM]) -> None:
    folder, reference = fp8
    ours, tolerance = assert_runs_like(folder, reference)
    with torch.inference_mode():   # FP8's rounding moves the logits far past float32's: the check tells them apart
        unquantized = tiny(torch.tensor([PROMPT])).logits[0]
    assert (ours - unquantized).abs().max().item() > 100 * tolerance


def test_float8_without_quantization_config_is_refused(fp8: tuple[Path, LlamaForCausalLM], tmp_path: Path) -> None:
    folder = tmp_path / "no-config"
    shutil.copytree(fp8[0], folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"float8_e4m3fn but .* has no quantization_config"):
        load_weights(folder)
