"""Start a real worker process (`python -m backends.server`) on a free port for tests.

`worker_process(...)` yields the worker's base URL once /health answers 200, terminates it on
exit, and fails the test loudly, with the worker's log, if it died on its own. To overlap a slow
set-up with the worker's start, build `WorkerProcess(..., wait=False)` and enter `supervised(it)` later.
"""
from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.wait import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_STARTUP_TIMEOUT_S = 300.0   # the first start converts the bundled GGUF
_LOG_TAIL_CHARS = 20_000


class WorkerProcess:
    """One worker process; `url` is its base URL (no trailing slash)."""

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        wait: bool = True,
        port: int | None = None,
    ) -> None:
        """Start the process (on `port`, e.g. a killed worker's again, else a free one); with wait=False call
        `wait_healthy()` later (to overlap other set-up)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir = log_dir or Path(tempfile.mkdtemp(prefix="switchyard-worker-"))
        self.log_path = log_dir / f"worker-{self.port}.log"
        self._log = self.log_path.open("wb")
        # float32 unless a test asks otherwise: the references the tests compare against (transformers' forward
        # and generate) run in float32, and `--dtype auto` would give bfloat16 on a CPU with AVX512-BF16 or AMX.
        dtype = () if "--dtype" in args else ("--dtype", "float32")
        cmd = [sys.executable, "-m", "backends.server", "--host", "127.0.0.1", "--port", str(self.port), *dtype,
               *args]
        self._proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env={**os.environ, **(env or {})}, stdout=self._log, stderr=subprocess.STDOUT
        )
        self._startup_deadline_s = time.monotonic() + startup_timeout_s
        if wait:
            self.wait_healthy()

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]

    def send_signal(self, signum: int) -> None:
        self._proc.send_signal(signum)

    def wait_exit(self, timeout_s: float = 120.0) -> int:
        """The exit code, once the process has ended by itself."""
        return self._proc.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> int:
        """Terminate (then kill) the process; its exit code."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if not self._log.closed:
            self._log.close()
        return self._proc.returncode

    def wait_healthy(self) -> None:
        """Block until /health answers 200; stop the process and fail the test if it never does."""
        try:
            remaining_s = max(0.0, self._startup_deadline_s - time.monotonic())
            try:
                wait_until(self._healthy, f"worker {self.url} to answer /health", timeout_s=remaining_s,
                           interval_s=0.05)
            except AssertionError as exc:
                pytest.fail(f"{exc}; its log:\n{self.log()}")
        except BaseException:
            self.stop()
            raise

    def _healthy(self) -> bool:
        if self._proc.poll() is not None:
            pytest.fail(f"worker exited with code {self._proc.returncode} while starting:\n{self.log()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except (OSError, http.client.HTTPException):   # not up yet, or not this worker on the port (it will exit)
            return False


@contextmanager
def worker_process(
    args: Sequence[str] = (),
    *,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
) -> Iterator[str]:
    """Yield the base URL of a healthy worker started with `args` (e.g. ["--max-num-seqs", "16"])."""
    worker = WorkerProcess(args, env=env, log_dir=log_dir, startup_timeout_s=startup_timeout_s, wait=False)
    with supervised(worker) as url:
        yield url


@contextmanager
def started_workers(args_by_name: Mapping[str, Sequence[str]], log_dir: Path) -> Iterator[dict[str, WorkerProcess]]:
    """Workers started together (they load at once), each healthy before the block runs; stopped after it."""
    workers = {name: WorkerProcess(args, log_dir=log_dir, wait=False) for name, args in args_by_name.items()}
    try:
        for worker in workers.values():
            worker.wait_healthy()
        yield workers
    finally:
        for worker in workers.values():
            worker.stop()


@contextmanager
def supervised(worker: WorkerProcess) -> Iterator[str]:
    """Wait for `worker` to be healthy, yield its URL, stop it; fail with its log if it died meanwhile."""
    worker.wait_healthy()
    try:
        yield worker.url
    except BaseException:
        if not worker.alive:   # the test failed because the worker died: say so, with its log
            pytest.fail(f"worker died (exit code {worker.stop()}) during the test:\n{worker.log()}")
        raise
    finally:
        died_early = not worker.alive
        code = worker.stop()
    if died_early or code not in (0, -signal.SIGTERM):
        pytest.fail(f"worker died or exited badly (exit code {code}):\n{worker.log()}")
