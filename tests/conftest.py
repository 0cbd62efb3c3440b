"""Shared fixtures: the bundled SmolLM2 converted once (the real model, not a stand-in), its transformers
reference, the one real redis-server launcher, and the `gpu` marker's skip when CUDA is absent."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.redis_cluster_proc import redis_cluster, redis_cluster_session, shared_redis  # noqa: F401
from tests.support.redis_proc import RedisProc


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The HF-style folder of the bundled model (converted into $SWITCHYARD_CACHE on first use)."""
    from backends.worker.loader import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir: Path) -> torch.nn.Module:
    """transformers' own LlamaForCausalLM on the same weights: the independent reference (float32, eval)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()


@pytest.fixture
def redis_server() -> Iterator[RedisProc]:
    """A real redis-server of the test's own on a free port (make test installs it; missing, the test fails).
    Tests kill, pause and restart it on the same port to stage outages."""
    with RedisProc() as proc:
        yield proc
