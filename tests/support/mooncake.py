"""A real `mooncake_master` for tests of the shared KV tier (backends/kv_connectors/tiers/mooncake_store.py)."""
from __future__ import annotations

import subprocess
from pathlib import Path

from backends.kv_connectors.tiers.mooncake_store import start_master, wait_ready
from tests.support.ports import free_port


class Master:
    """One `mooncake_master` on a fixed pair of ports, so that a restart keeps the address clients know."""

    def __init__(self, log_dir: Path) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.log_path = log_dir / "mooncake_master.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = start_master(self.port, metrics_port=self.metrics_port, log_path=self.log_path)
        wait_ready(self.proc, self.port)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
