"""The worker reads config.json and picks its tokenizer without transformers' per-model config classes
(whose import cost 1.5 s of every start): checked against what AutoConfig and AutoTokenizer give."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from backends.models import model_class
from backends.models.kernels.registry import select_kernels
from backends.models.model_config import load_model_config
from backends.server.tokenization import PromptTokenizer
from tests.backends.test_model_forward import _TINY, TINY_MODELS


def model_shape(config: object) -> dict[str, object]:
    """Everything about our model that the config decides: parameter shapes, heads, rope, ties."""
    with torch.device("meta"):
        model = model_class(config.architectures)(config, select_kernels("cpu"))
    attn = model.layers[0].self_attn
    return {
        "params": {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)},
        "heads": (attn.num_heads, attn.num_kv_heads, attn.head_dim),
        "eps": (model.norm.eps, attn.q_norm.eps if attn.q_norm is not None else None),
        "inv_freq": model.inv_freq.tolist(),
        "tied": model.lm_head.weight is model.embed_tokens.weight,
        "limits": (config.max_position_embeddings, config.vocab_size),
    }


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_plain_config_builds_the_model_autoconfig_builds(name: str, tmp_path: Path) -> None:
    config_cls, _, extra = TINY_MODELS[name]
    config_cls(**_TINY, **extra, architectures=[config_cls.__name__.replace("Config", "ForCausalLM")]
               ).save_pretrained(tmp_path)
    ours = load_model_config(tmp_path)
    assert isinstance(ours, SimpleNamespace)   # the fast path: config.json states everything
    assert model_shape(ours) == model_shape(AutoConfig.from_pretrained(str(tmp_path)))


def test_smollm2_config_is_read_plainly(smollm2_dir: Path) -> None:
    ours = load_model_config(smollm2_dir)
    assert isinstance(ours, SimpleNamespace)
    assert model_shape(ours) == model_shape(AutoConfig.from_pretrained(str(smollm2_dir)))


@pytest.mark.parametrize("missing", ["head_dim", "num_key_value_heads", "tie_word_embeddings", "rope_parameters"])
def test_a_config_relying_on_class_defaults_goes_through_autoconfig(missing: str, tmp_path: Path) -> None:
    """Qwen3's class defaults differ from what the models would assume (head_dim 128, not
    hidden / heads; 32 KV heads): a config.json without them must get the class's values."""
    config_cls, _, extra = TINY_MODELS["qwen3-qknorm"]
    config_cls(**_TINY, **extra, architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    del data[missing]
    (tmp_path / "config.json").write_text(json.dumps(data))
    ours = load_model_config(tmp_path)
    assert not isinstance(ours, SimpleNamespace)
    assert model_shape(ours) == model_shape(AutoConfig.from_pretrained(str(tmp_path)))


def tokenizer_folder(smollm2_dir: Path, target: Path, tokenizer_class: str | None, model_type: str) -> Path:
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, target / name)
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    tokenizer_config.pop("tokenizer_class", None)
    if tokenizer_class is not None:
        tokenizer_config["tokenizer_class"] = tokenizer_class
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = json.loads((target / "config.json").read_text())
    config["model_type"] = model_type
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("tokenizer_class,model_type", [
    ("TokenizersBackend", "llama"),
    ("LlamaTokenizerFast", "llama"),      # a ByteLevel tokenizer.json under a Llama class name
    ("Qwen2Tokenizer", "qwen2"),
    ("GPT2Tokenizer", "qwen3"),
    (None, "llama"),                      # no class named: AutoTokenizer's own lookup
])
def test_tokenizer_is_the_one_autotokenizer_picks(smollm2_dir: Path, tmp_path: Path, tokenizer_class: str | None,
                                                  model_type: str) -> None:
    folder = tokenizer_folder(smollm2_dir, tmp_path / "model", tokenizer_class, model_type)
    ours = PromptTokenizer.from_model_dir(folder)._hf
    reference = AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(reference)
    text = "Hello, world! ünïcödé 1234\n\tcode()"
    assert ours(text)["input_ids"] == reference(text)["input_ids"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    assert (ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    assert ours.all_special_tokens == reference.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)


def test_worker_start_never_imports_a_model_config_class(smollm2_dir: Path) -> None:
    """The point of the two above: what a worker runs before serving leaves transformers' config
    classes (and sympy, which torch.empty_like on the meta device would import) unimported."""
    script = f"""
import sys
from pathlib import Path
import torch
from backends.server.tokenization import PromptTokenizer
from backends.worker.model_runner import ModelRunner
PromptTokenizer.from_model_dir({str(smollm2_dir)!r})
ModelRunner(Path({str(smollm2_dir)!r}), dtype=torch.float32, device="cpu", num_blocks=4)
print(sorted(m for m in sys.modules if m.startswith("transformers.models.llama") or m == "sympy"))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
