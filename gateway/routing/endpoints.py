"""The endpoint registry (one `Endpoint` per upstream base URL, its circuit breaker and last reports) and the
background pollers that keep it fresh: health, the worker's `/load` (or vLLM's `/metrics`), and `/kv_events`
for the prefix index. A pool's `dns+http://` entries become endpoints as DNS names them (gateway/config/discovery.py):
added with their pollers, retired (pollers stopped, load and prefix index forgotten) when no pool lists them.

Pollers only observe; they never route. Each loop catches and logs its own errors (a boundary): a bad
answer (an HTTP error, a body that does not parse) is a warning once per endpoint and poller until that
poller succeeds again; an unreachable endpoint is the health poller's to report. Every failure is
counted (switchyard_poll_failures_total).

Circuit breakers: one per endpoint, open after N consecutive failures, one half-open probe after a cool-down; a
Retry-After holds the endpoint off until then. `eligible()` never ejects every endpoint at once: if all would be
open, the least-recently-failed one stays eligible. The breaker's clock is injected for tests; no I/O.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from enum import IntEnum

import aiohttp
import orjson

from cache.kv_events import KvEventBatch
from cache.prefix_index import PrefixIndex
from gateway.config.discovery import Discovery, DnsName, Resolver, is_discovered, resolve
from gateway.config.gateway_config import BreakerConfig, GatewayConfig, Pool, ProviderConfig
from gateway.routing.load import LoadReport, LoadTracker, RestoreFractions
from gateway.routing.prefix_feed import index_block_size, on_load_report, track_approximate
from gateway.routing.vllm_metrics import load_report_from_metrics
from gateway.telemetry.metrics import EndpointRow, PollFailureRow

log = logging.getLogger(__name__)


class CircuitState(IntEnum):
    CLOSED = 0      # traffic flows
    HALF_OPEN = 1   # cool-down over: one probe at a time decides
    OPEN = 2        # ejected until the cool-down ends


_CLOSED = CircuitState.CLOSED   # an IntEnum member read on a hot path: looked up once


class CircuitBreaker:
    """One endpoint's breaker. Not thread-safe: it lives on the event loop."""

    __slots__ = ("_clock", "_config", "_failures", "_held_until", "_last_failure_at", "_on_change", "_on_update",
                 "_opened_at", "_probe_in_flight", "_state", "endpoint_id")

    def __init__(self, endpoint_id: str, config: BreakerConfig, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[str, CircuitState], None] | None = None,
                 on_update: Callable[[str], None] | None = None) -> None:
        self.endpoint_id = endpoint_id
        self._config = config
        self._clock = clock
        self._failures = 0
        self._opened_at = 0.0
        self._last_failure_at = float("-inf")
        self._held_until = float("-inf")
        self._probe_in_flight = False
        self._state = CircuitState.CLOSED
        self._on_change = on_change
        self._on_update = on_update   # told of a state change or a hold-off (live_pools.py re-reads the breaker)

    @property
    def state(self) -> CircuitState:
        if self._state is CircuitState.OPEN and self._clock() - self._opened_at >= self._config.cooldown_s:
            self._set(CircuitState.HALF_OPEN)
            self._probe_in_flight = False
        return self._state

    @property
    def last_failure_at(self) -> float:
        return self._last_failure_at

    def allows(self) -> bool:
        """May a request be sent now? (A half-open breaker admits one probe at a time.)"""
        if self._held_until > self._clock():
            return False
        state = self.state
        if state is CircuitState.CLOSED:
            return True
        return state is CircuitState.HALF_OPEN and not self._probe_in_flight

    def is_closed(self) -> bool:
        """Closed and not held off: traffic flows with no probe or wait (a pool's live view counts it usable)."""
        return self._state is _CLOSED and self._held_until <= self._clock()

    def on_attempt(self) -> None:
        """Called when a request is actually sent; marks the half-open probe as taken."""
        if self.state is CircuitState.HALF_OPEN:
            self._probe_in_flight = True

    def hold_off(self, seconds: float) -> None:
        """The endpoint asked for no requests for `seconds` (its Retry-After, capped by the caller)."""
        if seconds > 0:
            self._held_until = max(self._held_until, self._clock() + seconds)
            if self._on_update is not None:
                self._on_update(self.endpoint_id)

    def on_success(self) -> None:
        self._failures = 0
        self._probe_in_flight = False
        if self._state is not CircuitState.CLOSED:
            self._set(CircuitState.CLOSED)

    def on_failure(self) -> None:
        now = self._clock()
        self._failures += 1
        self._last_failure_at = now
        self._probe_in_flight = False
        if self._state is CircuitState.HALF_OPEN or self._failures >= self._config.failure_threshold:
            self._opened_at = now
            self._set(CircuitState.OPEN)

    def _set(self, state: CircuitState) -> None:
        if state is not self._state:
            self._state = state
            if self._on_update is not None:
                self._on_update(self.endpoint_id)
            if self._on_change is not None:
                self._on_change(self.endpoint_id, state)


