"""The GGUF conversion against transformers' own GGUF loader, tensor by tensor, plus caching and atomicity."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer

from backends.worker import loader
from backends.worker.loader import bundled_smollm2_gguf, load_weights, resolve_model


def test_converted_weights_equal_transformers_gguf_loading(smollm2_dir: Path) -> None:
    gguf = bundled_smollm2_gguf()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    expected = reference.state_dict()
    ours = load_weights(smollm2_dir)
    assert reference.config.tie_word_embeddings and "lm_head.weight" not in ours
    expected.pop("lm_head.weight")  # tied: transformers exposes the embedding under both names
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        assert ours[name].dtype == torch.float32, name
        # exact: both sides dequantize with gguf-py's `dequantize` (elementwise, no reduction) on the same bytes
        assert torch.equal(ours[name], tensor), name


def test_config_matches_gguf_metadata(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["max_position_embeddings"] == 8192 and config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_tokenizer_has_chat_template(smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


def test_second_resolve_is_cached(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The finished conversion is reused: resolving again converts nothing (what made it fast)."""
    def converts_again(src: Path, out: Path) -> None:
        raise AssertionError(f"converted {src} again")

    monkeypatch.setattr(loader, "convert_gguf", converts_again)
    assert resolve_model("smollm2") == smollm2_dir


def test_hf_folder_is_returned_as_is(smollm2_dir: Path) -> None:
    assert resolve_model(str(smollm2_dir)) == smollm2_dir


@pytest.mark.parametrize("spec", ["no-such-model", "/nonexistent/model.gguf"])
def test_unknown_spec_is_an_error(spec: str, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        resolve_model(spec, cache_dir=tmp_path)


def test_killed_conversion_leaves_no_half_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not really a gguf")
    calls: list[Path] = []

    def dies_midway(src: Path, out: Path) -> None:
        calls.append(out)
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # what a killed conversion looks like from inside

    monkeypatch.setattr(loader, "convert_gguf", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf), cache_dir=tmp_path / "cache")
    models = tmp_path / "cache" / "models"
    assert calls and list(models.iterdir()) == []  # neither the target nor the temp folder remains

    def completes(src: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "convert_gguf", completes)
    first = resolve_model(str(gguf), cache_dir=tmp_path / "cache")
    monkeypatch.setattr(loader, "convert_gguf", dies_midway)  # a finished cache is never redone
    assert resolve_model(str(gguf), cache_dir=tmp_path / "cache") == first
    assert (first / "config.json").is_file() and [p.name for p in models.iterdir()] == [first.name]


def test_prefetched_weights_are_the_weights(smollm2_dir: Path) -> None:
    loader.prefetch_weights(smollm2_dir)
    assert smollm2_dir.resolve() in loader._prefetched
    ahead = load_weights(smollm2_dir)          # takes the prefetch
    assert not loader._prefetched
    again = load_weights(smollm2_dir)          # reads anew
    assert ahead.keys() == again.keys() and ahead
    for name, tensor in again.items():
        assert ahead[name] is not tensor and torch.equal(ahead[name], tensor), name   # exact: one file read twice


def test_a_failed_prefetch_raises_from_load_weights(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    loader.prefetch_weights(tmp_path)
    assert tmp_path.resolve() in loader._prefetched
    with pytest.raises(SafetensorError, match="deserializing header"):
        load_weights(tmp_path)
