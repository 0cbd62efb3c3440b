"""Endpoints found in DNS: a provider's pool may list `dns+http://NAME:PORT`, which stands for one endpoint,
`http://ADDRESS:PORT`, per address NAME resolves to (a Kubernetes headless service, a docker-compose service
scaled to several replicas). Each such entry is resolved again every `pollers.discovery_interval_s`; the
registry (gateway/routing/endpoints.py) adds the endpoints that appeared, with their pollers, and retires those that
went. A lookup that fails keeps the last addresses: a DNS hiccup must not empty a pool (an address that went
away fails its health checks instead).

Plain http only: an https endpoint named by its address could not have its certificate checked.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

SCHEME = "dns+http://"

Resolver = Callable[[str, int], Awaitable[list[str]]]   # (name, port) -> addresses


def is_discovered(url: str) -> bool:
    return url.startswith(SCHEME)


@dataclass(frozen=True, slots=True)
class DnsName:
    """One `dns+http://NAME:PORT` entry of a pool."""
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> DnsName:
        """Raises ValueError saying what is wrong with `url`."""
        parts = urlsplit(url.removeprefix("dns+"))
        try:
            port = parts.port or 80
        except ValueError:
            raise ValueError(f"{url!r}: the port is not a number in 0-65535") from None
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or parts.query \
                or parts.username:
            raise ValueError(f"{url!r}: expected dns+http://NAME:PORT (a name to resolve, plain http, no path)")
        return cls(parts.hostname, port)

    def endpoint_url(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"http://{host}:{self.port}"


async def resolve(host: str, port: int) -> list[str]:
    """Every address (IPv4 and IPv6) `host` resolves to, sorted; raises OSError when the lookup fails."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class Discovery:
    """Resolves one pool's DNS entry and hands the endpoint URLs to `apply` (the registry's)."""

    def __init__(self, name: DnsName, apply: Callable[[list[str]], None], resolver: Resolver = resolve) -> None:
        self.name = name
        self._apply = apply
        self._resolver = resolver
        self._failing = False

    async def refresh(self) -> None:
        """One lookup; on failure the pool keeps what it has."""
        try:
            addresses = await self._resolver(self.name.host, self.name.port)
        except OSError as exc:
            if not self._failing:
                log.warning("DNS lookup of %s failed: %r (its endpoints are kept until it answers)",
                            self.name.host, exc)
            self._failing = True
            return
        if self._failing:
            log.info("DNS lookup of %s answers again", self.name.host)
        self._failing = False
        self._apply([self.name.endpoint_url(address) for address in addresses])

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:   # a boundary: discovery must outlive any one bad round
                log.exception("discovering %s failed", self.name.host)
            await asyncio.sleep(interval_s)