def eligible(breakers: Sequence[CircuitBreaker]) -> list[CircuitBreaker]:
    """The breakers that admit a request; if none does, the least-recently-failed one (never zero)."""
    allowed = [b for b in breakers if b.allows()]
    if allowed or not breakers:
        return allowed
    return [min(breakers, key=lambda b: b.last_failure_at)]


class Endpoint:
    """Runtime state of one upstream server (shared by every provider that lists its URL)."""

    __slots__ = ("_changed", "_healthy", "breaker", "endpoint_id", "failing_polls", "health_checked", "kv_since",
                 "poll_failures", "weights")

    def __init__(self, endpoint_id: str, breaker: CircuitBreaker, changed: set[str] | None = None) -> None:
        self.endpoint_id = endpoint_id
        self.breaker = breaker
        self._changed = set() if changed is None else changed   # told when `healthy` changes (live_pools.py)
        self._healthy = True             # optimistic until a health check says otherwise
        self.health_checked = False      # a health check has succeeded at least once (for /ready)
        self.kv_since = 0                # the `next` cursor of /kv_events
        self.poll_failures: dict[tuple[str, str], int] = {}  # (poller, cause) -> failures so far
        self.failing_polls: set[str] = set()  # pollers whose bad answer was logged, not yet followed by a success
        self.weights = ""                # its weights' fingerprint, as its last /load said ("": not said)

    @property
    def healthy(self) -> bool:
        return self._healthy

    @healthy.setter
    def healthy(self, healthy: bool) -> None:
        if healthy != self._healthy:
            self._healthy = healthy
            self._changed.add(self.endpoint_id)


