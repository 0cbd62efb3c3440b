"""Token-aware load accounting per endpoint: leases count each request's prefill and decode tokens
in flight and give back exactly what they took (counts never drift or go negative); the leases of
peer processes (`--workers N`, other replicas, shared through the state store by load_share.py) and
the workers' own load reports are blended in; `OutputLengthEstimator` predicts output lengths per model.

The estimate at an endpoint = our leases (exact, now) + the peers' leases (as last published, while
fresh) + what the worker's last report saw beyond all of those (direct clients), while fresh.
"""
from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from types import TracebackType
from typing import Any

from cache.tier_runs import MatchedByMedium, RestoreFractions

# A worker report older than this no longer adds load from other sources (its worker may be
# gone, or the load it saw has finished).
DEFAULT_REPORT_TTL_S = 5.0
# Peers' leases read longer ago than this are dropped (the sharing task stopped or the store is down).
DEFAULT_PEER_TTL_S = 2.0


# Where a worker measured none: a guess at a read-back's cost against computing the tokens, the complement of
# policies.prefix_aware's default tier weights (CPU workers measured 0.003-0.04 for RAM and disk, up to 0.14 for a
# Mooncake store: docs/benchmarks.md).
DEFAULT_RESTORE_FRACTIONS = (0.2, 0.5, 0.7)


# Here, beside the leases, not in cache/tier_runs.py: every request calls it, and a request runs few modules
# (tests/test_request_footprint.py).
def prefill_work_tokens(matched: MatchedByMedium, block_size: int, num_prompt_tokens: int,
                        restore_fractions: RestoreFractions) -> int:
    """The prefill an endpoint holding `matched` spends on a prompt, in computed tokens' worth (its lease's prefill
    work): the tokens it computes, plus those it reads back from its KV tiers at each medium's restore fraction
    (measured, else DEFAULT_RESTORE_FRACTIONS). A read-back is cheaper than a prefill, not free: a worker that reads
    a hot prefix from the store for request after request is busy for each."""
    num_device, *num_tier = matched
    cached = min(num_prompt_tokens, sum(matched) * block_size)
    tier_tokens = cached - min(cached, num_device * block_size)
    work = num_prompt_tokens - cached
    if tier_tokens:   # the run's last block may be partial: its tier blocks' tokens shared out by count
        per_block = sum(n * (default if f is None else f)
                        for n, f, default in zip(num_tier, restore_fractions, DEFAULT_RESTORE_FRACTIONS, strict=True))
        work += round(tier_tokens * per_block / sum(num_tier))
    return work


@dataclass(frozen=True, slots=True)
class LoadReport:
    num_running: int                 # sequences the worker is decoding or prefilling now
    num_waiting: int                 # sequences queued for admission
    num_prefill_tokens_pending: int  # prompt tokens not yet prefilled (running + waiting)
    num_decode_tokens_pending: int   # output tokens still allowed (max_tokens minus produced)
    num_free_blocks: int             # KV blocks free (not holding a live sequence's tokens)
    num_total_blocks: int            # KV blocks in the worker's cache
    num_cached_blocks: int           # free blocks still holding reusable prefix-cache content
    block_size: int                  # tokens per KV block
    # Optional (older workers and other engines leave them out): the worker's lifetime prompt tokens
    # and, of those, the ones its prefix cache served.
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    # Per KV tier medium (cpu, disk, store): reading a token back from it against computing it, as the
    # worker measured it (its `kv_tiers[].restore_fraction`); None where it has no such tier or no figure yet.
    restore_fractions: RestoreFractions = (None, None, None)
    # The fingerprint of the worker's weights (backends/worker/fingerprint.py): workers with other weights refuse
    # each other's KV. "": not reported.
    weights: str = ""
    # The shared KV store it reads, while reachable (its store tier's `shared`: the store's address and KV namespace,
    # hashed): every worker that reports the same one can load the blocks any of them wrote there. "": none.
    shared_store: str = ""

    @classmethod
    def from_mapping(cls, body: Mapping[str, Any]) -> LoadReport:
        """Parse a worker's `/load` JSON body; raises ValueError when a field is missing or bad."""
        values: dict[str, Any] = {}
        for name in _INT_FIELDS:
            value = body.get(name)
            if value is None and name in _OPTIONAL_FIELDS:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"load report field {name!r} must be a non-negative int, got {value!r}")
            values[name] = value
        tiers = body.get("kv_tiers")
        if tiers is not None:
            values["restore_fractions"] = _restore_fractions(tiers)
            values["shared_store"] = _shared_store(tiers)
        weights = body.get("weights")
        if weights is not None:
            if not isinstance(weights, str):
                raise ValueError(f"load report field 'weights' must be a string, got {weights!r}")
            values["weights"] = weights
        return cls(**values)

    @property
    def kv_free_fraction(self) -> float | None:
        return self.num_free_blocks / self.num_total_blocks if self.num_total_blocks else None


