"""Files round trip bit for bit: adversarial bf16/fp16 tensors, plain tensors, shards, the CLI."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from backends.compression import FORMAT_KEY, CastDtype, compress_folder, is_compressed_file, load_compressed_file

REPO = Path(__file__).resolve().parents[3]


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name   # lossless codec


def _load_folder(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_compressed_file(file) if is_compressed_file(file) else load_file(str(file)))
    return out


def test_adversarial_and_plain_tensors_round_trip(tiny_model: Path, tmp_path: Path) -> None:
    stats = compress_folder(tiny_model, tmp_path / "out")
    original = _load_folder(tiny_model)
    restored = _load_folder(tmp_path / "out")
    assert restored.keys() == original.keys()
    for name, tensor in original.items():
        assert_bit_equal(restored[name], tensor, name)
    compressed = {s.name for s in stats if s.compressed}
    assert "bf16.all_patterns" in compressed and "fp16.gaussian" in compressed
    assert {"norm.weight", "fp32.matrix", "int.ids", "mask", "empty"}.isdisjoint(compressed)
    assert (tmp_path / "out" / "config.json").read_text() == (tiny_model / "config.json").read_text()
    assert (tmp_path / "out" / "tokenizer" / "vocab.txt").exists()


def test_output_is_a_valid_safetensors_file(tiny_model: Path, tmp_path: Path) -> None:
    compress_folder(tiny_model, tmp_path / "out")
    file = tmp_path / "out" / "model-00001-of-00002.safetensors"
    with safe_open(str(file), framework="pt") as f:   # the reference reader accepts it
        assert FORMAT_KEY in f.metadata()
        assert all(f.get_tensor(k).numel() >= 0 for k in f.keys())  # noqa: SIM118  (a safetensors handle: keys() but no iteration)


def test_gaussian_weights_shrink_by_a_third(tiny_model: Path, tmp_path: Path) -> None:
    stats = {s.name: s for s in compress_folder(tiny_model, tmp_path / "out")}
    for name in ("bf16.gaussian",):
        assert stats[name].stored_bytes <= 0.70 * stats[name].original_bytes, stats[name]
    single = stats["bf16.single_value"]
    assert single.stored_bytes <= 0.63 * single.original_bytes   # one exponent: 16 bits per 8 symbols + raw


def test_cast_fp32_to_bf16_and_fp16(tmp_path: Path) -> None:
    src = tmp_path / "fp32"
    src.mkdir()
    weights = {"w": torch.randn(300, 200) * 0.1, "b": torch.randn(200)}
    save_file(weights, str(src / "model.safetensors"))
    for cast in CastDtype:
        compress_folder(src, tmp_path / cast.value, cast)
        out = load_compressed_file(tmp_path / cast.value / "model.safetensors")
        for name, tensor in weights.items():
            assert_bit_equal(out[name], tensor.to(cast.torch_dtype), f"{cast}:{name}")


def test_cli_compresses_and_reports_ratios(tiny_model: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.compress", str(tiny_model), str(tmp_path / "cli")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "bf16.gaussian:" in proc.stdout + proc.stderr and "total:" in proc.stdout
    assert _load_folder(tmp_path / "cli").keys() == _load_folder(tiny_model).keys()


def test_cli_refuses_a_missing_source(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.compress", str(tmp_path / "nope"), str(tmp_path / "out")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "error:" in proc.stderr


def test_similar_tensors_share_a_dictionary(tmp_path: Path) -> None:
    """Layers with alike exponent statistics share one dictionary (one rebuild at load), losslessly."""
    from backends.compression.container import map_file
    from backends.compression.cpu_decode import book_key, read_records
    src = tmp_path / "src"
    src.mkdir()
    gen = torch.Generator().manual_seed(9)
    # values in [0.01, 0.05): the same three exponents in every layer, in slightly different proportions
    weights = {f"layers.{i}.weight":
               (torch.rand(300, 400, generator=gen) * (0.04 + 0.001 * i) + 0.01).to(torch.bfloat16)
               for i in range(4)}
    weights["wide.weight"] = (torch.rand(300, 400, generator=gen) * 20 + 10).to(torch.bfloat16)   # other exponents
    save_file(weights, str(src / "model.safetensors"))
    compress_folder(src, tmp_path / "out")
    records = read_records(map_file(tmp_path / "out" / "model.safetensors"))
    keys = {name: book_key(rec) for name, rec in records.items()}
    assert len({keys[f"layers.{i}.weight"] for i in range(4)}) == 1
    assert keys["wide.weight"] != keys["layers.0.weight"]
    restored = load_compressed_file(tmp_path / "out" / "model.safetensors")
    for name, tensor in weights.items():
        assert_bit_equal(restored[name], tensor, name)