class UpstreamRegistry:
    """Endpoints by id and by provider pool; owns the pollers' tasks and the DNS lookups'."""

    def __init__(self, config: GatewayConfig, tracker: LoadTracker, prefix_index: PrefixIndex,
                 on_circuit_change: Callable[[str, CircuitState], None] | None = None,
                 resolver: Resolver = resolve) -> None:
        self._config = config
        self._tracker = tracker
        self._prefix_index = prefix_index
        self._on_circuit_change = on_circuit_change
        self.endpoints: dict[str, Endpoint] = {}
        self.pools: dict[tuple[str, Pool], list[Endpoint]] = {}   # by (provider name, pool)
        self.pools_version = 0   # counts the pools' changes (DNS), for those that keep a view of them
        self.discoveries: list[Discovery] = []
        # Per pool: what its DNS entries name now, by entry (an address its static URLs list stays either way).
        self._named: dict[tuple[str, Pool], dict[str, set[str]]] = {}
        for provider in config.providers.values():
            for pool, urls in provider.pools().items():
                self.pools[(provider.name, pool)] = [self._endpoint(url) for url in urls if not is_discovered(url)]
                self._named[(provider.name, pool)] = {url: set() for url in urls if is_discovered(url)}
                self.discoveries.extend(
                    Discovery(DnsName.parse(url), functools.partial(self._discovered, provider, pool, url), resolver)
                    for url in urls if is_discovered(url))
        self._session: aiohttp.ClientSession | None = None
        self._polled: dict[str, dict[str, asyncio.Task[None]]] = {}   # endpoint id -> poller name -> its task
        self._tasks: list[asyncio.Task[None]] = []                      # the DNS lookups

    def _endpoint(self, url: str) -> Endpoint:
        endpoint = self.endpoints.get(url)
        if endpoint is None:
            changed = self._tracker.changed   # what live_pools.py re-reads: health and circuits, as loads
            endpoint = Endpoint(url, CircuitBreaker(url, self._config.breaker, on_change=self._on_circuit_change,
                                                    on_update=changed.add), changed)
            self.endpoints[url] = endpoint
        return endpoint

    def rows(self) -> Iterable[EndpointRow]:
        """For the metrics collector: in-flight load and circuit state per endpoint."""
        for endpoint in self.endpoints.values():
            num_requests, num_prefill, num_decode = self._tracker.snapshot(endpoint.endpoint_id)
            yield endpoint.endpoint_id, num_requests, num_prefill, num_decode, endpoint.breaker.state

    def poll_failure_rows(self) -> Iterable[PollFailureRow]:
        """For the metrics collector: failed polls per endpoint, poller and cause."""
        for endpoint in self.endpoints.values():
            for (poller, cause), count in endpoint.poll_failures.items():
                yield endpoint.endpoint_id, poller, cause, count

    def kv_free_fraction(self, endpoint_id: str) -> float | None:
        """For the status page: free KV from the endpoint's last fresh /load report; None without one."""
        return self._tracker.kv_free_fraction(endpoint_id)

    def prompt_tokens(self, endpoint_id: str) -> tuple[int, int] | None:
        """For the status page: the endpoint's lifetime (prompt, prefix-cached) tokens from /load, if it sends them."""
        return self._tracker.prompt_tokens(endpoint_id)

    def restore_fractions(self, endpoint_id: str) -> RestoreFractions:
        """For the status page: the (cpu, disk, store) restore costs the endpoint's worker last reported."""
        return self._tracker.restore_fractions(endpoint_id)

    def num_indexed_blocks(self, endpoint_id: str) -> int:
        """For the status page: prefix-cache blocks the gateway's index holds for the endpoint."""
        return self._prefix_index.num_blocks(endpoint_id)

    def pool(self, provider_name: str, pool: Pool = Pool.MAIN) -> list[Endpoint]:
        return self.pools.get((provider_name, pool), [])

    def is_ready(self, providers: Iterable[str]) -> bool:
        """One of these providers has, in each of its pools, an endpoint that passed a health check (or has none)."""
        return any(all(any(e.healthy and e.health_checked for e in self.pools[(p, pool)])
                       for pool in self._config.providers[p].pools())
                   for p in providers)

    def _provider_endpoints(self, provider_name: str) -> list[Endpoint]:
        return [e for (name, _), pool in self.pools.items() if name == provider_name for e in pool]

    # --- pollers -----------------------------------------------------------------------------------

    def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        for provider in self._config.providers.values():
            for endpoint in self._provider_endpoints(provider.name):
                self._start_pollers(endpoint, provider)
        interval_s = self._config.pollers.discovery_interval_s
        self._tasks.extend(asyncio.create_task(discovery.run(interval_s)) for discovery in self.discoveries)
        log.debug("started pollers for %d endpoints (timeout %.1fs), %d DNS lookups", len(self._polled),
                  self._config.pollers.timeout_s, len(self._tasks))

    def _start_pollers(self, endpoint: Endpoint, provider: ProviderConfig) -> None:
        """The pollers `provider` asks for that `endpoint` does not have yet (another provider may list it)."""
        assert self._session is not None
        if provider.health_path is None:
            endpoint.health_checked = True
        polled = self._polled.setdefault(endpoint.endpoint_id, {})
        for name, wanted, interval, poll in self._poll_kinds(provider):
            if wanted and name not in polled:
                polled[name] = asyncio.create_task(self._loop(name, endpoint, interval, poll, self._session, provider))

    def _discovered(self, provider: ProviderConfig, pool: Pool, entry: str, urls: list[str]) -> None:
        """The DNS entry `entry` of `provider`'s `pool` names `urls` now: the pool gains the endpoints no entry
        or static URL listed before, and loses those none lists any more."""
        named = self._named[(provider.name, pool)]
        before = set().union(*named.values())
        named[entry] = set(urls)
        now = set().union(*named.values())
        listed = self.pools[(provider.name, pool)]
        self.pools_version += 1
        static = {url for url in provider.pools()[pool] if not is_discovered(url)}
        for url in sorted(now - before - static):
            endpoint = self._endpoint(url)
            listed.append(endpoint)
            if not provider.offers_kv_events:
                track_approximate(self._prefix_index, url, provider, index_block_size(self._config))
            if self._session is not None:
                self._start_pollers(endpoint, provider)
            log.info("endpoint %s discovered for %s", url, provider.name)
        for url in sorted(before - now - static):
            listed[:] = [e for e in listed if e.endpoint_id != url]
            log.info("endpoint %s is gone from DNS for %s", url, provider.name)
            if not any(e.endpoint_id == url for pool_endpoints in self.pools.values() for e in pool_endpoints):
                self._retire(url)

    def _retire(self, url: str) -> None:
        """No pool lists `url` any more: its pollers stop, and what the gateway knew of it is forgotten (a
        request in flight there holds its own `Endpoint` and lease, and ends as it would)."""
        for task in self._polled.pop(url, {}).values():
            task.cancel()
        del self.endpoints[url]
        self._tracker.forget(url)
        self._prefix_index.forget(url)

    def _poll_kinds(self, provider: ProviderConfig) -> list[tuple[str, bool, float, Callable[..., Awaitable[None]]]]:
        pollers = self._config.pollers
        return [
            ("health", provider.health_path is not None, pollers.health_interval_s, self._poll_health),
            ("load", provider.offers_load, pollers.load_interval_s, self._poll_load),
            ("kv_events", provider.offers_kv_events, pollers.kv_events_interval_s, self._poll_kv_events),
            ("vllm_metrics", provider.offers_vllm_metrics, pollers.load_interval_s, self._poll_vllm_metrics),
        ]

    async def stop(self) -> None:
        tasks = [*self._tasks, *(task for polled in self._polled.values() for task in polled.values())]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._polled.clear()

    async def _loop(self, name: str, endpoint: Endpoint, interval_s: float,
                    poll: Callable[..., Awaitable[None]], session: aiohttp.ClientSession,
                    provider: ProviderConfig) -> None:
        client_timeout = aiohttp.ClientTimeout(total=self._config.pollers.timeout_s)
        while True:
            try:
                await poll(endpoint, session, client_timeout, provider)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a poller must survive any upstream misbehaviour
                _on_poll_failure(name, endpoint, exc)
                if name == "health":
                    endpoint.healthy = False
            else:
                if name in endpoint.failing_polls:
                    endpoint.failing_polls.discard(name)
                    log.info("%s poll of %s succeeds again", name, endpoint.endpoint_id)
            await asyncio.sleep(interval_s)

    async def _poll_health(self, endpoint: Endpoint, session: aiohttp.ClientSession,
                           client_timeout: aiohttp.ClientTimeout, provider: ProviderConfig) -> None:
        url = endpoint.endpoint_id + (provider.health_path or "")
        async with session.get(url, timeout=client_timeout, headers=provider.auth_headers()) as response:
            await response.read()
            healthy = response.status == 200
        if healthy != endpoint.healthy:
            log.warning("endpoint %s is now %s", endpoint.endpoint_id, "healthy" if healthy else "unhealthy")
        endpoint.healthy = healthy
        endpoint.health_checked = endpoint.health_checked or healthy

    async def _poll_load(self, endpoint: Endpoint, session: aiohttp.ClientSession,
                         client_timeout: aiohttp.ClientTimeout, provider: ProviderConfig) -> None:
        payload = await _get_json(session, f"{endpoint.endpoint_id}/load", client_timeout, provider)
        report = LoadReport.from_mapping(payload)
        endpoint.weights = report.weights
        self._on_report(endpoint.endpoint_id, report)

    async def _poll_vllm_metrics(self, endpoint: Endpoint, session: aiohttp.ClientSession,
                                 client_timeout: aiohttp.ClientTimeout, provider: ProviderConfig) -> None:
        async with session.get(f"{endpoint.endpoint_id}/metrics", timeout=client_timeout,
                               headers=provider.auth_headers()) as response:
            text = await response.text()
            if response.status != 200:
                raise RuntimeError(f"GET {endpoint.endpoint_id}/metrics: HTTP {response.status}")
        self._on_report(endpoint.endpoint_id, load_report_from_metrics(text))

    def _on_report(self, endpoint_id: str, report: LoadReport) -> None:
        self._tracker.reconcile(endpoint_id, report)
        on_load_report(self._prefix_index, endpoint_id, report, index_block_size(self._config))

    async def _poll_kv_events(self, endpoint: Endpoint, session: aiohttp.ClientSession,
                              client_timeout: aiohttp.ClientTimeout, provider: ProviderConfig) -> None:
        while True:  # drain: a busy worker can have more than one page of events
            url = f"{endpoint.endpoint_id}/kv_events?since={endpoint.kv_since}"
            payload = await _get_json(session, url, client_timeout, provider)
            batch = KvEventBatch.from_mapping(payload)
            self._prefix_index.apply_batch(endpoint.endpoint_id, batch)
            next_since = batch.next_seq
            if not batch.events or next_since == endpoint.kv_since:
                endpoint.kv_since = next_since
                return
            endpoint.kv_since = next_since


