"""The KV tiers with the mixture-of-experts families, against transformers on the same weights: a prefix evicted
from a small device pool down to a tier (host RAM, disk, or the shared Mooncake store behind a real
mooncake_master) and read back gives transformers' logits in the step after the restore and its greedy tokens.

Mixtral and Qwen3-MoE on every tier; DeepSeek-V3 on the shared store, where what moves is its latent blocks
(its RAM and disk tiers are in test_deepseek_v3.py). Logits within the float32 rounding measured in the same run
(tests/backends/numerics.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from backends.core.block_events import CPU, DISK, STORE
from backends.core.engine_config import EngineConfig
from backends.core.sampling_params import SamplingParams
from backends.engine.engine import LLMEngine
from backends.kv_connectors.tiers.connector import TieredKVConnector
from backends.worker.model_runner import ModelRunner
from tests.backends.engine.runner_view import RunnerView
from tests.backends.engine.test_engine_model import hf_greedy
from tests.backends.engine.test_kv_tiers import (  # mooncake_master: the engine tests' fixture, used here too
    evict_prefix,
    mooncake_master,  # noqa: F401
    run_all,
)
from tests.backends.models.moe_checkpoints import float64_twin, tiny_deepseek_v3, tiny_moe
from tests.backends.numerics import assert_mostly_clear, assert_same_tokens, choices, logit_tolerance

BLOCK = 4
POOL = 12    # device blocks: small, so that a few prompts evict the prefix


@dataclass(frozen=True)
class Family:
    folder: Path
    runner: ModelRunner
    hf: torch.nn.Module    # transformers' model, float32
    tolerance: float       # numerics.logit_tolerance on it

    def prompt(self, seed: int, length: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(3, self.runner.vocab_size) for _ in range(length)]


@pytest.fixture(scope="module")
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    folder = tmp_path_factory.mktemp(f"tiers-{request.param}")
    hf = tiny_deepseek_v3(folder, 48) if request.param == "deepseek-v3" else tiny_moe(request.param, folder)
    # fingerprinted: the disk tier and the store file blocks under the weights' digest
    runner = ModelRunner(folder, dtype=torch.float32, device="cpu", num_blocks=64, block_size=BLOCK,
                         fingerprint_weights=True)
    rows = [Family(folder, runner, hf, 0.0).prompt(seed, 40) for seed in range(3)]
    return Family(folder, runner, hf, logit_tolerance(hf, float64_twin(hf), rows))


def tier_config(medium: str, block_bytes: int, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, object]:
    if medium == CPU:
        return {"kv_cpu_bytes": 64 * block_bytes}
    if medium == DISK:
        return {"kv_disk_dir": str(tmp_path), "kv_disk_bytes": 64 * (block_bytes + 64)}
    # every computed block is written through to a real master's store
    return {"kv_store": request.getfixturevalue("mooncake_master").url, "kv_store_bytes": 64 << 20}


# DeepSeek-V3's RAM and disk tiers: test_deepseek_v3.py
CASES = [*((name, medium) for name in ("mixtral", "qwen3-moe") for medium in (CPU, DISK, STORE)),
         ("deepseek-v3", STORE)]


@pytest.mark.parametrize("family, medium", CASES, indirect=["family"])
def test_prefix_restored_from_a_tier_gives_transformers_tokens(family: Family, medium: str, tmp_path: Path,
                                                               request: pytest.FixtureRequest) -> None:
    runner = family.runner
    view = RunnerView(runner, POOL)
    tier = tier_config(medium, runner.kv_cache.spec.bytes_per_block, tmp_path, request)
    engine = LLMEngine(EngineConfig(model_dir=str(family.folder), block_size=BLOCK, num_blocks=POOL,
                                    kv_read_slower_tiers=True, **tier), view, family.folder)
    try:
        shared = family.prompt(70, 4 * BLOCK)
        second = shared + family.prompt(72, 5)
        engine.add_request("a", shared + family.prompt(71, 7), SamplingParams(max_tokens=1, temperature=0.0))
        run_all(engine)
        evict_prefix(engine, medium, 4, lambda seed, n: family.prompt(seed, n))
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)   # some configs name no EOS
        engine.add_request("b", second, greedy)
        num_steps = len(view.steps)
        out = run_all(engine)["b"]
        assert out[-1].num_cached_tokens == 4 * BLOCK
        assert engine.find_kv_connector(TieredKVConnector).restored == {medium: 4}
        batch, logits = view.steps[num_steps]
        assert batch.chunks[0].num_context_tokens == 4 * BLOCK and len(batch.chunks[0].token_ids) == 5
        with torch.inference_mode():
            want_last = family.hf(torch.tensor([second])).logits[0, -1].float()
        assert (logits[0].float() - want_last).abs().max().item() <= family.tolerance
        (want, want_logits), = hf_greedy(family.hf, [second], 12, (-1,))
        ref = choices(want_logits, greedy, None, (), family.tolerance)
        assert_mostly_clear([ref], "transformers' greedy tokens")
        assert_same_tokens([t for o in out for t in o.new_token_ids], want, ref, f"restored from {medium}")
        engine.block_manager.check_invariants()
        assert engine.block_manager.num_free_blocks == POOL
    finally:
        engine.close()
