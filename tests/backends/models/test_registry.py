"""The model registry: every registered architecture builds a model that satisfies the CausalLM protocol and
runs a paged forward through it; an unknown one is refused with the supported names; and which attention backend
a latent cache (DeepSeek-V3) is given."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from backends.attention.base import AttentionContext, AttentionShape, StepLayout, create_backend
from backends.models import model_class, supported_architectures
from backends.models.base import CausalLM, LayerKVSpec
from backends.models.kernels.registry import select_kernels
from backends.worker.random_weights import RandomCheckpoint

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=64, rope_theta=10000.0,
            tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
# where the MoE families keep each layer's experts, and their projection names (gate, up, down)
EXPERTS = {"MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
           "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
# Families whose config this Llama-shaped one cannot stand for: each is built and run in its own test module
# (tests/backends/models/test_deepseek_v3.py).
OWN_TESTS = frozenset({"DeepseekV3ForCausalLM"})


def tiny_config(architecture: str) -> Any:
    return SimpleNamespace(architectures=[architecture], **TINY)


def random_weights(config: Any) -> dict[str, torch.Tensor]:
    """RandomCheckpoint's tensors plus the q/k/v biases (Qwen2) and per-head q/k norms (Qwen3) it leaves out."""
    weights = dict(RandomCheckpoint(config, torch.float32, torch.device("cpu")))
    head_dim = config.hidden_size // config.num_attention_heads
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn"
        weights[f"{p}.q_proj.bias"] = torch.randn(config.num_attention_heads * head_dim) * 0.02
        for name in ("k_proj", "v_proj"):
            weights[f"{p}.{name}.bias"] = torch.randn(config.num_key_value_heads * head_dim) * 0.02
        weights[f"{p}.q_norm.weight"] = weights[f"{p}.k_norm.weight"] = torch.ones(head_dim)
    if config.architectures[0] in EXPERTS:
        weights |= expert_weights(config)
    return weights


def expert_weights(config: Any) -> dict[str, torch.Tensor]:
    """Per-expert tensors and routers, as transformers saves them, for a MoE architecture."""
    block, (gate, up, down) = EXPERTS[config.architectures[0]]
    inter = config.moe_intermediate_size if block == "mlp" else config.intermediate_size
    hidden, weights = config.hidden_size, {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.{block}"
        weights[f"{p}.gate.weight"] = torch.randn(config.num_local_experts, hidden)
        for e in range(config.num_local_experts):
            weights[f"{p}.experts.{e}.{gate}.weight"] = torch.randn(inter, hidden) * 0.02
            weights[f"{p}.experts.{e}.{up}.weight"] = torch.randn(inter, hidden) * 0.02
            weights[f"{p}.experts.{e}.{down}.weight"] = torch.randn(hidden, inter) * 0.02
    return weights


@pytest.mark.parametrize("architecture", [a for a in supported_architectures() if a not in OWN_TESTS])
def test_each_registered_architecture_builds_a_causal_lm(architecture: str) -> None:
    config = tiny_config(architecture)
    model = model_class(config.architectures)(config, select_kernels("cpu"))
    assert isinstance(model, CausalLM)
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    assert model.kv_cache_spec() == (LayerKVSpec(num_heads=4, num_kv_heads=2, head_dim=head_dim,
                                                 scale=head_dim ** -0.5),) * 2
    with torch.no_grad():
        model.load_weights(random_weights(config))
    model.eval()

    # one prefill of 5 tokens through the protocol alone, over a paged cache of 4 blocks of 4 tokens
    spec = model.kv_cache_spec()[0]
    caches = [torch.zeros(4, 4, spec.num_kv_heads, spec.head_dim) for _ in range(4)]
    backend = create_backend("sdpa", AttentionShape(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                                                    head_dim=spec.head_dim, block_size=4, scale=spec.scale,
                                                    dtype=torch.float32), torch.device("cpu"))
    slots = torch.tensor([4, 5, 6, 7, 0])   # blocks 1 then 0
    layout = StepLayout(query_lens=(5,), context_lens=(0,), block_tables=((1, 0),), slot_mapping=slots,
                        device=torch.device("cpu"))
    ids = torch.tensor([1, 7, 3, 60, 2])
    with torch.inference_mode():
        context = AttentionContext(backend=backend, metadata=backend.prepare(layout), slot_mapping=slots,
                                   k_caches=caches[:2], v_caches=caches[2:])
        hidden = model(ids, torch.arange(5), context)
        logits = model.compute_logits(hidden)
        embeds = model.embed(ids)
    assert hidden.shape == embeds.shape == (5, TINY["hidden_size"])
    assert logits.shape == (5, TINY["vocab_size"]) and torch.isfinite(logits).all()
    assert model.lm_head_weight().shape == (TINY["vocab_size"], TINY["hidden_size"])
    assert all(c.abs().sum() > 0 for c in caches)   # every layer wrote its K and V


@pytest.mark.parametrize("architectures", [["GPT2LMHeadModel"], [], None])
def test_an_unknown_architecture_names_the_supported_ones(architectures: list[str] | None) -> None:
    with pytest.raises(ValueError, match="unsupported architectures") as error:
        model_class(architectures)
    assert all(name in str(error.value) for name in supported_architectures())


def test_the_first_supported_name_wins() -> None:
    assert model_class(["GPT2LMHeadModel", "Qwen2ForCausalLM"]).__name__ == "Qwen2ForCausalLM"


def test_a_latent_cache_gets_sdpa_on_the_cpu_and_never_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend for a latent cache (DeepSeek-V3): SDPA by default, on the CPU and on CUDA even where flash_attn
    and Triton are installed (flash reads K and V heads; the Triton latent kernel, backends/attention/triton_mla.py,
    is asked for by name until it has run on a GPU); flash is refused."""
    from backends.attention import base
    from backends.attention.base import AttentionBackendName, default_backend_name

    latent = AttentionShape(4, 1, 24, block_size=4, scale=0.1, dtype=torch.bfloat16, latent_value_dim=32)
    assert create_backend(None, latent, torch.device("cpu")).name is AttentionBackendName.SDPA
    with pytest.raises(ValueError, match="needs a CUDA device"):
        create_backend("triton", latent, torch.device("cpu"))
    with pytest.raises(ValueError, match="does not read a latent KV cache"):
        create_backend("flash", latent, torch.device("cpu"))
    monkeypatch.setattr(base.importlib.util, "find_spec", lambda name: object())   # flash_attn and Triton "installed"
    cuda = torch.device("cuda")
    assert default_backend_name(cuda, torch.bfloat16) is AttentionBackendName.FLASH
    assert default_backend_name(cuda, torch.bfloat16, latent=True) is AttentionBackendName.SDPA
    assert default_backend_name(torch.device("cpu"), torch.bfloat16, latent=True) is AttentionBackendName.SDPA
