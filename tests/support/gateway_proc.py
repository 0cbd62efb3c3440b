"""Start a real gateway process from a config (a dict written as YAML) on a free port; wait for /ready."""
from __future__ import annotations

import http.client
import os
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.support.fake_upstream import REPO_ROOT
from tests.support.ports import free_port
from tests.support.wait import wait_until


class GatewayProcess:
    """`python -m gateway.cli gateway --config FILE [args]`; `url` is its base URL."""

    def __init__(self, config: dict[str, Any], workdir: Path, env: dict[str, str] | None = None,
                 wait_path: str = "/ready", ca_file: str | None = None, args: tuple[str, ...] = (),
                 start_timeout_s: float = 30.0) -> None:
        config = dict(config)
        listen = dict(config.get("listen") or {})
        listen.setdefault("host", "127.0.0.1")
        listen["port"] = free_port()
        config["listen"] = listen
        scheme = "https" if listen.get("tls") else "http"
        self.url = f"{scheme}://127.0.0.1:{listen['port']}"
        self.config_path = workdir / f"gateway-{listen['port']}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / f"gateway-{listen['port']}.log"
        self._log = self.log_path.open("wb")
        self._ssl = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "gateway", "--config", str(self.config_path), *args],
            cwd=REPO_ROOT, env={**os.environ, **(env or {})}, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait(wait_path, start_timeout_s)

    def _wait(self, path: str, timeout_s: float = 30.0) -> None:
        def answers() -> bool:
            if self._proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self._proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=1, context=self._ssl) as response:
                    return response.status == 200
            except (OSError, http.client.HTTPException):
                return False

        try:
            wait_until(answers, f"gateway {self.url}{path} to answer 200", timeout_s=timeout_s)
        except AssertionError as exc:
            raise TimeoutError(f"{exc}:\n{self.log()}") from None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def send_signal(self, signum: int) -> None:
        self._proc.send_signal(signum)

    def wait_exit(self, timeout_s: float = 60.0) -> int:
        """The exit code, once the process has ended by itself."""
        return self._proc.wait(timeout_s)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
