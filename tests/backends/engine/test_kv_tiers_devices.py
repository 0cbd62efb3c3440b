"""KV tiers on every device the worker runs on: a prefix the device pool evicted comes back from host RAM
or disk, on the CPU here and on CUDA where there is one (on CUDA the copies go through pinned host
buffers, backends/kv_connectors/tiers/block_io.py). No model file is needed, so the CUDA case runs on a machine that
has none: a small Llama of random weights, drawn so that attention is sharp (a wrong block moves the
logits far), written as a checkpoint that both the engine and transformers load. The restored prefix's
logits and the greedy tokens after it are held to transformers' own forward and `generate`."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from backends.core.engine_config import EngineConfig
from backends.core.sampling_params import SamplingParams
from backends.engine.engine import LLMEngine
from backends.engine.runner import build_runner
from tests.backends.engine.runner_view import RunnerView
from tests.backends.engine.test_engine_model import hf_greedy, rel_err, tokens
from tests.backends.engine.test_kv_tiers import evict_prefix, run_all, tiers_of
from tests.backends.numerics import assert_mostly_clear, assert_same_tokens, choices, float64_copy, logit_tolerance

BLOCK = 16
POOL = 12
VOCAB = 512
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
# Standard deviations by tensor: q and k this wide make attention scores of std ~7 (one key dominates), so
# a restored block that is not the computed one changes the answer.
_STD = {"embed_tokens": 1.0, "q_proj": 0.15, "k_proj": 0.15, "v_proj": 0.15, "o_proj": 0.08, "gate_proj": 0.1,
        "up_proj": 0.1, "down_proj": 0.08, "lm_head": 0.1}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        names = {name: p.shape for name, p in LlamaForCausalLM(LlamaConfig(**CONFIG)).named_parameters()}
    weights = {}
    for name, shape in sorted(names.items()):
        std = next((s for key, s in _STD.items() if key in name), None)
        weights[name] = torch.ones(shape) if std is None else torch.randn(shape, generator=g) * std
    save_file(weights, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


@pytest.fixture
def make_engine(tiny_dir: Path) -> Iterator:
    engines: list[LLMEngine] = []

    def make(device: str, **kw: object) -> tuple[LLMEngine, RunnerView]:
        config = EngineConfig(model_dir=str(tiny_dir), device=device, block_size=BLOCK, num_blocks=POOL, **kw)
        view = RunnerView(build_runner(config, tiny_dir))
        engine = LLMEngine(config, view, tiny_dir)
        engines.append(engine)
        return engine, view

    yield make
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_prefix_restored_on_each_device_matches_transformers(make_engine, hf_tiny: torch.nn.Module, tmp_path: Path,
                                                             device: str, tier: str) -> None:
    engine, runner = make_engine(device, **({"kv_cpu_bytes": 64 << 20} if tier == "cpu" else
                                            {"kv_disk_dir": str(tmp_path), "kv_disk_bytes": 64 << 20}))
    shared = prompt(1, 4 * BLOCK)
    first, second = shared + prompt(2, 7), shared + prompt(3, 5)
    engine.add_request("a", first, SamplingParams(max_tokens=1, temperature=0.0))
    assert run_all(engine)["a"][-1].num_cached_tokens == 0
    evict_prefix(engine, tier, 4, prompt)

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("b", second, greedy)
    n_steps = len(runner.steps)
    out_b = run_all(engine)["b"]
    assert out_b[-1].num_cached_tokens == 4 * BLOCK and tiers_of(engine).restored == {tier: 4}
    batch, logits = runner.steps[n_steps]
    assert batch.chunks[0].num_context_tokens == 4 * BLOCK and len(batch.chunks[0].token_ids) == 5
    with torch.inference_mode():
        ref = hf_tiny(torch.tensor([second])).logits[0, -1].float()
        recomputed_without_prefix = hf_tiny(torch.tensor([second[-5:]])).logits[0, -1].float()
    assert rel_err(recomputed_without_prefix, ref) > 0.1, "the prefix hardly moves the logits: the check is blind"
    # The CPU's float32 matches transformers' closely; CUDA's kernels (Triton's dots in tf32) within 1e-3, as in
    # the other CUDA tests. A block restored wrong is off by more than 1 (tried).
    gap = rel_err(logits[0].cpu(), ref)
    assert gap < (1e-3 if device == "cuda" else 1e-4), gap
    (want, want_logits), = hf_greedy(hf_tiny, [second], 12, (-1,))
    tolerance = logit_tolerance(hf_tiny, float64_copy(hf_tiny), [second + want])
    reference = choices(want_logits, greedy, None, (), tolerance)
    assert_mostly_clear([reference], "transformers' greedy tokens")
    assert_same_tokens(tokens(out_b), want, reference, "b")
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == POOL


@pytest.mark.parametrize("read_slower", [False, True], ids=["computed instead", "--kv-read-slower-tiers"])
def test_a_tier_slower_than_computing_is_read_only_now_and_then(make_engine, tmp_path: Path,
                                                                read_slower: bool) -> None:
    """Once reading a prefix back from a tier is measured to cost more than computing it (disk on a fast GPU),
    the engine computes it instead, and reads that tier on one lookup in PROBE_EVERY that it could serve;
    unless the worker was told to read such tiers all the same (to spare a busy GPU's compute)."""
    from backends.core.block_events import DISK
    from backends.kv_connectors.tiers.connector import PROBE_EVERY

    engine, _ = make_engine("cpu", kv_disk_dir=str(tmp_path), kv_disk_bytes=64 << 20,
                            kv_read_slower_tiers=read_slower)
    tiers = tiers_of(engine)
    shared = prompt(1, 4 * BLOCK)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    engine.add_request("a", shared + prompt(2, 7), one)
    run_all(engine)
    evict_prefix(engine, DISK, 4, prompt)
    restored = []
    for i in range(2 * PROBE_EVERY):
        engine.add_request(f"b{i}", shared + prompt(10 + i, 5), one)
        restored.append(run_all(engine)[f"b{i}"][-1].num_cached_tokens == 4 * BLOCK)
        if i == 0:       # measured once (faster than computing, here); now say it cost far more than a prefill
            assert restored[0] and tiers.num_skipped == 0
            tiers.restore_seconds[DISK] = 1e6
            # ... against a prompt token's compute, which the engine fits from its step times; on a loaded machine
            # that fit can stay unsound (None: no price, so the tier would be read), so give it one. A later sound
            # fit replaces it, and any positive one leaves the tier slower than computing.
            tiers.observe_compute(1e-3)
        for j in range(2):   # two fillers of more than half the pool: the prefix leaves the device again
            engine.add_request(f"filler{i}-{j}", prompt(1000 + 2 * i + j, (POOL // 2 + 1) * BLOCK), one)
            run_all(engine)
    if read_slower:
        assert all(restored) and tiers.num_skipped == 0
    else:
        assert not any(restored[1:PROBE_EVERY // 2])
        assert 1 <= sum(restored[1:]) <= 3 and tiers.num_skipped >= PROBE_EVERY
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == POOL
