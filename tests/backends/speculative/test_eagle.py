"""The EAGLE head and proposer: loading the EAGLE checkpoint layout, the head's forward against transformers'
Llama layer on the same weights, the proposer's catch-up and rollback, block accounting, and
`switchyard train-draft` end to end in a tiny budget."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from backends.attention.base import AttentionContext, AttentionShape, StepLayout, create_backend
from backends.models.int8_linear import INT8_COST, int8_available
from backends.models.llama import LlamaForCausalLM
from backends.models.model_config import read_config_json
from backends.speculative.eagle import EagleProposer, load_eagle_head, read_head_weights
from backends.speculative.lookup_first import LookupFirstProposer
from backends.speculative.ngram import NgramProposer
from backends.speculative.proposer import DraftRequest
from backends.worker.model_runner import ModelRunner

DRAFT_VOCAB = 64   # the test heads draft among this many tokens (d2t), so draft argmaxes have wide margins


@pytest.fixture(scope="module")
def runner(smollm2_dir: Path) -> ModelRunner:
    return ModelRunner(smollm2_dir, dtype=torch.float32, device="cpu", num_blocks=96, block_size=16)


@pytest.fixture(scope="module")
def target(runner: ModelRunner) -> LlamaForCausalLM:
    return runner.model


def write_head(folder: Path, smollm2_dir: Path, *, eagle1: bool, fmt: str, d2t: bool, seed: int = 0) -> Path:
    """A randomly initialised head in the EAGLE layout for the target in `smollm2_dir` (SmolLM2, or another
    Llama). eagle1: no input_layernorm, fc with a bias."""
    config = {**read_config_json(smollm2_dir), "num_hidden_layers": 1, "attention_bias": False, "mlp_bias": False}
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, std=0.05: torch.randn(*shape, generator=g) * std  # noqa: E731
    weights = {"fc.weight": rand(h, 2 * h), "layers.0.self_attn.q_proj.weight": rand(q, h),
               "layers.0.self_attn.k_proj.weight": rand(kv, h), "layers.0.self_attn.v_proj.weight": rand(kv, h),
               "layers.0.self_attn.o_proj.weight": rand(h, q), "layers.0.mlp.gate_proj.weight": rand(inter, h),
               "layers.0.mlp.up_proj.weight": rand(inter, h), "layers.0.mlp.down_proj.weight": rand(h, inter),
               "layers.0.post_attention_layernorm.weight": 1 + rand(h, std=0.1),
               "embed_tokens.weight": rand(16, h)}   # present in some checkpoints; the target's are used
    if eagle1:
        weights["fc.bias"] = rand(h)
    else:
        weights["layers.0.input_layernorm.weight"] = 1 + rand(h, std=0.1)
    if d2t:
        ids = torch.randperm(config["vocab_size"], generator=g)[:DRAFT_VOCAB].sort().values
        weights["d2t"] = ids - torch.arange(DRAFT_VOCAB)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(weights, str(folder / "model.safetensors"))
    else:
        torch.save(weights, folder / "pytorch_model.bin")
    return folder


def reference_head(folder: Path, target: LlamaForCausalLM, dtype: torch.dtype) -> torch.nn.Module:
    """fc + transformers' LlamaDecoderLayer over the same weights, in plain PyTorch."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(**read_config_json(folder))
    config._attn_implementation = "sdpa"
    weights = read_head_weights(folder)
    h = config.hidden_size

    class Reference(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2 * h, h, bias="fc.bias" in weights)
            self.layer = LlamaDecoderLayer(config, layer_idx=0)
            self.rotary = LlamaRotaryEmbedding(config)
            self.embed = torch.nn.Embedding.from_pretrained(target.embed_tokens.weight.detach().clone())
            if "layers.0.input_layernorm.weight" not in weights:
                self.layer.input_layernorm = torch.nn.Identity()

        def forward(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
            n = tokens.shape[0]
            x = self.fc(torch.cat((self.embed(tokens), hidden), dim=-1)).unsqueeze(0)
            positions = torch.arange(n).unsqueeze(0)
            mask = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1).view(1, 1, n, n)
            return self.layer(x, attention_mask=mask, position_ids=positions,
                              position_embeddings=self.rotary(x, positions))[0]

    ref = Reference()
    state = {name.removeprefix("layers.0."): t for name, t in weights.items() if name.startswith("layers.0.")}
    ref.layer.load_state_dict(state)
    ref.fc.load_state_dict({k.removeprefix("fc."): v for k, v in weights.items() if k.startswith("fc.")})
    return ref.to(dtype).eval()