_OPTIONAL_FIELDS = frozenset(f.name for f in fields(LoadReport) if f.default is not MISSING)
_INT_FIELDS = tuple(f.name for f in fields(LoadReport)
                    if f.name not in ("restore_fractions", "weights", "shared_store"))
TIER_MEDIA = ("cpu", "disk", "store")   # the order of RestoreFractions (and of the prefix index's tier matches)


def _restore_fractions(tiers: Any) -> RestoreFractions:
    """(cpu, disk, store) restore fractions from a report's `kv_tiers` list; media it lacks, or whose figure
    is missing, give None."""
    if not isinstance(tiers, list):
        raise ValueError(f"load report field 'kv_tiers' must be a list, got {tiers!r}")
    found: dict[str, float] = {}
    for tier in tiers:
        if not isinstance(tier, Mapping):
            raise ValueError(f"a load report's kv_tiers entry must be an object, got {tier!r}")
        value = tier.get("restore_fraction")
        if value is None or tier.get("medium") not in TIER_MEDIA:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < math.inf:
            raise ValueError(f"a kv_tiers restore_fraction must be a non-negative number, got {value!r}")
        found[tier["medium"]] = float(value)
    cpu, disk, store = (found.get(medium) for medium in TIER_MEDIA)
    return (cpu, disk, store)


def _shared_store(tiers: list[Mapping[str, Any]]) -> str:
    """The `shared` name of a report's store tier while it is up ("" without one; `_restore_fractions` checked the
    list's shape)."""
    for tier in tiers:
        if tier.get("medium") == "store" and tier.get("up", True) is not False:
            shared = tier.get("shared", "")
            if not isinstance(shared, str):
                raise ValueError(f"a kv_tiers shared must be a string, got {shared!r}")
            return shared
    return ""


class _EndpointLoad:
    """Mutable counts for one endpoint: the sum of its open leases, plus other sources' load."""
    __slots__ = (
        "kv_free_fraction",
        "num_decode_tokens",
        "num_prefill_tokens",
        "num_requests",
        "other_decode_tokens",
        "other_prefill_tokens",
        "other_requests",
        "peer_time_s",
        "peers",
        "prompt_tokens",
        "report_time_s",
        "restore_fractions",
    )

    def __init__(self) -> None:
        self.num_requests = 0          # open leases
        self.num_prefill_tokens = 0    # their prompt tokens not yet prefilled
        self.num_decode_tokens = 0     # their expected output tokens not yet streamed
        self.other_requests = 0        # from the last report: requests neither ours nor peers' (direct clients)
        self.other_prefill_tokens = 0
        self.other_decode_tokens = 0
        self.report_time_s = -math.inf  # when the last report arrived (tracker clock)
        self.kv_free_fraction: float | None = None
        self.prompt_tokens: tuple[int, int] | None = None   # last report's (prompt, cached) lifetime tokens
        self.restore_fractions: RestoreFractions = (None, None, None)   # last report's, kept at any age
        self.peers = (0, 0, 0)          # the peers' leases: (requests, prefill tokens, decode tokens)
        self.peer_time_s = -math.inf    # when they were last read (tracker clock)


class Lease:
    """One request's share of an endpoint's load. Use as a (async) context manager, or call
    `release()` in a `finally`; release is idempotent and gives back exactly what remains."""
    __slots__ = ("_changed", "_decode_tokens", "_load", "_prefill_tokens", "_released", "endpoint_id")

    def __init__(self, endpoint_id: str, load: _EndpointLoad, num_prompt_tokens: int,
                 num_expected_output_tokens: int, changed: set[str]) -> None:
        self.endpoint_id = endpoint_id
        self._load = load
        self._changed = changed   # the tracker's endpoints whose counts changed since last taken
        changed.add(endpoint_id)
        self._prefill_tokens = max(0, num_prompt_tokens)
        self._decode_tokens = max(0, num_expected_output_tokens)
        self._released = False
        load.num_requests += 1
        load.num_prefill_tokens += self._prefill_tokens
        load.num_decode_tokens += self._decode_tokens

    def prefill_done(self) -> None:
        """The prompt is processed (first token seen): its prefill tokens leave the count."""
        self._changed.add(self.endpoint_id)
        self._load.num_prefill_tokens -= self._prefill_tokens
        self._prefill_tokens = 0

    def on_output_tokens(self, num_tokens: int) -> None:
        """`num_tokens` more output tokens streamed; implies the prefill is done. Output beyond
        the estimate is simply not counted (the estimate never goes below zero)."""
        if self._prefill_tokens:
            self.prefill_done()
        taken = min(max(0, num_tokens), self._decode_tokens)
        self._changed.add(self.endpoint_id)
        self._decode_tokens -= taken
        self._load.num_decode_tokens -= taken

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.prefill_done()
        self._load.num_decode_tokens -= self._decode_tokens
        self._decode_tokens = 0
        self._load.num_requests -= 1

    @property
    def released(self) -> bool:
        return self._released

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.release()


