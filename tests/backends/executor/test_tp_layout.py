"""How a Llama-family or DeepSeek-V3 model splits over a tensor-parallel group (backends/models/tensor_parallel.py):
which heads, KV heads, MLP columns and vocabulary rows each rank holds, and the sizes refused at start. Pure: no
processes."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from backends.models.tensor_parallel import TPLayout
from backends.worker.model_runner import check_group

SMOLLM2 = SimpleNamespace(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                          num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
# the tiny MoE configs of tests/backends/models/moe_checkpoints.py (Qwen3-MoE: layer 1 dense, 96 wide)
QWEN3_MOE = SimpleNamespace(architectures=["Qwen3MoeForCausalLM"], hidden_size=64, intermediate_size=96,
                            moe_intermediate_size=40, num_experts=8, mlp_only_layers=[1], num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=97)
MIXTRAL = SimpleNamespace(architectures=["MixtralForCausalLM"], hidden_size=64, intermediate_size=48,
                          num_local_experts=8, num_attention_heads=4, num_key_value_heads=2, vocab_size=97)
# tests/backends/models/moe_checkpoints.py's TINY_DEEPSEEK_V3 (q_lora_rank 48): a dense first layer 96 wide, then
# 8 experts 32 wide and one shared expert as wide
DEEPSEEK_V3 = SimpleNamespace(architectures=["DeepseekV3ForCausalLM"], hidden_size=64, intermediate_size=96,
                              moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
                              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
                              qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, head_dim=16, vocab_size=97)
EIGHT_OVER_TWO = SimpleNamespace(architectures=["LlamaForCausalLM"], hidden_size=512, intermediate_size=1024,
                                 num_attention_heads=8, num_key_value_heads=2, vocab_size=1001)


@pytest.mark.parametrize(("config", "size", "rank", "want"), [
    # (query heads, first head, KV heads, first KV head, MLP columns, vocabulary rows)
    (SMOLLM2, 3, 0, (3, 0, 1, 0, 512, 16384)),
    (SMOLLM2, 3, 2, (3, 6, 1, 2, 512, 16384)),
    (EIGHT_OVER_TWO, 2, 1, (4, 4, 1, 1, 512, 501)),
    (EIGHT_OVER_TWO, 4, 1, (2, 2, 1, 0, 256, 251)),   # KV head 0 replicated on ranks 0 and 1
    (EIGHT_OVER_TWO, 4, 2, (2, 4, 1, 1, 256, 251)),   # query heads 4-5 read KV head 1
    (EIGHT_OVER_TWO, 8, 7, (1, 7, 1, 1, 128, 126)),
])
def test_each_rank_holds_its_heads_columns_and_rows(config: SimpleNamespace, size: int, rank: int,
                                                    want: tuple[int, ...]) -> None:
    layout = TPLayout.of(config, rank, size)
    got = (layout.num_heads, layout.first_head, layout.num_kv_heads, layout.first_kv_head, layout.intermediate,
           layout.vocab)
    assert got == want
    # a query head h reads KV head h // (heads / kv_heads): this rank's heads read the KV heads it holds
    group = config.num_attention_heads // config.num_key_value_heads
    kv_read = {h // group for h in range(layout.first_head, layout.first_head + layout.num_heads)}
    assert kv_read == set(range(layout.first_kv_head, layout.first_kv_head + layout.num_kv_heads))


def test_rows_each_rank_reads_of_each_tensor() -> None:
    layout = TPLayout.of(SMOLLM2, 1, 3)   # heads 3-5 of 64 channels, KV head 1, MLP columns 512-1023
    rows = {name: layout.rows_of(f"model.layers.0.{name}") for name in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight",
        "self_attn.o_proj.bias", "mlp.gate_proj.weight", "mlp.down_proj.weight", "mlp.down_proj.bias",
        "input_layernorm.weight", "self_attn.q_norm.weight")}
    assert rows == {
        "self_attn.q_proj.weight": (0, 192, 384), "self_attn.k_proj.weight": (0, 64, 128),
        "self_attn.v_proj.bias": (0, 64, 128), "self_attn.o_proj.weight": (1, 192, 384),
        "self_attn.o_proj.bias": None, "mlp.gate_proj.weight": (0, 512, 1024), "mlp.down_proj.weight": (1, 512, 1024),
        "mlp.down_proj.bias": None, "input_layernorm.weight": None, "self_attn.q_norm.weight": None}
    assert layout.rows_of("model.embed_tokens.weight") == layout.rows_of("lm_head.weight") == (0, 16384, 32768)
    assert layout.rows_of("model.norm.weight") is None


@pytest.mark.parametrize(("config", "size", "message"), [
    (SMOLLM2, 2, "does not divide the model's 9 attention heads"),
    (SimpleNamespace(**{**vars(SMOLLM2), "num_attention_heads": 12, "num_key_value_heads": 4}), 6,
     "neither divides the model's 4 KV heads nor is a multiple of them"),
    (EIGHT_OVER_TWO, 3, "does not divide the model's 8 attention heads"),
    (SimpleNamespace(**{**vars(SMOLLM2), "intermediate_size": 1000}), 3, "1000 MLP columns"),
    (DEEPSEEK_V3, 3, "--tensor-parallel-size 3 does not divide the model's 4 attention heads"),
    (SimpleNamespace(**{**vars(DEEPSEEK_V3), "num_attention_heads": 128, "n_routed_experts": 256}), 3,
     "--tensor-parallel-size 3 does not divide the model's 128 attention heads; choose a size that divides 128"),
    (SimpleNamespace(**{**vars(QWEN3_MOE), "moe_intermediate_size": 42}), 4,
     "--tensor-parallel-size 4 does not divide the model's 42 expert columns"),
])
def test_sizes_the_model_cannot_split_are_refused(config: SimpleNamespace, size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_group(config, size)
    check_group(config, 1)   # one rank runs anything


@pytest.mark.parametrize(("expert_parallel", "rank", "want", "rows"), [
    # (first expert, experts held, first column, columns of each) and the rows read of expert 5's tensors
    (False, 1, (0, 8, 20, 20), {"gate_proj": (0, 20, 40), "up_proj": (0, 20, 40), "down_proj": (1, 20, 40)}),
    (True, 1, (4, 4, 0, 40), {"gate_proj": None, "up_proj": None, "down_proj": None}),
])
def test_each_rank_holds_its_experts_or_their_columns(expert_parallel: bool, rank: int, want: tuple[int, ...],
                                                      rows: dict[str, tuple[int, int, int] | None]) -> None:
    layout = TPLayout.of(QWEN3_MOE, rank, 2, expert_parallel)
    assert layout.experts is not None
    split = layout.experts
    assert (split.first_expert, split.num_experts, split.first_column, split.intermediate) == want
    assert {p: layout.rows_of(f"model.layers.0.mlp.experts.5.{p}.weight") for p in rows} == rows
    # the router is replicated; a dense layer's MLP (mlp_only_layers) splits by intermediate_size as LlamaMLP's
    assert layout.rows_of("model.layers.0.mlp.gate.weight") is None
    assert layout.rows_of("model.layers.1.mlp.gate_proj.weight") == (0, 48 * rank, 48 * (rank + 1))


def test_expert_parallel_gives_each_rank_only_its_own_experts() -> None:
    import torch

    split = TPLayout.of(MIXTRAL, 1, 2, expert_parallel=True).experts
    assert split is not None and (split.first_expert, split.num_experts) == (4, 4)
    ids = torch.tensor([[0, 4], [7, 3], [5, 6]])
    assert split.local_ids(ids).tolist() == [[4, 0], [3, 4], [1, 2]]   # 4: another rank's expert
    within = TPLayout.of(MIXTRAL, 1, 2).experts
    assert within is not None and within.local_ids(ids) is ids and within.rows_of("w2") == (1, 24, 48)


@pytest.mark.parametrize(("config", "size", "message"), [
    (SimpleNamespace(**{**vars(MIXTRAL), "num_local_experts": 6}), 4,
     "--tensor-parallel-size 4 with --enable-expert-parallel does not divide the model's 6 experts"),
    (SMOLLM2, 3, "--enable-expert-parallel: LlamaForCausalLM has no experts to split"),
    (MIXTRAL, 1, "--enable-expert-parallel splits the experts over a group's ranks: it needs"),
])
def test_expert_parallel_sizes_refused(config: SimpleNamespace, size: int, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_group(config, size, expert_parallel=True)


def test_expert_parallel_needs_no_expert_columns_to_divide() -> None:
    """Mixtral's experts are whole on each rank: a width 4 does not divide is no obstacle (it is within each)."""
    narrow = SimpleNamespace(**{**vars(MIXTRAL), "intermediate_size": 42})
    check_group(narrow, 4, expert_parallel=True)
    with pytest.raises(ValueError, match="does not divide the model's 42 expert columns"):
        check_group(narrow, 4)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_deepseek_v3_splits_its_query_heads_and_replicates_the_latent(expert_parallel: bool) -> None:
    """Rank 1 of 2: query heads 2-3 (q_b / q_proj rows of 48 per head, kv_b's W_UK and W_UV rows of 64 per head,
    o_proj's columns of 32 per head); the latent's projections, norms and the router whole; the dense MLP and the
    shared expert by columns in either mode; the routed experts by columns or whole."""
    layout = TPLayout.of(DEEPSEEK_V3, 1, 2, expert_parallel)
    assert (layout.num_heads, layout.first_head, layout.num_kv_heads, layout.vocab) == (2, 2, 1, 49)
    assert layout.shared_intermediate == 16
    attention = {name: layout.rows_of(f"model.layers.1.self_attn.{name}") for name in (
        "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight", "o_proj.bias")}
    assert attention == {
        "q_a_proj.weight": None, "q_a_layernorm.weight": None, "q_b_proj.weight": (0, 96, 192),
        "q_proj.weight": (0, 96, 192), "kv_a_proj_with_mqa.weight": None, "kv_a_layernorm.weight": None,
        "kv_b_proj.weight": (0, 128, 256), "o_proj.weight": (1, 64, 128), "o_proj.bias": None}
    mlp = {name: layout.rows_of(f"model.layers.{name}") for name in (
        "0.mlp.gate_proj.weight", "0.mlp.down_proj.weight", "1.mlp.gate.weight", "1.mlp.gate.e_score_correction_bias",
        "1.mlp.shared_experts.gate_proj.weight", "1.mlp.shared_experts.up_proj.weight",
        "1.mlp.shared_experts.down_proj.weight", "1.mlp.experts.5.gate_proj.weight",
        "1.mlp.experts.5.down_proj.weight")}
    routed = (None, None) if expert_parallel else ((0, 16, 32), (1, 16, 32))
    assert mlp == {
        "0.mlp.gate_proj.weight": (0, 48, 96), "0.mlp.down_proj.weight": (1, 48, 96), "1.mlp.gate.weight": None,
        "1.mlp.gate.e_score_correction_bias": None, "1.mlp.shared_experts.gate_proj.weight": (0, 16, 32),
        "1.mlp.shared_experts.up_proj.weight": (0, 16, 32), "1.mlp.shared_experts.down_proj.weight": (1, 16, 32),
        "1.mlp.experts.5.gate_proj.weight": routed[0], "1.mlp.experts.5.down_proj.weight": routed[1]}
    assert layout.experts is not None and layout.experts.first_expert == (4 if expert_parallel else 0)
    assert layout.rows_of("model.embed_tokens.weight") == layout.rows_of("lm_head.weight") == (0, 49, 98)


def test_deepseek_v3s_shared_expert_must_divide_even_with_expert_parallelism() -> None:
    """Whole routed experts need no width to divide, but the shared expert is split by columns in either mode."""
    narrow = SimpleNamespace(**{**vars(DEEPSEEK_V3), "moe_intermediate_size": 42, "intermediate_size": 96})
    with pytest.raises(ValueError, match="does not divide the model's 42 shared expert columns"):
        check_group(narrow, 4, expert_parallel=True)
    check_group(narrow, 2, expert_parallel=True)


def test_deepseek_v3_over_pipeline_stages() -> None:
    """Its layers split over stages, with or without tensor parallelism; no more stages than layers."""
    config = SimpleNamespace(**{**vars(DEEPSEEK_V3), "num_hidden_layers": 3})
    for size in (1, 2):
        check_group(config, size, stages=3)
        with pytest.raises(ValueError, match="--pipeline-parallel-size 4 is more than the model's 3 layers"):
            check_group(config, size, stages=4)