def run_head(folder: Path, target: LlamaForCausalLM, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Our head over one chunk at positions 0.., through a fresh one-layer paged KV and the SDPA backend."""
    head = load_eagle_head(folder, target).head
    attn, bs, n = head.layer.self_attn, 16, tokens.shape[0]
    num_blocks = -(-n // bs)
    cache = torch.zeros(2, num_blocks, bs, attn.num_kv_heads, attn.head_dim)
    backend = create_backend("sdpa", AttentionShape(attn.num_heads, attn.num_kv_heads, attn.head_dim, bs,
                                                    attn.head_dim ** -0.5, torch.float32), torch.device("cpu"))
    slots = torch.arange(n)
    layout = StepLayout((n,), (0,), (tuple(range(num_blocks)),), slots, torch.device("cpu"))
    ctx = AttentionContext(backend, backend.prepare(layout), slots, [cache[0]], [cache[1]])
    with torch.inference_mode():
        return head(target.embed_tokens(tokens), hidden, torch.arange(n), ctx)


@pytest.mark.parametrize(("eagle1", "fmt"), [(True, "safetensors"), (False, "bin")])
def test_head_matches_transformers_layer(tmp_path: Path, smollm2_dir: Path, target: LlamaForCausalLM,
                                         eagle1: bool, fmt: str) -> None:
    folder = write_head(tmp_path / "head", smollm2_dir, eagle1=eagle1, fmt=fmt, d2t=False)
    g = torch.Generator().manual_seed(1)
    n = 37   # spans three blocks, the last partly filled
    tokens = torch.randint(0, target.config.vocab_size, (n,), generator=g)
    hidden = torch.randn(n, target.config.hidden_size, generator=g)
    ours = run_head(folder, target, tokens, hidden)
    with torch.no_grad():
        ref32 = reference_head(folder, target, torch.float32)(tokens, hidden)
        ref64 = reference_head(folder, target, torch.float64)(tokens, hidden.double())
    # float32 rounding measured on the reference itself (tests/backends/numerics.py's rule: 8x it)
    tolerance = 8 * (ref32.double() - ref64).abs().max().item()
    assert tolerance > 0
    assert (ours.double() - ref64).abs().max().item() <= tolerance


def test_load_rejects_a_head_of_another_size(tmp_path: Path, smollm2_dir: Path, target: LlamaForCausalLM) -> None:
    folder = write_head(tmp_path / "head", smollm2_dir, eagle1=True, fmt="safetensors", d2t=False)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="one decoder layer"):
        load_eagle_head(folder, target)


def _history(seed: int, length: int, hidden_size: int) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 49152, (length,), generator=g).tolist(), torch.randn(length, hidden_size, generator=g)


def test_catch_up_and_rollback_give_the_drafts_of_a_fresh_proposer(tmp_path: Path, smollm2_dir: Path,
                                                                    target: LlamaForCausalLM) -> None:
    folder = write_head(tmp_path / "head", smollm2_dir, eagle1=True, fmt="safetensors", d2t=True)
    h = target.config.hidden_size
    tokens_a, hidden_a = _history(2, 60, h)
    tokens_b, hidden_b = _history(3, 45, h)
    # float32: int8 quantizes the activations of a whole call with one scale, so its drafts depend on the batch
    live = EagleProposer(folder, target, num_blocks=16, block_size=4, int8=False)
    # a: a prompt of 20 in two prefill chunks, then steps that accept 2 drafts and 0 drafts
    live.observe("a", 0, tokens_a[:12], hidden_a[:12])
    live.observe("a", 12, tokens_a[:21], hidden_a[12:20])
    live.observe("b", 0, tokens_b[:31], hidden_b[:30])
    first = live.propose([DraftRequest("a", tokens_a[:21], 4), DraftRequest("b", tokens_b[:31], 3)])
    assert [len(d) for d in first] == [4, 3]
    assert live.draft_token_ids is not None
    allowed = set(live.draft_token_ids.tolist())
    assert all(t in allowed for d in first for t in d)
    live.observe("a", 20, tokens_a[:24], hidden_a[20:23])
    live.propose([DraftRequest("a", tokens_a[:24], 4)])
    live.observe("a", 23, tokens_a[:25], hidden_a[23:24])
    # b rolls back: positions 28.. observed again (a recomputation), with other hidden states
    hidden_b2 = hidden_b.clone()
    hidden_b2[28:] += 0.5
    live.observe("b", 28, tokens_b[:36], hidden_b2[28:35])
    after = live.propose([DraftRequest("a", tokens_a[:25], 4), DraftRequest("b", tokens_b[:36], 4)])

    fresh = EagleProposer(folder, target, num_blocks=16, block_size=4, int8=False)
    fresh.observe("a", 0, tokens_a[:25], hidden_a[:24])
    fresh.observe("b", 0, tokens_b[:36], hidden_b2[:35])
    expected = [fresh.propose([DraftRequest("a", tokens_a[:25], 4)])[0],
                fresh.propose([DraftRequest("b", tokens_b[:36], 4)])[0]]
    assert after == expected


def test_no_drafts_without_the_hidden_states_of_every_verified_position(tmp_path: Path, smollm2_dir: Path,
                                                                        target: LlamaForCausalLM) -> None:
    folder = write_head(tmp_path / "head", smollm2_dir, eagle1=False, fmt="safetensors", d2t=True)
    tokens, hidden = _history(4, 30, target.config.hidden_size)
    proposer = EagleProposer(folder, target, num_blocks=8, block_size=4)
    proposer.observe("a", 0, tokens[:21], hidden[:10])   # positions 10..19 never observed
    assert proposer.propose([DraftRequest("a", tokens[:21], 4), DraftRequest("unknown", tokens, 2)]) == [[], []]


@pytest.mark.parametrize("int8", [False, True], ids=["bf16-head", "int8-head"])
def test_a_bfloat16_target_drafts_with_its_head(tmp_path: Path, smollm2_dir: Path, int8: bool) -> None:
    """A worker's --dtype auto is bfloat16 on CPUs with AVX512-BF16: the head and its draft LM head follow the
    target's dtype (until 2026-11-27 the draft LM head stayed float32 and every draft failed), or run in int8."""
    if int8 and not int8_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this torch build has no fbgemm quantized engine")
    target = ModelRunner(smollm2_dir, dtype=torch.bfloat16, device="cpu", num_blocks=8, block_size=16).model
    folder = write_head(tmp_path / "head", smollm2_dir, eagle1=True, fmt="safetensors", d2t=True)
    proposer = EagleProposer(folder, target, num_blocks=8, block_size=4, int8=int8)
    tokens, hidden = _history(6, 30, target.config.hidden_size)
    proposer.observe("a", 0, tokens[:21], hidden[:20].bfloat16())
    drafts = proposer.propose([DraftRequest("a", tokens[:21], 4)])
    assert len(drafts[0]) == 4 and proposer.draft_token_ids is not None
    assert set(drafts[0]) <= set(proposer.draft_token_ids.tolist())


def test_free_releases_every_block(tmp_path: Path, smollm2_dir: Path, target: LlamaForCausalLM) -> None:
    folder = write_head(tmp_path / "head", smollm2_dir, eagle1=True, fmt="safetensors", d2t=True)
    tokens, hidden = _history(5, 80, target.config.hidden_size)
    proposer = EagleProposer(folder, target, num_blocks=8, block_size=4)
    for i, end in enumerate((20, 41, 79)):
        proposer.observe(str(i), 0, tokens[:end + 1], hidden[:end])
    drafts = proposer.propose([DraftRequest(str(i), tokens[:end + 1], 4) for i, end in enumerate((20, 41, 79))])
    assert all(len(d) == 4 for d in drafts)
    assert proposer.blocks.num_used_blocks > 0
    proposer.blocks.check_invariants()
    for i in range(3):
        proposer.free(str(i))
        proposer.free(str(i))   # idempotent
    proposer.blocks.check_invariants()
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_total_blocks


def test_cost_per_token_counts_one_layer_and_the_draft_vocabulary(tmp_path: Path, smollm2_dir: Path,
                                                                  target: LlamaForCausalLM) -> None:
    full_dir = write_head(tmp_path / "full", smollm2_dir, eagle1=True, fmt="safetensors", d2t=False)
    full = EagleProposer(full_dir, target, num_blocks=4, int8=False)
    reduced = EagleProposer(write_head(tmp_path / "small", smollm2_dir, eagle1=True, fmt="safetensors", d2t=True),
                            target, num_blocks=4, int8=False)
    # SmolLM2: 30 layers of 3.5M weights and a 28M-weight LM head; the head reads one layer, fc and the LM head
    assert 0.2 < full.cost_per_token < 0.3
    assert reduced.cost_per_token < 0.05
    if int8_available(torch.device("cpu"), torch.float32):
        assert EagleProposer(full_dir, target, num_blocks=4).int8   # the default where it is available
        assert EagleProposer(full_dir, target, num_blocks=4, int8=True).cost_per_token == \
            pytest.approx(INT8_COST * full.cost_per_token)


def test_train_draft_writes_a_loadable_head(tmp_path: Path, target: LlamaForCausalLM) -> None:
    from tools.draft_training import train_draft

    out = tmp_path / "trained"
    report = train_draft.main(["--budget-minutes", "0.05", "--max-samples", "2", "--max-new-tokens", "8",
                               "--eval-prompts", "2", "--batch-size", "2", "--draft-vocab", "512", "--out", str(out)])
    loaded = load_eagle_head(out, target)
    assert loaded.draft_token_ids is not None and loaded.draft_token_ids.numel() == 512
    assert report["steps"] >= 1 and report["train_texts"] == 2
    verifications = sum(v["verifications"] for k, v in report["acceptance"].items() if k != "cost_per_token")
    assert verifications > 0
    assert json.loads((out / "train_report.json").read_text())["acceptance"] == report["acceptance"]


def test_engine_answers_carry_transformers_hidden_states(smollm2_dir: Path, hf_smollm2) -> None:
    """train-draft's texts from our engine: three prompts through two sequence slots (one waits for a slot), and
    the hidden state recorded at each position is transformers' final normed hidden state there."""
    from tools.draft_training.train_texts import engine_answers

    prompts = [list(range(200, 230)), list(range(500, 517)), list(range(900, 950))]
    answered = engine_answers(smollm2_dir, prompts, max_new_tokens=6, sample=True, seed=3, batch_size=2,
                              deadline_s=None)
    assert [i for i, _, _ in answered] == [0, 1, 2]
    for i, ids, hidden in answered:
        assert ids[:len(prompts[i])] == prompts[i] and len(prompts[i]) < len(ids) <= len(prompts[i]) + 6
        with torch.inference_mode():
            want = hf_smollm2(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states[-1][0]
        assert hidden.shape == want.shape
        assert float((hidden - want).norm() / want.norm()) < 1e-4


@pytest.mark.parametrize(("lookup_first", "int8"), [(False, False), (False, True), (True, True)],
                         ids=["eagle-f32", "eagle-int8", "ngram+eagle-int8"])
def test_engine_greedy_with_an_eagle_head_equals_plain_decoding(tmp_path: Path, smollm2_dir: Path, runner: ModelRunner,
                                                                hf_smollm2, hf_smollm2_f64, lookup_first: bool,
                                                                int8: bool) -> None:
    """Concurrent requests, then two that hit the prefix cache (the head starts past position 0), drafting
    every step (adaptive K off): the tokens of plain decoding, judged where float32 rounding cannot decide.
    With prompt lookup first, both proposers draft (the prompts are made to be copied), and the head, which
    observes every position whichever drafted, still gives plain decoding's tokens. The head in int8 drafts
    other tokens at times, and the target's verification keeps the output the same."""
    if int8 and not int8_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no fbgemm quantized engine")
    from transformers import AutoTokenizer

    from backends.core.engine_config import EngineConfig
    from backends.core.sampling_params import SamplingParams
    from backends.engine.engine import LLMEngine
    from tests.backends.engine.runner_view import RunnerView
    from tests.backends.engine.test_engine_model import make_engine, run_all, tokens
    from tests.backends.engine.test_speculative import STRUCTURED, greedy_reference
    from tests.backends.numerics import assert_same_tokens

    folder = write_head(tmp_path / "head", smollm2_dir, eagle1=True, fmt="safetensors", d2t=True)
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    waves = [{f"s{i}": tok(text)["input_ids"] for i, text in enumerate(STRUCTURED)},
             {f"again{i}": tok(STRUCTURED[i])["input_ids"] + tok(" Once more:")["input_ids"] for i in (0, 1)}]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    # The engines share the runner's KV tensors: plain (no prefix cache) runs every wave first, so
    # that nothing overwrites the blocks the speculative engine's prefix cache holds.
    plain, _ = make_engine(runner, smollm2_dir, 96, enable_prefix_caching=False)
    proposer = EagleProposer(folder, runner.model, num_blocks=96, int8=int8)
    both = LookupFirstProposer(proposer, NgramProposer())
    fast = LLMEngine(EngineConfig(model_dir=str(smollm2_dir), num_blocks=96, speculative=both.name if lookup_first
                                  else "eagle", speculative_model=str(folder), spec_adaptive=False,
                                  num_speculative_tokens=3),
                     RunnerView(runner, 96), smollm2_dir, proposer=both if lookup_first else proposer)
    want, got = [], []
    for engine, outs in ((plain, want), (fast, got)):
        for prompts in waves:
            for rid, prompt in prompts.items():
                engine.add_request(rid, prompt, greedy)
            outs.append(run_all(engine))
    for prompts, w, g in zip(waves, want, got, strict=True):
        refs, _ = greedy_reference(hf_smollm2, hf_smollm2_f64, list(prompts.values()),
                                   [tokens(w[r]) for r in prompts], plain.eos_token_ids, greedy)
        for rid, ref in zip(prompts, refs, strict=True):
            assert_same_tokens(tokens(g[rid]), tokens(w[rid]), ref, rid)
    stats = fast.stats()
    assert stats.num_spec_proposed_tokens > 0 and stats.num_cached_prompt_tokens > 0, stats
    if lookup_first:
        assert both.num_lookup_drafts > 0 and both.num_model_drafts > 0, (both.num_lookup_drafts, both.num_model_drafts)
        assert fast.stats().speculative == "ngram+eagle"
    assert not proposer._states, "finished requests left drafting state"
    proposer.blocks.check_invariants()
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_total_blocks


def test_config_builds_lookup_first_around_the_head(tmp_path: Path, smollm2_dir: Path, runner: ModelRunner) -> None:
    from backends.core.engine_config import EngineConfig
    from backends.speculative.factory import build_proposer

    folder = write_head(tmp_path / "head", smollm2_dir, eagle1=False, fmt="safetensors", d2t=False)
    built = build_proposer(EngineConfig(model_dir=str(smollm2_dir), speculative="ngram+eagle",
                                        speculative_model=str(folder), ngram_min=3), runner)
    assert isinstance(built, LookupFirstProposer) and isinstance(built.model, EagleProposer)
    assert built.name == "ngram+eagle" and built.wants_hidden and built.cost_per_token == built.model.cost_per_token
    assert built.lookup.propose([DraftRequest("r", [5, 6, 7, 9, 5, 6, 7], 2)]) == [[9, 5]]   # n >= 3 matched
    with pytest.raises(ValueError, match="needs --speculative-model"):
        EngineConfig(model_dir=str(smollm2_dir), speculative="ngram+draft")
    with pytest.raises(ValueError, match="unknown speculative proposer"):
        EngineConfig(model_dir=str(smollm2_dir), speculative="ngram+ngram")
