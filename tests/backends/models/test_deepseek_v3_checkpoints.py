"""DeepSeek-V3 from checkpoints as they ship, against transformers' forward on the same weights:
- block-scaled FP8 (e4m3 with 128x128 scales, all partial here): every matrix of the decoder quantized (attention's
  projections, the per-expert and shared experts, the dense first layer's MLP), the routers, correction biases,
  norms, embeddings and head bfloat16, the tensors dealt over three shards with model.safetensors.index.json so that
  a matrix and its scale lie in different files. The reference is transformers' model loaded from the same weights
  as the test dequantizes them (tests/backends/fp8_reference.py, independent of backends/worker/fp8_blocks.py);
- float32 shards as transformers' save_pretrained writes them (max_shard_size), read through their index.
Logits at every position within the float32 rounding measured in the same run (tests/backends/numerics.py).
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from backends.core.batch import ForwardBatch, SeqChunk
from backends.worker.loader import SHARD_INDEX_FILE
from backends.worker.model_runner import ModelRunner
from tests.backends import fp8_reference
from tests.backends.models.moe_checkpoints import float64_twin, tiny_deepseek_v3
from tests.backends.numerics import logit_tolerance
from tests.backends.test_checkpoints import FP8_QUANTIZATION, write_shards

BLOCK = (128, 128)
PROMPT = tuple(random.Random(11).randrange(97) for _ in range(21))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    folder = tmp_path_factory.mktemp("deepseek-v3-source")
    return folder, tiny_deepseek_v3(folder, 48)


def quantized(name: str, tensor: torch.Tensor) -> bool:
    """The tensors DeepSeek-V3 ships in FP8: the decoder's matrices, not its norms or routers."""
    return (tensor.ndim == 2 and name.startswith("model.layers.") and name.endswith(".weight")
            and "norm" not in name and not name.endswith(".mlp.gate.weight"))


def runs_like(folder: Path, reference: PreTrainedModel) -> tuple[torch.Tensor, float]:
    """Our runner's logits at every position of PROMPT on `folder` within the tolerance measured on `reference`;
    returns them and that tolerance."""
    reference.set_experts_implementation("eager")   # the float64 twin's path, on both
    runner = ModelRunner(folder, dtype=torch.float32, device="cpu", num_blocks=16, block_size=4)
    ours = runner.execute(ForwardBatch((SeqChunk(PROMPT, 0, (3, 0, 6, 1, 5, 9), num_logits=len(PROMPT)),)))
    with torch.inference_mode():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    tolerance = logit_tolerance(reference, float64_twin(reference), [PROMPT])
    assert (ours - expected).abs().max().item() <= tolerance
    return ours, tolerance


def test_fp8_sharded_checkpoint_runs_like_transformers_on_its_dequantized_weights(
        source: tuple[Path, PreTrainedModel], tmp_path: Path) -> None:
    folder, model = source
    tensors, dequantized = {}, {}
    with safe_open(str(folder / "model.safetensors"), "pt") as shipped:   # per-expert tensors, as checkpoints ship
        for name in shipped.keys():  # noqa: SIM118  (safe_open is no mapping)
            tensor = shipped.get_tensor(name)
            if quantized(name, tensor):
                weight, scale_inv = fp8_reference.quantize_blocks(tensor, BLOCK)
                tensors[name], tensors[f"{name}_scale_inv"] = weight, scale_inv
                dequantized[name] = fp8_reference.dequantize_blocks(weight, scale_inv, BLOCK)
            else:
                tensors[name] = tensor.bfloat16()
                dequantized[name] = tensors[name].float()
    assert sum(1 for name in dequantized if f"{name}_scale_inv" in tensors) > 50   # experts included
    plain, fp8 = tmp_path / "dequantized", tmp_path / "fp8"
    for out in (plain, fp8):
        out.mkdir()
        shutil.copy(folder / "config.json", out / "config.json")
    save_file(dequantized, str(plain / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_QUANTIZATION}))
    weight_map = write_shards(fp8, tensors, num_shards=3)
    assert any(weight_map[n] != weight_map[f"{n}_scale_inv"] for n in dequantized if f"{n}_scale_inv" in tensors)
    reference = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    ours, tolerance = runs_like(fp8, reference)
    with torch.inference_mode():   # FP8's rounding moves the logits far past float32's: the check tells them apart
        unquantized = model(torch.tensor([PROMPT])).logits[0]
    assert (ours - unquantized).abs().max().item() > 100 * tolerance


def test_sharded_checkpoint_from_save_pretrained_runs_like_transformers(
        source: tuple[Path, PreTrainedModel], tmp_path: Path) -> None:
    _, model = source
    model.save_pretrained(tmp_path, max_shard_size="200KB")   # about 1 MB of float32
    shards = set(json.loads((tmp_path / SHARD_INDEX_FILE).read_text())["weight_map"].values())
    assert len(shards) >= 3 and not (tmp_path / "model.safetensors").exists()
    runs_like(tmp_path, model)
