"""LoadTracker leases never drift or go negative (hypothesis state machine against an independent
model, asyncio cancellation), worker reports blend in and expire; OutputLengthEstimator."""
from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gateway.routing.load import LoadReport, LoadTracker, OutputLengthEstimator

ENDPOINTS = ("http://a:1", "http://b:2", "http://c:3")


class LeaseMachine(RuleBasedStateMachine):
    """Random interleavings of open / prefill done / output tokens / release / double release.
    The model tracks each lease's remaining prefill and decode tokens by plain arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.tracker = LoadTracker()
        self.leases: list = []  # (lease, model dict) for every lease ever opened

    @rule(endpoint=st.sampled_from(ENDPOINTS), prompt=st.integers(-5, 5000), output=st.integers(-5, 2000))
    def open(self, endpoint: str, prompt: int, output: int) -> None:
        lease = self.tracker.lease(endpoint, prompt, output)
        self.leases.append((lease, {"ep": endpoint, "prefill": max(0, prompt),
                                    "decode": max(0, output), "open": True}))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def prefill_done(self, data: st.DataObject) -> None:
        lease, model = data.draw(st.sampled_from(self.leases))
        lease.prefill_done()
        model["prefill"] = 0

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), n=st.integers(-3, 700))
    def output_tokens(self, data: st.DataObject, n: int) -> None:
        lease, model = data.draw(st.sampled_from(self.leases))
        lease.on_output_tokens(n)
        if model["open"]:
            model["prefill"] = 0
            model["decode"] = max(0, model["decode"] - max(0, n))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:  # drawing an already released one: idempotence
        lease, model = data.draw(st.sampled_from(self.leases))
        lease.release()
        model.update(prefill=0, decode=0, open=False)

    @invariant()
    def counts_match_model_and_are_non_negative(self) -> None:
        for endpoint in ENDPOINTS:
            mine = [m for _, m in self.leases if m["ep"] == endpoint]
            expected = (sum(m["open"] for m in mine), sum(m["prefill"] for m in mine),
                        sum(m["decode"] for m in mine))
            got = self.tracker.snapshot(endpoint)
            assert got == expected and min(got) >= 0

    def teardown(self) -> None:
        for lease, _ in self.leases:
            lease.release()
        for endpoint in ENDPOINTS:
            assert self.tracker.snapshot(endpoint) == (0, 0, 0)


LeaseMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestLeaseMachine = LeaseMachine.TestCase


async def test_cancelled_and_failing_requests_release_their_leases() -> None:
    tracker = LoadTracker()
    rng = random.Random(5)

    async def request(i: int) -> None:
        async with tracker.lease(ENDPOINTS[i % 3], 100 + i, 50) as lease:
            await asyncio.sleep(rng.random() * 0.01)
            lease.prefill_done()
            for _ in range(5):
                await asyncio.sleep(rng.random() * 0.002)
                lease.on_output_tokens(3)
            if i % 7 == 0:
                raise RuntimeError("upstream failed")

    tasks = [asyncio.create_task(request(i)) for i in range(90)]
    await asyncio.sleep(0)  # one turn of the loop: every task has taken its lease and awaits its first sleep
    assert sum(tracker.snapshot(e)[0] for e in ENDPOINTS) == 90
    for task in tasks[::2]:
        task.cancel()  # client went away mid-request
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert any(isinstance(r, asyncio.CancelledError) for r in results)
    assert any(isinstance(r, RuntimeError) for r in results)
    for endpoint in ENDPOINTS:
        assert tracker.snapshot(endpoint) == (0, 0, 0)


def test_sync_context_manager_releases_on_error() -> None:
    tracker = LoadTracker()
    with pytest.raises(KeyError), tracker.lease("a", 10, 20) as lease:
        assert tracker.snapshot("a") == (1, 10, 20)
        lease.on_output_tokens(5)  # first token: prefill done
        assert tracker.snapshot("a") == (1, 0, 15)
        raise KeyError("boom")
    assert lease.released and tracker.snapshot("a") == (0, 0, 0)


def report(**fields: object) -> dict[str, object]:
    base = dict(num_running=0, num_waiting=0, num_prefill_tokens_pending=0, num_decode_tokens_pending=0,
                num_free_blocks=75, num_total_blocks=100, num_cached_blocks=10, block_size=16)
    return {**base, **fields}


def test_reports_add_other_load_until_stale_and_never_subtract_ours() -> None:
    now = [100.0]
    tracker = LoadTracker(report_ttl_s=5.0, clock=lambda: now[0])
    lease = tracker.lease("a", 300, 40)
    # the worker also serves a peer's 2 requests: 3 running/waiting, 1300 prefill, 240 decode
    tracker.reconcile("a", report(num_running=2, num_waiting=1, num_prefill_tokens_pending=1300,
                                  num_decode_tokens_pending=240))
    assert tracker.snapshot("a") == (3, 1300, 240)
    assert tracker.local_snapshot("a") == (1, 300, 40)
    assert tracker.kv_free_fraction("a") == 0.75
    # a report that has not yet seen our request adds nothing and subtracts nothing
    tracker.reconcile("a", report())
    assert tracker.snapshot("a") == (1, 300, 40)
    tracker.reconcile("a", report(num_running=5, num_decode_tokens_pending=1000))
    now[0] += 5.1  # stale: only our own leases count
    assert tracker.snapshot("a") == (1, 300, 40) and tracker.kv_free_fraction("a") is None
    lease.release()
    assert tracker.snapshot("a") == (0, 0, 0)
    assert tracker.snapshot("never-seen") == (0, 0, 0)


def test_prompt_token_counts_are_optional_and_kept_from_the_last_report_that_had_them() -> None:
    tracker = LoadTracker()
    tracker.reconcile("vllm", report())                 # another engine: no counts
    assert tracker.prompt_tokens("vllm") is None and tracker.prompt_tokens("never-seen") is None
    tracker.reconcile("a", report(num_prompt_tokens=1000, num_cached_prompt_tokens=640))
    assert tracker.prompt_tokens("a") == (1000, 640)
    tracker.reconcile("a", report())                    # a report without them keeps the last known
    assert tracker.prompt_tokens("a") == (1000, 640)


def test_tier_restore_fractions_are_read_by_medium_and_kept_from_the_last_report_that_had_them() -> None:
    tracker = LoadTracker()
    assert tracker.restore_fractions("never-seen") == (None, None, None)
    tiers = [{"medium": "cpu", "num_blocks": 3, "restore_fraction": 0.03},
             {"medium": "disk", "num_blocks": 9, "restore_fraction": None},    # not measured yet
             {"medium": "store", "num_blocks": -1, "restore_fraction": 0},
             {"medium": "tape", "restore_fraction": 0.5}]                        # a medium we do not route by
    tracker.reconcile("a", report(kv_tiers=tiers))
    assert tracker.restore_fractions("a") == (0.03, None, 0.0)
    tracker.reconcile("a", report(kv_tiers=[{"medium": "cpu"}]))    # no figure now: the last one stays
    tracker.reconcile("a", report())
    assert tracker.restore_fractions("a") == (0.03, None, 0.0)
    tracker.reconcile("a", report(kv_tiers=[{"medium": "disk", "restore_fraction": 0.05}]))
    assert tracker.restore_fractions("a") == (None, 0.05, None)


@pytest.mark.parametrize("bad", [report(num_running=-1), report(block_size="16"),
                                 {k: v for k, v in report().items() if k != "num_waiting"},
                                 report(num_free_blocks=True), report(num_cached_prompt_tokens=-5),
                                 report(kv_tiers={"medium": "cpu"}), report(kv_tiers=["cpu"]),
                                 report(kv_tiers=[{"medium": "cpu", "restore_fraction": -0.1}]),
                                 report(kv_tiers=[{"medium": "disk", "restore_fraction": "0.1"}]),
                                 report(kv_tiers=[{"medium": "disk", "restore_fraction": float("nan")}]),
                                 report(weights=7)])
def test_malformed_reports_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        LoadTracker().reconcile("a", bad)


def test_the_weights_fingerprint_is_optional() -> None:
    assert LoadReport.from_mapping(report(weights="f00d")).weights == "f00d"
    assert LoadReport.from_mapping(report()).weights == ""      # another engine, or an older worker


def test_report_object_and_zero_block_fleet() -> None:
    tracker = LoadTracker()
    tracker.reconcile("a", LoadReport.from_mapping(report(num_total_blocks=0, num_free_blocks=0)))
    assert tracker.kv_free_fraction("a") is None


def test_forgotten_endpoint_leases_still_release_safely() -> None:
    tracker = LoadTracker()
    lease = tracker.lease("a", 10, 10)
    tracker.forget("a")
    new = tracker.lease("a", 1, 1)
    lease.release()
    assert tracker.snapshot("a") == (1, 1, 1)
    new.release()
    assert tracker.snapshot("a") == (0, 0, 0)


def test_output_length_estimator() -> None:
    est = OutputLengthEstimator(default_tokens=256, smoothing=0.5, max_models=2)
    assert est.estimate("m", None) == 256 and est.estimate("m", 16) == 16 and est.estimate("m", 0) == 1
    est.observe("m", 100)
    assert est.estimate("m", None) == 100  # the first observation seeds the average
    est.observe("m", 200)
    assert est.estimate("m", None) == 150 and est.estimate("m", 120) == 120
    est.observe("m", 0)
    assert est.estimate("m", None) == 75
    est.observe("x", 10)
    est.observe("y", 10)  # bounded: "m" (least recently observed) is forgotten
    assert est.estimate("m", None) == 256 and est.estimate("x", None) == 10
    with pytest.raises(ValueError):
        OutputLengthEstimator(smoothing=0.0)


def test_output_length_estimator_tracks_a_shifting_distribution() -> None:
    est, rng = OutputLengthEstimator(smoothing=0.1), random.Random(0)
    for _ in range(300):
        est.observe("m", rng.randint(50, 150))
    assert 80 <= est.estimate("m", None) <= 120
    for _ in range(300):
        est.observe("m", rng.randint(450, 550))
    assert 450 <= est.estimate("m", None) <= 550