class LoadTracker:
    """Per-endpoint requests and tokens in flight. One event loop: no locks needed, and every
    mutation is a plain synchronous step, so cancellation cannot interrupt one half-done."""

    def __init__(self, report_ttl_s: float = DEFAULT_REPORT_TTL_S,
                 clock: Callable[[], float] = time.monotonic, peer_ttl_s: float = DEFAULT_PEER_TTL_S) -> None:
        self._loads: dict[str, _EndpointLoad] = {}
        # Endpoints whose snapshot may have changed since `take_changed` (gateway/routing/live_pools.py keeps its
        # pools current from them), and when a peer's or a worker's figures go stale: (expiry, read at, ttl, id).
        self.changed: set[str] = set()
        self._expiries: list[tuple[float, float, float, str]] = []
        self._report_ttl_s = report_ttl_s
        self._peer_ttl_s = peer_ttl_s
        self._clock = clock

    def lease(self, endpoint_id: str, num_prompt_tokens: int,
              num_expected_output_tokens: int) -> Lease:
        """Count a request at `endpoint_id` from now until the lease is released."""
        return Lease(endpoint_id, self._load(endpoint_id), num_prompt_tokens,
                     num_expected_output_tokens, self.changed)

    def take_changed(self) -> set[str]:
        """The endpoints whose `snapshot` may differ from when this was last called: counts changed, or figures
        gone stale since (the caller re-reads their snapshots)."""
        now_s, expiries, changed = self._clock(), self._expiries, self.changed
        while expiries and now_s - expiries[0][1] > expiries[0][2]:   # as `snapshot` tests freshness
            changed.add(heapq.heappop(expiries)[3])
        taken = changed.copy()   # cleared in place: open leases hold this set
        changed.clear()
        return taken

    def _expires(self, endpoint_id: str, read_s: float, ttl_s: float) -> None:
        self.changed.add(endpoint_id)
        expiries = self._expiries
        while expiries and read_s - expiries[0][1] > expiries[0][2]:   # bounded even if nobody takes changes
            self.changed.add(heapq.heappop(expiries)[3])
        heapq.heappush(self._expiries, (read_s + ttl_s, read_s, ttl_s, endpoint_id))

    def snapshot(self, endpoint_id: str) -> tuple[int, int, int]:
        """(num_requests, num_prefill_tokens, num_decode_tokens) in flight at `endpoint_id`:
        our open leases, plus the peers' while fresh, plus what the last fresh worker report saw beyond."""
        load = self._loads.get(endpoint_id)
        if load is None:
            return (0, 0, 0)
        num_requests, num_prefill, num_decode = load.num_requests, load.num_prefill_tokens, load.num_decode_tokens
        now_s = self._clock()
        if now_s - load.peer_time_s <= self._peer_ttl_s:
            peer_requests, peer_prefill, peer_decode = load.peers
            num_requests += peer_requests
            num_prefill += peer_prefill
            num_decode += peer_decode
        if now_s - load.report_time_s <= self._report_ttl_s:
            num_requests += load.other_requests
            num_prefill += load.other_prefill_tokens
            num_decode += load.other_decode_tokens
        return (num_requests, num_prefill, num_decode)

    def local_snapshot(self, endpoint_id: str) -> tuple[int, int, int]:
        """Only this gateway's own leases (what it publishes to peers through the state store)."""
        load = self._loads.get(endpoint_id)
        if load is None:
            return (0, 0, 0)
        return (load.num_requests, load.num_prefill_tokens, load.num_decode_tokens)

    def kv_free_fraction(self, endpoint_id: str) -> float | None:
        """Free KV fraction from the last fresh worker report; None without one."""
        load = self._loads.get(endpoint_id)
        if load is None or self._clock() - load.report_time_s > self._report_ttl_s:
            return None
        return load.kv_free_fraction

    def prompt_tokens(self, endpoint_id: str) -> tuple[int, int] | None:
        """(prompt, cached) tokens over the worker's life, from its last report that had them (any age:
        they only grow); None when it never sent them (another engine, or no prompt yet)."""
        load = self._loads.get(endpoint_id)
        return None if load is None else load.prompt_tokens

    def restore_fractions(self, endpoint_id: str) -> RestoreFractions:
        """The worker's measured KV tier restore costs, (cpu, disk, store), from its last report that had
        them (any age: a measurement of its hardware, not a load)."""
        load = self._loads.get(endpoint_id)
        return (None, None, None) if load is None else load.restore_fractions

    def reconcile(self, endpoint_id: str, report: LoadReport | Mapping[str, Any]) -> None:
        """Blend in the worker's own view: whatever it has beyond our leases and the peers' (direct
        clients) is added to our counts until the report goes stale. Our own leases stay exact, so a
        late or lost report can never make a count drift or go negative."""
        if not isinstance(report, LoadReport):
            report = LoadReport.from_mapping(report)
        load = self._load(endpoint_id)
        peer_requests, peer_prefill, peer_decode = (
            load.peers if self._clock() - load.peer_time_s <= self._peer_ttl_s else (0, 0, 0))
        load.other_requests = max(0, report.num_running + report.num_waiting - load.num_requests - peer_requests)
        load.other_prefill_tokens = max(0, report.num_prefill_tokens_pending - load.num_prefill_tokens - peer_prefill)
        load.other_decode_tokens = max(0, report.num_decode_tokens_pending - load.num_decode_tokens - peer_decode)
        load.kv_free_fraction = report.kv_free_fraction
        if report.num_prompt_tokens:
            load.prompt_tokens = (report.num_prompt_tokens, report.num_cached_prompt_tokens)
        if any(f is not None for f in report.restore_fractions):
            load.restore_fractions = report.restore_fractions
        load.report_time_s = self._clock()
        self._expires(endpoint_id, load.report_time_s, self._report_ttl_s)

    def set_peer_load(self, endpoint_id: str, num_requests: int, num_prefill_tokens: int,
                      num_decode_tokens: int) -> None:
        """The other gateway processes' leases at `endpoint_id`, summed, as just read from the store."""
        load = self._load(endpoint_id)
        load.peers = (max(0, num_requests), max(0, num_prefill_tokens), max(0, num_decode_tokens))
        load.peer_time_s = self._clock()
        self._expires(endpoint_id, load.peer_time_s, self._peer_ttl_s)

    def forget(self, endpoint_id: str) -> None:
        """Drop an endpoint removed from the config; its open leases still release safely."""
        self._loads.pop(endpoint_id, None)
        self.changed.add(endpoint_id)

    def endpoint_ids(self) -> list[str]:
        return list(self._loads)

    def _load(self, endpoint_id: str) -> _EndpointLoad:
        load = self._loads.get(endpoint_id)
        if load is None:
            load = self._loads[endpoint_id] = _EndpointLoad()
        return load


