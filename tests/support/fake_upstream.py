"""A scripted fake OpenAI-compatible upstream, run as its own process (`python -m tests.support.fake_upstream`).

Behaviour per request comes from the body's `"fake"` object (unknown fields pass through the gateway)
or the `x-fake` header (JSON), else from the process default (CLI `--behaviour JSON` or POST /control).
Fields: status, retry_after, stall_s (before headers), first_chunk_delay_s, chunks, chunk_delay_s,
reset_after (abort the connection after that many chunks), die (exit the process), usage, and
fault (cut, malformed and oversized answers: tests/support/fake_faults.py), text_engine (streamed completions
that go on from the text so far: tests/support/fake_text_engine.py).
Gates hold a request at the same four points until the test lets it go, so a test orders events
without a clock: stall_gate, first_chunk_gate, chunk_gate (before every chunk after the first) and
done_gate (after `data: [DONE]`, before the body's end) name a gate; each pass takes one permit
(POST /control {"release": {name: n}}); GET /stats reports how many requests wait at each gate.
GET /stats reports what it received, so tests can count upstream hits.
GET /kv_events answers as a worker does (backends/server/ops_routes.py); its events are built by
cache.kv_events.KvEvent, the parser's own schema, so the fake cannot drift from what the gateway reads
(tests/cache/test_prefix_index.py holds that schema to the worker's).
PD mode (`--role prefill|decode`) follows docs/disaggregation.md; see tests/support/fake_upstream_pd.py.
This module is the process's entry point and the test-side handle that starts it; the server is
fake_upstream_app.py, what it holds and the answers it builds fake_upstream_state.py.
"""
from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from tests.support.ports import free_port
from tests.support.wait import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--name", default="fake")
    parser.add_argument("--behaviour", default="{}", help="default behaviour (JSON)")
    parser.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    args = parser.parse_args()
    import uvloop  # the server's modules load in the fake's own process only, not in the tests'
    from aiohttp import web

    from tests.support.fake_upstream_app import make_app
    from tests.support.fake_upstream_state import FakeState

    uvloop.install()
    web.run_app(make_app(FakeState(args.name, orjson.loads(args.behaviour), args.role)), host=args.host,
                port=args.port, access_log=None, print=None, shutdown_timeout=0.1)


# --- the test-side handle -------------------------------------------------------------------------

class FakeUpstream:
    """Starts the fake as a process; `url` is its base URL."""

    def __init__(self, name: str = "fake", behaviour: dict[str, Any] | None = None, wait: bool = True,
                 role: str = "both", host: str = "127.0.0.1", port: int | None = None) -> None:
        """`host`: another loopback address (127.0.0.2...) lets several fakes share a `port`, as the replicas
        behind one DNS name do."""
        self.name = name
        self.port = free_port() if port is None else port
        self.url = f"http://{host}:{self.port}"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.fake_upstream", "--port", str(self.port), "--host", host,
             "--name", name, "--behaviour", orjson.dumps(behaviour or {}).decode(), "--role", role], cwd=REPO_ROOT)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        _wait_http(self.url + "/health", self._proc)

    def get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + path, timeout=5) as response:
            return orjson.loads(response.read())

    def stats(self) -> dict[str, Any]:
        return self.get("/stats")

    def control(self, **fields: Any) -> None:
        request = urllib.request.Request(self.url + "/control", data=orjson.dumps(fields), method="POST",
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=5).read()

    def release(self, gate: str, permits: int = 1) -> None:
        """Let `permits` requests (or chunks) past `gate`; permits not yet needed are kept for later ones."""
        self.control(release={gate: permits})

    def num_waiting(self, gate: str) -> int:
        """Requests held at `gate` right now."""
        return self.stats()["waiting"].get(gate, 0)

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def kill(self) -> None:
        """Die abruptly (SIGKILL): open connections are reset, nothing is flushed."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 20.0, ok_status: int = 200) -> None:
    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as response:
            return response.status == ok_status
        return False

    wait_until(answers, f"{url} to answer {ok_status}", timeout_s=timeout_s)


@contextlib.contextmanager
def fake_upstreams(*names: str) -> Iterator[list[FakeUpstream]]:
    fakes = [FakeUpstream(name, wait=False) for name in names]
    try:
        for fake in fakes:
            fake.wait_ready()
        yield fakes
    finally:
        for fake in fakes:
            fake.stop()


if __name__ == "__main__":
    main()
