"""Sessions on a disaggregated provider: the model's `session_affinity` picks each turn's prefill worker (where
the session's prefix is cached) and keeps it there within the load bound, as on a unified pool
(tests/gateway/test_routing.py); real workers behind `switchyard serve`: tests/test_serve.py."""
from __future__ import annotations

from pathlib import Path

from tests.gateway.conftest import metric
from tests.gateway.test_pd import BODY, BUSY, LOAD_IDLE, Pd, post, wait_load_report


async def test_a_session_leaves_its_prefill_worker_only_when_that_is_over_the_load_bound(tmp_path: Path) -> None:
    pair = Pd(tmp_path, ["p1", "p2"], ["d1"], policy="session_affinity")
    try:
        gateway, prefill = pair.gateway, {fake.url: fake for fake in pair.prefill}

        async def turn() -> str:
            """One turn of the session; the prefill worker that took its prefill leg."""
            before = {url: fake.stats()["num_transfers"] for url, fake in prefill.items()}
            status, answer = await post(gateway.url, BODY, headers={"x-session-affinity": "agent-1"})
            assert status == 200, answer
            took = [url for url, fake in prefill.items() if fake.stats()["num_transfers"] > before[url]]
            assert len(took) == 1, took
            return took[0]

        home = await turn()
        assert await turn() == home
        prefill[home].control(load_report=BUSY)   # far over 1.25 x the mean load
        await wait_load_report(gateway, home, BUSY)
        moved_to = await turn()
        assert moved_to != home
        prefill[home].control(load_report=LOAD_IDLE)
        await wait_load_report(gateway, home, LOAD_IDLE)
        assert await turn() == moved_to   # re-homed: it stays where it went
        assert metric(gateway, "switchyard_session_moves_total") == 1
        for reason, count in (("affinity_new", 1), ("affinity_hit", 2), ("affinity_moved", 1)):
            assert metric(gateway, "switchyard_routing_decisions_total", reason=reason) == count, reason
    finally:
        pair.stop()
