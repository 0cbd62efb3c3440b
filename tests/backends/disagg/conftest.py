"""One set of real worker processes for the disaggregation tests in this folder (tests/backends/pd_cluster.py):
P1 (prefill), P2 (both: the unified reference, also in the prefill pool), D1-D3 (decode), behind one real
gateway. Prefill caches live in shared memory: D1 and D2 copy from them, D3 (started with
--no-kv-shared-memory) pulls over TCP, so both transports are checked.

The set lives for the package. test_transfer_faults.py kills workers, so it sorts after test_legs.py
(pytest collects a folder's files by name) and its killing tests run last, in file order.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.backends.pd_cluster import Cluster
from tests.backends.pd_references import unified_references
from tests.backends.references import Reference


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("pd-workers"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="package")
def references(cluster: Cluster, hf_smollm2: torch.nn.Module, hf_smollm2_f64: torch.nn.Module) -> list[Reference]:
    return unified_references(cluster.url("p2"), hf_smollm2, hf_smollm2_f64)
