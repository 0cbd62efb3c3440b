"""The disaggregated cluster the tests in tests/backends/disagg/ run against: real worker processes
(bundled SmolLM2, fp32 CPU) P1 (prefill), P2 (both), D1-D3 (decode) behind one real gateway. Starting,
killing and stopping them only; what they answer is the tests' business."""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from tests.support.gateway_proc import GatewayProcess
from tests.support.worker_proc import WorkerProcess

HOLD_TIMEOUT_S = 8.0   # long enough for a test's next few requests on a loaded machine; unclaimed holds are awaited
COMMON = ["--threads", "1", "--num-blocks", "96", "--kv-hold-timeout-s", str(HOLD_TIMEOUT_S),
          "--kv-idle-timeout-s", "2", "--debug-endpoints"]


class Cluster:
    def __init__(self, workdir: Path) -> None:
        roles = {"p1": "prefill", "p2": "both", "d1": "decode", "d2": "decode", "d3": "decode"}
        # D2 decodes with drafts (prompt lookup): its legs must equal the unified worker's as D1's do.
        extra = {"d3": ["--no-kv-shared-memory"], "d2": ["--speculative", "ngram", "--no-adaptive-speculation"]}
        self.workers = {name: WorkerProcess(["--role", role, *COMMON, *extra.get(name, [])], log_dir=workdir,
                                            wait=False)
                        for name, role in roles.items()}
        for worker in self.workers.values():
            worker.wait_healthy()
        urls = {name: w.url for name, w in self.workers.items()}
        self.gateway = GatewayProcess(gateway_config([urls["p1"], urls["p2"]], [urls["d1"], urls["d2"], urls["d3"]]),
                                      workdir)

    def url(self, name: str) -> str:
        return self.workers[name].url

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.workers[name]._proc.pid, sig)

    def stop(self) -> None:
        self.gateway.stop()
        for worker in self.workers.values():
            worker.stop()


def gateway_config(prefill_urls: list[str], decode_urls: list[str]) -> dict[str, Any]:
    """A gateway serving "smollm2" through one switchyard-pd provider over these pools."""
    from backends.worker.loader import resolve_model

    timeouts = {"connect_s": 1.0, "first_byte_s": 30.0, "total_s": 60.0}
    provider = {"kind": "switchyard-pd", "prefill_endpoints": prefill_urls, "endpoints": decode_urls,
                "offers_load": False, "offers_kv_events": False, "offers_token_ids": True, "timeouts": timeouts}
    return {"models": {"smollm2": {"tokenizer": str(resolve_model("smollm2")), "providers": ["pd"]}},
            "providers": {"pd": provider},
            "pollers": {"health_interval_s": 60.0},
            "retries": {"max_attempts": 6, "backoff_initial_s": 0.01, "backoff_max_s": 0.05,
                        "budget_min_retries": 100},
            "breaker": {"failure_threshold": 100}}