def _on_poll_failure(name: str, endpoint: Endpoint, exc: Exception) -> None:
    """Count the failure; warn about a bad answer once until the poller succeeds again (a mismatched
    contract fails every poll, and must not go unnoticed nor flood the log)."""
    unreachable = isinstance(exc, (aiohttp.ClientConnectionError, TimeoutError))
    key = (name, "unreachable" if unreachable else "bad_response")
    endpoint.poll_failures[key] = endpoint.poll_failures.get(key, 0) + 1
    if unreachable or name in endpoint.failing_polls:
        log.debug("%s poll of %s failed: %r", name, endpoint.endpoint_id, exc)
        return
    endpoint.failing_polls.add(name)
    log.warning("%s poll of %s failed: %r (repeats are logged at debug level until it succeeds; "
                "counted in switchyard_poll_failures_total)", name, endpoint.endpoint_id, exc)


async def _get_json(session: aiohttp.ClientSession, url: str, client_timeout: aiohttp.ClientTimeout,
                    provider: ProviderConfig) -> Mapping[str, object]:
    async with session.get(url, timeout=client_timeout, headers=provider.auth_headers()) as response:
        body = await response.read()
        if response.status != 200:
            raise RuntimeError(f"GET {url}: HTTP {response.status}")
    payload = orjson.loads(body)
    if not isinstance(payload, dict):
        raise RuntimeError(f"GET {url}: expected a JSON object")
    return payload
