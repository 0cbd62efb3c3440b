"""docker/compose.yaml's services run as processes of images replayed by tests/support/dockerfile.py: each with
its compose command, environment and mounts, and its addresses (`prefill:8000`, `0.0.0.0`, `--port 8000`)
rewritten to 127.0.0.1 ports picked here, which is the only change made. Readiness is the service's own
compose health check, run in its image.
"""
from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.support.dockerfile import Stage, Unsupported
from tests.support.ports import free_port
from tests.support.wait import wait_until

_URL = re.compile(r"(?P<scheme>[a-z][\w+]*://)(?P<host>[\w.-]+):(?P<port>\d+)")
_LOCAL_HOSTS = frozenset({"0.0.0.0", "127.0.0.1", "localhost"})
_CONFIG_PATH = re.compile(r"(?<=[\s\[,])/[A-Za-z][\w./-]*")   # an absolute path in a YAML value
_CONFIG_PORT = re.compile(r"^(?P<key>[ \t]*\w*port:[ \t]*)(?P<port>\d+)", re.MULTILINE)
_CONFIG_HOST = re.compile(r"^(?P<key>[ \t]*\w*host:[ \t]*)[\w.-]+", re.MULTILINE)


class Addresses:
    """The host port standing in for each (service, container port), picked on first use."""

    def __init__(self, services: Mapping[str, Any]) -> None:
        self.services = frozenset(services)
        self._ports: dict[tuple[str, int], int] = {}

    def port(self, service: str, container_port: int) -> int:
        if service not in self.services:
            raise Unsupported(f"an address on {service!r}, which is no compose service")
        return self._ports.setdefault((service, container_port), free_port())

    def bind(self, service: str, container_port: int, host_port: int) -> None:
        """A port a process of the test's own chose (redis-server)."""
        self._ports[(service, container_port)] = host_port

    def rewrite(self, text: str, service: str) -> str:
        """URLs to a service (or to 127.0.0.1 inside `service`'s container) pointed at its host port."""
        def url(match: re.Match[str]) -> str:
            host = service if match["host"] in _LOCAL_HOSTS else match["host"]
            return f"{match['scheme']}127.0.0.1:{self.port(host, int(match['port']))}"
        return _URL.sub(url, text)

    def rewrite_argv(self, argv: list[str], service: str) -> list[str]:
        """`--*port N` / `--*port=N`: the service's host port; `--*host` / `--*address`: 127.0.0.1; URLs."""
        out: list[str] = []
        flag = ""
        for arg in argv:
            name, sep, value = arg.partition("=") if arg.startswith("--") else (flag, "", arg)
            if arg.startswith("--") and not sep:
                flag = arg
                out.append(arg)
                continue
            if name.endswith("port"):
                value = str(self.port(service, int(value)))
            elif name.endswith(("host", "address")):
                value = "127.0.0.1"
            value = self.rewrite(value, service)
            out.append(f"{name}={value}" if sep else value)
            flag = ""
        left = [arg for arg in out if any(re.search(rf"\b{name}:\d", arg) for name in self.services)]
        if left:
            raise Unsupported(f"{service}: an address this test does not rewrite: {left}")
        return out

    def rewrite_config(self, text: str, service: str, stage: Stage) -> str:
        """A config file: addresses as above (`*port: N` and `*host: H` keys too), absolute paths into the
        image's folder here."""
        text = _CONFIG_PORT.sub(lambda m: f"{m['key']}{self.port(service, int(m['port']))}", text)
        text = _CONFIG_HOST.sub(lambda m: f"{m['key']}127.0.0.1", text)
        return _CONFIG_PATH.sub(lambda m: str(stage.host_path(m[0])), self.rewrite(text, service))


class Service:
    """One compose service's process, started from its image with compose's command and environment."""

    def __init__(self, name: str, spec: Mapping[str, Any], stage: Stage, addresses: Addresses,
                 log_dir: Path) -> None:
        self.name, self.spec, self.stage, self.addresses = name, spec, stage, addresses
        entrypoint = spec.get("entrypoint") or stage.entrypoint
        argv = addresses.rewrite_argv([*entrypoint, *(spec.get("command") or stage.cmd)], name)
        argv = [str(stage.host_path(arg)) if arg.startswith("/") else arg for arg in argv]   # mounted files
        self.env = {key: addresses.rewrite(str(value), name) for key, value in (spec.get("environment") or {}).items()}
        self.log_path = log_dir / f"{name}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen([stage.which(argv[0]), *argv[1:]], cwd=stage.host_path(stage.workdir),
                                         env=stage.process_env(self.env), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]

    def wait_healthy(self, timeout_s: float) -> None:
        """Until the compose health check (`CMD` form, run in the image) passes; fails if the process exits."""
        test = self.spec["healthcheck"]["test"]
        if test[0] != "CMD":
            raise Unsupported(f"{self.name}: a health check not in the CMD form: {test}")
        argv = [self.stage.which(test[1]), *(self.addresses.rewrite(arg, self.name) for arg in test[2:])]

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            return subprocess.run(argv, env=self.stage.process_env(), capture_output=True).returncode == 0

        try:
            wait_until(healthy, f"{self.name}'s health check", timeout_s=timeout_s, interval_s=0.25)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{self.log()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
