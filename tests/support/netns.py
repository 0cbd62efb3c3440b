"""Hosts made real for tests: network namespaces joined by a veth pair, so that a partition is a link set down.

Every namespace, link and process is the test's own and is removed on exit; nothing is routed outside them.
Needs root and iproute2 (`ip`); `unavailable()` says why not, for a skip.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from types import TracebackType

from tests.support.wait import wait_until


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip`"
    if shutil.which("curl") is None:
        return "the namespaced client needs curl"
    name = f"sy-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None


class Host:
    """One network namespace: a host with its own loopback and interfaces."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def wrapper(self) -> list[str]:
        """What runs a command on this host."""
        return ["ip", "netns", "exec", self.name]

    def run(self, *command: str, timeout_s: float = 30.0) -> str:
        done = subprocess.run([*self.wrapper, *command], capture_output=True, text=True, timeout=timeout_s,
                              check=True)
        return done.stdout

    def http(self, method: str, url: str, body: bytes | None = None, headers: Sequence[str] = (),
             timeout_s: float = 10.0) -> tuple[int, str]:
        """One HTTP request from this host (curl): the status and the body."""
        command = ["curl", "-s", "-m", str(timeout_s), "-X", method, "-w", "\n%{http_code}", url]
        for header in headers:
            command += ["-H", header]
        if body is not None:
            command += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
        done = subprocess.run([*self.wrapper, *command], input=body, capture_output=True, timeout=timeout_s + 5)
        text, _, status = done.stdout.decode(errors="replace").rpartition("\n")
        return int(status or 0), text

    def wait_http(self, url: str, what: str, timeout_s: float = 60.0) -> None:
        wait_until(lambda: self.http("GET", url, timeout_s=1.0)[0] == 200, what, timeout_s=timeout_s,
                   interval_s=0.1)


class TwoHosts:
    """`with TwoHosts() as (a, b):` two namespaces joined by one veth pair: a at 10.77.0.1, b at 10.77.0.2.
    `cut()` sets b's end of the link down (a partition: packets are dropped, connections time out), `heal()`
    sets it up again."""

    A_ADDRESS, B_ADDRESS = "10.77.0.1", "10.77.0.2"

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.a, self.b = Host(f"sy-{tag}-a"), Host(f"sy-{tag}-b")
        self._a_link, self._b_link = f"sy{tag}a", f"sy{tag}b"    # interface names: at most 15 characters

    def __enter__(self) -> tuple[Host, Host]:
        try:
            for host in (self.a, self.b):
                subprocess.run(["ip", "netns", "add", host.name], check=True, capture_output=True)
                host.run("ip", "link", "set", "lo", "up")
            subprocess.run(["ip", "link", "add", self._a_link, "netns", self.a.name, "type", "veth", "peer",
                            "name", self._b_link, "netns", self.b.name], check=True, capture_output=True)
            for host, link, address in ((self.a, self._a_link, self.A_ADDRESS), (self.b, self._b_link, self.B_ADDRESS)):
                host.run("ip", "addr", "add", f"{address}/24", "dev", link)
                host.run("ip", "link", "set", link, "up")
        except BaseException:
            self._remove()
            raise
        return self.a, self.b

    def cut(self) -> None:
        self.b.run("ip", "link", "set", self._b_link, "down")

    def heal(self) -> None:
        self.b.run("ip", "link", "set", self._b_link, "up")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._remove()

    def _remove(self) -> None:
        """Deleting a namespace deletes its end of the veth pair, and with it the other end."""
        for host in (self.a, self.b):
            subprocess.run(["ip", "netns", "delete", host.name], capture_output=True)
