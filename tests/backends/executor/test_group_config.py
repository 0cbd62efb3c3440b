"""What a worker over a group of ranks does not serve yet is refused when its configuration is built, with the reason
(backends/core/engine_config.py); one rank keeps every feature, and each rank gets its share of the cores."""
from __future__ import annotations

import os
import re
from typing import Any

import pytest

from backends.core.engine_config import TORCH_THREADS_ENV, EngineConfig, KVConnectorName


@pytest.mark.parametrize(("fields", "named"), [
    ({"kv_cpu_bytes": 1 << 20, "device": "cuda"}, "KV tiers on CUDA"),
    ({"kv_connectors": (KVConnectorName.PD,), "device": "cuda"}, "P/D transfer on CUDA"),
    ({"keep_weights_compressed": True}, "weights kept compressed"),
])
def test_a_group_refuses_what_it_does_not_serve_yet(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"(2 tensor-parallel x 1 pipeline stages) does not serve {named}")):
        EngineConfig(tensor_parallel_size=2, **fields)
    with pytest.raises(ValueError, match=re.escape(f"(1 tensor-parallel x 2 pipeline stages) does not serve {named}")):
        EngineConfig(pipeline_parallel_size=2, **fields)
    EngineConfig(tensor_parallel_size=1, **fields)   # one rank serves it


def test_a_model_proposer_serves_any_group() -> None:
    for proposer in ("eagle", "ngram+eagle", "draft", "ngram+draft"):
        for sizes in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                      {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}):
            EngineConfig(speculative=proposer, speculative_model="/somewhere", **sizes)


def test_prompt_lookup_p_d_on_the_cpu_and_bad_sizes() -> None:
    EngineConfig(tensor_parallel_size=2, speculative="ngram")
    EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2, kv_connectors=(KVConnectorName.PD,),
                 kv_cpu_bytes=1 << 20)
    for fields in ({"tensor_parallel_size": 0}, {"pipeline_parallel_size": 0},
                   {"tensor_parallel_size": 2, "distributed_timeout_s": 0}):
        with pytest.raises(ValueError, match="tensor_parallel_size and pipeline_parallel_size must be >= 1"):
            EngineConfig(**fields)


def test_each_rank_gets_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TORCH_THREADS_ENV, raising=False)
    cores = os.cpu_count() or 1
    assert EngineConfig().resolved_torch_threads() == cores
    assert EngineConfig(tensor_parallel_size=2).resolved_torch_threads() == max(1, cores // 2)
    assert EngineConfig(tensor_parallel_size=2, torch_num_threads=3).resolved_torch_threads() == 3   # per rank
    assert EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2).resolved_torch_threads() == max(1, cores // 4)
