"""A real `redis-server` for tests: free port, temp dir, no persistence; kill/pause/restart on the SAME port
so that "Redis died mid-run" can be tested against clients that keep their configured URL. A node of a Redis
Cluster (tests/support/redis_cluster_proc.py) is one of these with cluster options, possibly run inside a
network namespace (`wrapper`: `ip netns exec NAME`).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from tests.support.ports import free_port
from tests.support.wait import wait_until


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


class RedisProc:
    """`with RedisProc() as redis: redis.url` — started on enter, stopped and cleaned on exit."""

    def __init__(self, port: int | None = None, start_timeout_s: float = 10.0, *, host: str = "127.0.0.1",
                 extra_args: Sequence[str] = (), wrapper: Sequence[str] = (), config: Sequence[str] = ()) -> None:
        """`config`: lines of a config file the server starts from (a sentinel needs one, and rewrites it)."""
        executable = redis_server_path()
        if executable is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self._executable = executable
        self.port = port or free_port()
        self.host = host
        # Off a loopback address (inside a namespace the test made, so still reachable by nothing else), protected
        # mode would refuse every client: there is no password.
        loopback = host.startswith("127.")
        self._extra_args = (*(() if loopback else ("--protected-mode", "no")), *extra_args)
        self._wrapper = tuple(wrapper)         # a command the server runs under, e.g. ip netns exec NAME
        self._start_timeout_s = start_timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="switchyard-redis-"))
        self._config: tuple[str, ...] = ()
        if config:
            (self._dir / "redis.conf").write_text("".join(line + "\n" for line in config))
            self._config = (str(self._dir / "redis.conf"),)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def directory(self) -> Path:
        return self._dir

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisProc:
        if self.running:
            return self
        log_file = self._dir / "redis.log"
        self._proc = subprocess.Popen(
            [*self._wrapper, self._executable, *self._config, "--port", str(self.port), "--bind", self.host,
             "--dir", str(self._dir), "--save", "", "--appendonly", "no", "--daemonize", "no",
             "--logfile", str(log_file), *self._extra_args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        proc = self._proc

        def up() -> bool:
            if proc.poll() is not None:
                log = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
                raise RuntimeError(f"redis-server exited with {proc.returncode} on port {self.port}:\n{log}")
            return self._pings()

        try:
            wait_until(up, f"redis-server on port {self.port} to answer PING", timeout_s=self._start_timeout_s,
                       interval_s=0.01)
        except AssertionError:
            self.kill()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL: connections drop at once, nothing is saved (an outage)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self.resume()
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    def pause(self) -> None:
        """SIGSTOP: the port stays open but nothing answers (a hung Redis; clients time out)."""
        if self.running:
            assert self._proc is not None
            os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.running:
            assert self._proc is not None
            os.kill(self._proc.pid, signal.SIGCONT)

    def restart(self) -> RedisProc:
        """Kill if running, then start empty on the same port."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisProc:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def cli(self, *args: str, timeout_s: float = 10.0) -> str:
        """`redis-cli` against this server (inside its namespace, if any); its output."""
        done = subprocess.run([*self._wrapper, "redis-cli", "-h", self.host, "-p", str(self.port), *args],
                              capture_output=True, text=True, timeout=timeout_s, check=True)
        return done.stdout

    def _pings(self) -> bool:
        if self._wrapper:
            try:
                return self.cli("PING", timeout_s=2.0).startswith("PONG")
            except (subprocess.SubprocessError, OSError):
                return False
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False
