"""Each large pool's `FleetView` (policies/fleet_view.py), kept current from what changed rather than rebuilt per
request: the load tracker's changed endpoints and figures gone stale, health, circuits. What lets `Legs.choose`
route among 1,000 endpoints at a cost per changed endpoint, not per endpoint. A view is handed out only when its
usable endpoints are exactly the candidates `choose` would list (`view_for`); otherwise the caller lists them.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

from cache.prefix_index import PrefixIndex
from gateway.routing.endpoints import Endpoint, UpstreamRegistry
from gateway.routing.load import LoadTracker
from policies.fleet_view import FleetView, LoadUpdate

# Below this many endpoints a pool's states are listed per request, as before: cheap there, and the policies'
# random tie-breaks draw exactly as they always did.
MIN_ENDPOINTS = 32


class _LivePool:
    __slots__ = ("bits", "endpoints", "fleet", "ids", "mask", "suspects")

    def __init__(self, endpoints: list[Endpoint]) -> None:
        self.endpoints = endpoints                      # the registry's pool list (DNS changes it in place)
        self.ids = frozenset(e.endpoint_id for e in endpoints)
        self.fleet = FleetView([e.endpoint_id for e in endpoints])
        self.mask = 0                                   # the pool's bits in the prefix index
        self.bits: dict[str, int] = {}                  # each endpoint's bit there
        self.suspects: set[str] = set()                 # circuit not plainly closed: re-read at every use


class LivePools:
    """The registry's pools of at least `min_endpoints`, each as a `FleetView` kept current."""

    def __init__(self, registry: UpstreamRegistry, tracker: LoadTracker, prefix_index: PrefixIndex,
                 min_endpoints: float = MIN_ENDPOINTS) -> None:
        self.min_endpoints = min_endpoints   # float: `math.inf` turns the views off (benchmarks' baseline)
        self._registry = registry
        self._tracker = tracker
        self._index = prefix_index
        self._by_list: dict[int, _LivePool] = {}       # id(the registry's pool list) -> its view
        self._of_endpoint: dict[str, list[_LivePool]] = {}
        self._version = -1                             # the registry's pools_version the views were built for

    def view_for(self, pool: Sequence[Endpoint], tried: Collection[str]) -> FleetView | None:
        """`pool`'s view, current; None where listing the candidates is needed: a small or unknown pool, a tried
        endpoint in it, a circuit that admits a probe (half-open), or no usable endpoint. Its `tiered_mask` names
        the endpoints that hold KV tier blocks now."""
        if len(pool) < self.min_endpoints:
            return None
        self._sync()
        live = self._by_list.get(id(pool))
        if live is None or live.endpoints is not pool:
            return None
        if tried and not live.ids.isdisjoint(tried):
            return None
        for endpoint_id in list(live.suspects):
            breaker = self._registry.endpoints[endpoint_id].breaker
            if breaker.is_closed():
                self._update(live, self._registry.endpoints[endpoint_id])
            elif breaker.allows():
                return None   # a half-open probe may go there: `eligible` lists it
        if not live.fleet.usable_mask:
            return None
        live.fleet.tiered_mask = live.mask & self._index.tiered_mask
        return live.fleet

    def _sync(self) -> None:
        if self._registry.pools_version != self._version:
            self._rebuild()
            return
        changed = self._tracker.take_changed()
        if not changed:
            return
        endpoints, of_endpoint = self._registry.endpoints, self._of_endpoint
        snapshot = self._tracker.snapshot
        due: dict[_LivePool, list[LoadUpdate]] = {}   # each view's usable changed endpoints, with their loads
        for endpoint_id in changed:
            lives = of_endpoint.get(endpoint_id)
            if lives is None:   # in no large pool
                continue
            endpoint = endpoints.get(endpoint_id)
            for live in lives:
                if endpoint is None or not self._usable(live, endpoint):
                    live.fleet.discard(endpoint_id)
                    continue
                _, num_prefill, num_decode = snapshot(endpoint_id)
                due.setdefault(live, []).append((endpoint_id, live.bits[endpoint_id], num_prefill, num_decode))
        for live, updates in due.items():   # one batch per view: the loads, then every ordering of them
            live.fleet.put_many(updates)

    def _rebuild(self) -> None:
        self._version = self._registry.pools_version
        self._tracker.take_changed()
        self._by_list.clear()
        self._of_endpoint.clear()
        for endpoints in self._registry.pools.values():
            if len(endpoints) < self.min_endpoints:
                continue
            live = self._by_list[id(endpoints)] = _LivePool(endpoints)
            for endpoint in endpoints:
                bit = live.bits[endpoint.endpoint_id] = self._index.endpoint_bit(endpoint.endpoint_id)
                live.mask |= bit
                self._of_endpoint.setdefault(endpoint.endpoint_id, []).append(live)
                self._update(live, endpoint)

    def _update(self, live: _LivePool, endpoint: Endpoint) -> None:
        """Re-read one endpoint: usable with its load, or not."""
        if self._usable(live, endpoint):
            _, num_prefill, num_decode = self._tracker.snapshot(endpoint.endpoint_id)
            live.fleet.put(endpoint.endpoint_id, live.bits[endpoint.endpoint_id], num_prefill, num_decode)
        else:
            live.fleet.discard(endpoint.endpoint_id)

    @staticmethod
    def _usable(live: _LivePool, endpoint: Endpoint) -> bool:
        """Healthy, circuit closed and not held off; a circuit not plainly closed is re-read at every use."""
        if not endpoint.breaker.is_closed():
            live.suspects.add(endpoint.endpoint_id)
            return False
        if live.suspects:
            live.suspects.discard(endpoint.endpoint_id)
        return endpoint.healthy
