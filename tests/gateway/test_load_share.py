"""Peer leases in the in-flight estimate (gateway/routing/load.py, gateway/routing/load_share.py) and the --workers rule
(gateway/ops/gateway_processes.py). Two trackers stand for two gateway processes; they share through a real store."""
from __future__ import annotations

import pytest

from gateway.ops.gateway_processes import WorkersError, resolve_workers
from gateway.routing.load import LoadTracker
from gateway.routing.load_share import LoadSharer
from gateway.state import MemoryStore
from tests.support.clock import ManualClock

E = "http://w:1"


def test_snapshot_adds_fresh_peer_leases_and_drops_stale_ones() -> None:
    clock = ManualClock()
    tracker = LoadTracker(clock=clock, peer_ttl_s=2.0)
    with tracker.lease(E, 100, 20):
        tracker.set_peer_load(E, 3, 50, 60)
        assert tracker.snapshot(E) == (4, 150, 80)
        assert tracker.local_snapshot(E) == (1, 100, 20)
        clock.now += 2.5
        assert tracker.snapshot(E) == (1, 100, 20)


def test_a_report_adds_only_what_neither_we_nor_peers_hold() -> None:
    tracker = LoadTracker(clock=ManualClock())
    with tracker.lease(E, 0, 10):
        tracker.set_peer_load(E, 2, 0, 30)
        tracker.reconcile(E, {"num_running": 4, "num_waiting": 1, "num_prefill_tokens_pending": 0,
                              "num_decode_tokens_pending": 70, "num_free_blocks": 1, "num_total_blocks": 2,
                              "num_cached_blocks": 0, "block_size": 16})
        assert tracker.snapshot(E) == (5, 0, 70)  # the worker's own view: ours 1 + peers 2 + direct 2


async def test_two_processes_see_each_others_leases_through_the_store() -> None:
    store = MemoryStore()
    a, b = LoadTracker(), LoadTracker()
    share_a = LoadSharer(a, store, lambda: [E], interval_s=0.25)
    share_b = LoadSharer(b, store, lambda: [E], interval_s=0.25)
    lease_a, lease_b = a.lease(E, 10, 5), b.lease(E, 20, 7)
    for sharer in (share_a, share_b, share_a):
        await sharer.share_once()
    assert a.snapshot(E) == b.snapshot(E) == (2, 30, 12)
    lease_b.release()
    await share_b.share_once()
    await share_a.share_once()
    assert a.snapshot(E) == (1, 10, 5)
    lease_a.release()


def test_workers_rule() -> None:
    assert resolve_workers(1, None) == 1
    assert resolve_workers(None, None) == 1
    assert 1 <= resolve_workers(None, "redis://r:6379/0") <= 4
    assert resolve_workers(3, "redis://r:6379/0") == 3
    with pytest.raises(WorkersError, match="redis_url"):
        resolve_workers(2, None)
    with pytest.raises(WorkersError):
        resolve_workers(0, "redis://r:6379/0")
