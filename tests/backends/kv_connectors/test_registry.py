"""The KV-connector registry (backends/kv_connectors/registry.py) and the composite it builds
(multi.py): configured names to connector classes, in order; unknown names refused with the known ones;
a MultiConnector consults its connectors in order and hands the optional parts only to those that have them."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from backends.core.block_events import KVEventRing
from backends.core.engine_config import EngineConfig, KVConnectorName
from backends.core.outputs import LoadReport
from backends.core.sampling_params import SamplingParams
from backends.core.sequence import Sequence
from backends.kv_connectors.base import FinishedTransfers, KVConnector, LoadResult
from backends.kv_connectors.multi import MultiConnector, find_connector
from backends.kv_connectors.pd_connector import PDConnector
from backends.kv_connectors.registry import build_kv_connector, connector_factory
from backends.kv_connectors.tiers.connector import TieredKVConnector
from backends.worker.kv_cache import KVCache, KVCacheSpec

PD, TIERS = KVConnectorName.PD, KVConnectorName.TIERS
RAM = {"kv_cpu_bytes": 1 << 20}   # a host-RAM tier: enough for the tiers connector


@pytest.fixture
def build() -> Iterator[Callable[..., KVConnector | None]]:
    built: list[KVConnector | None] = []

    def make(**kw: object) -> KVConnector | None:
        config = EngineConfig(block_size=4, **kw)   # type: ignore[arg-type]
        cache = KVCache(KVCacheSpec(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=8,
                                    dtype=torch.float32), "cpu")
        built.append(build_kv_connector(config, cache, "fingerprint", KVEventRing(16)))
        return built[-1]

    yield make
    for connector in built:   # the tiers' writer and loader threads
        if isinstance(connector, TieredKVConnector | MultiConnector):
            connector.close()


@pytest.mark.parametrize("kw, classes", [
    ({}, None),
    ({"kv_connectors": (PD,)}, [PDConnector]),
    ({"kv_connectors": ("pd",)}, [PDConnector]),                       # the name as written in a config
    ({"kv_connectors": (TIERS,), **RAM}, [TieredKVConnector]),
    (RAM, [TieredKVConnector]),                                        # a tier implies the tiers connector
    ({"kv_connectors": (PD,), **RAM}, [PDConnector, TieredKVConnector]),   # a worker's: P/D first, as before
    ({"kv_connectors": (PD, TIERS), **RAM}, [PDConnector, TieredKVConnector]),
    ({"kv_connectors": (TIERS, PD), **RAM}, [TieredKVConnector, PDConnector]),   # the configured order
])
def test_names_build_their_connectors_in_order(build: Callable[..., KVConnector | None], kw: dict[str, object],
                                               classes: list[type] | None) -> None:
    connector = build(**kw)
    if classes is None:
        assert connector is None
    elif len(classes) == 1:
        assert type(connector) is classes[0]
    else:
        assert isinstance(connector, MultiConnector)
        assert [type(c) for c in connector.connectors] == classes
        for cls, part in zip(classes, connector.connectors, strict=True):
            assert find_connector(connector, cls) is part   # the typed lookup the server uses


def test_the_pd_connector_takes_the_hold_timeout(build: Callable[..., KVConnector | None]) -> None:
    connector = build(kv_connectors=(PD,), kv_hold_timeout_s=7.5)
    assert isinstance(connector, PDConnector) and connector.hold_timeout_s == 7.5
    assert find_connector(connector, PDConnector) is connector and find_connector(connector, TieredKVConnector) is None
    assert find_connector(None, PDConnector) is None


@pytest.mark.parametrize("make, message", [
    (lambda: connector_factory("lmcache"), r"unknown KV connector 'lmcache' \(known: pd, tiers\)"),
    (lambda: EngineConfig(kv_connectors=("pd", "nixl")), r"unknown KV connector .*\(known: pd, tiers\)"),  # type: ignore[arg-type]
    (lambda: EngineConfig(kv_connectors=(PD, PD)), "named twice"),
    (lambda: EngineConfig(kv_connectors=(TIERS,)), "needs a tier"),
])
def test_a_bad_list_is_refused_clearly(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("name, factory_name", [(PD, "build_pd_connector"), (TIERS, "build_tiered_connector")])
def test_each_name_has_one_factory(name: KVConnectorName, factory_name: str) -> None:
    assert connector_factory(name).__name__ == factory_name
    assert connector_factory(name.value) is connector_factory(name)


# --- the composite -----------------------------------------------------------------------------------

class Recorder:
    """A KVConnector that writes each call to a shared log; loads the sequences named in `loads`."""

    def __init__(self, name: str, log: list[tuple[str, str]], loads: tuple[str, ...] = (),
                 keeps: bool = False) -> None:
        self.name, self.log, self.loads, self.keeps = name, log, loads, keeps

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int | None:
        self.log.append((self.name, "match"))
        return 4 if seq.request_id in self.loads else None

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        self.log.append((self.name, "alloc"))

    def request_finished(self, seq: Sequence) -> bool:
        self.log.append((self.name, "finished"))
        return self.keeps

    def start_load_kv(self) -> None:
        self.log.append((self.name, "start"))

    def get_finished(self) -> FinishedTransfers:
        self.log.append((self.name, "report"))
        return FinishedTransfers((f"{self.name}-sent",), (LoadResult(f"{self.name}-loaded", None),))


class ObservingRecorder(Recorder):
    """A Recorder with every optional part (as the tiers have)."""

    def block_cached(self, block_id: int, block_hash: int) -> None:
        self.log.append((self.name, "cached"))

    def block_evicted(self, block_id: int, block_hash: int) -> None:
        self.log.append((self.name, "evicted"))

    def observe_compute(self, seconds_per_token: float | None) -> None:
        self.log.append((self.name, "compute"))

    def set_wake(self, wake: Callable[[], None]) -> None:
        self.log.append((self.name, "wake"))

    def add_to_report(self, report: LoadReport) -> LoadReport:
        self.log.append((self.name, "load"))
        return LoadReport(*([0] * 7), report.block_size + 1)

    def close(self) -> None:
        self.log.append((self.name, "close"))


def seq(request_id: str) -> Sequence:
    return Sequence(request_id, (1, 2, 3, 4, 5), SamplingParams(), seed=0)


def test_the_composite_calls_each_connector_in_order() -> None:
    log: list[tuple[str, str]] = []
    a, b, c = Recorder("a", log), ObservingRecorder("b", log, loads=("s",)), ObservingRecorder("c", log, loads=("s",))
    multi = MultiConnector(a, b, c)
    steps: list[tuple[Callable[[], object], list[tuple[str, str]]]] = [
        (lambda: multi.get_num_new_matched_tokens(seq("s"), 0), [("a", "match"), ("b", "match")]),  # b owns it
        (lambda: multi.update_state_after_alloc(seq("s"), 4), [("b", "alloc")]),
        (multi.start_load_kv, [("a", "start"), ("b", "start"), ("c", "start")]),
        (lambda: multi.request_finished(seq("s")), [("a", "finished"), ("b", "finished"), ("c", "finished")]),
        (lambda: multi.block_cached(0, 1), [("b", "cached"), ("c", "cached")]),   # a is no BlockObserver
        (lambda: multi.block_evicted(0, 1), [("b", "evicted"), ("c", "evicted")]),
        (lambda: multi.observe_compute(0.01), [("b", "compute"), ("c", "compute")]),
        (lambda: multi.set_wake(lambda: None), [("b", "wake"), ("c", "wake")]),
        (multi.close, [("b", "close"), ("c", "close")]),
    ]
    for call, expected in steps:
        log.clear()
        call()
        assert log == expected
    log.clear()
    finished = multi.get_finished()
    assert log == [("a", "report"), ("b", "report"), ("c", "report")]
    assert finished.sent == ("a-sent", "b-sent", "c-sent")
    assert [r.request_id for r in finished.loaded] == ["a-loaded", "b-loaded", "c-loaded"]
    assert multi.add_to_report(LoadReport(*([0] * 7), 16)).block_size == 18   # b's, then c's, on b's
    assert multi.get_num_new_matched_tokens(seq("other"), 0) is None


def test_the_composite_keeps_blocks_if_any_connector_keeps_them() -> None:
    log: list[tuple[str, str]] = []
    assert MultiConnector(Recorder("a", log), Recorder("b", log, keeps=True)).request_finished(seq("s"))
    assert not MultiConnector(Recorder("a", log), Recorder("b", log)).request_finished(seq("s"))