class OutputLengthEstimator:
    """Expected output tokens per model: an exponential moving average of observed lengths,
    capped by the request's max_tokens. Bounded: the least recently seen models are forgotten."""

    def __init__(self, default_tokens: int = 256, smoothing: float = 0.1,
                 max_models: int = 1024) -> None:
        if default_tokens < 1 or not 0.0 < smoothing <= 1.0 or max_models < 1:
            raise ValueError("default_tokens >= 1, 0 < smoothing <= 1 and max_models >= 1 required")
        self._default_tokens = default_tokens
        self._smoothing = smoothing
        self._max_models = max_models
        self._means: OrderedDict[str, float] = OrderedDict()  # model -> EMA of output tokens

    def observe(self, model: str, num_output_tokens: int) -> None:
        """Record a finished request's output length."""
        n = max(0, num_output_tokens)
        mean = self._means.pop(model, None)
        self._means[model] = float(n) if mean is None else mean + self._smoothing * (n - mean)
        if len(self._means) > self._max_models:
            self._means.popitem(last=False)

    def estimate(self, model: str, max_tokens: int | None) -> int:
        """Expected output tokens for a new request to `model` (at least 1, at most max_tokens)."""
        mean = self._means.get(model)
        expected = self._default_tokens if mean is None else max(1, math.ceil(mean))
        if max_tokens is not None:
            expected = min(expected, max(1, max_tokens))
        return expected
