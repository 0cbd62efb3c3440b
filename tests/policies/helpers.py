"""Builders for policy tests: endpoint states and request facts with sensible defaults."""
from __future__ import annotations

from policies.base import EndpointState, RequestFacts


def ep(endpoint_id: str, *, healthy: bool = True, requests: int = 0, prefill: int = 0, decode: int = 0,
       matched: int = 0, kv_free: float | None = None, tiers: tuple[int, int, int] = (0, 0, 0),
       restore: tuple[float | None, float | None, float | None] = (None, None, None)) -> EndpointState:
    """`matched`: device blocks; `tiers`: the (cpu, disk, store) blocks of the run past them; `restore`: the
    restore fractions its worker measured for those media."""
    return EndpointState(endpoint_id, healthy, requests, prefill, decode, matched, kv_free, tiers, restore)


def fleet(n: int, **kwargs: object) -> list[EndpointState]:
    return [ep(f"http://w{i}:8000", **kwargs) for i in range(n)]  # type: ignore[arg-type]


def facts(session_key: str | None = None, session_endpoint: str | None = None,
          hashes: tuple[int, ...] = (), block_size: int = 16) -> RequestFacts:
    return RequestFacts("smollm2", 100, 50, hashes, session_key, session_endpoint, block_size)
