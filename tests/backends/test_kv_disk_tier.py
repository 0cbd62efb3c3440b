"""The disk tier's start in a directory that other namespaces share (backends/kv_connectors/tiers/disk.py): it
adopts only its own blocks, and says what the others hold without reading or deleting them."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from backends.kv_connectors.tiers.disk import DiskTier

BLOCK_NBYTES = 4096


def test_other_namespaces_are_counted_not_adopted_nor_deleted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    old = DiskTier(tmp_path, "old-weights", 16 * (BLOCK_NBYTES + 64), BLOCK_NBYTES)
    data = np.arange(BLOCK_NBYTES, dtype=np.uint8)
    assert old.put(11, memoryview(data)) and old.put(12, memoryview(data))
    (tmp_path / "not-a-namespace").mkdir()                # no block files: not counted
    (tmp_path / "notes.txt").write_text("a file beside the namespaces")
    os.symlink(tmp_path / "gone", tmp_path / "dangling")  # a dangling link: skipped
    with caplog.at_level(logging.WARNING, logger="backends.kv_connectors.tiers.disk"):
        new = DiskTier(tmp_path, "new-weights", 16 * (BLOCK_NBYTES + 64), BLOCK_NBYTES)
    assert new.leading_hits([11, 12]) == 0 and new.usage().num_blocks == 0
    assert f"also holds 2 blocks ({2 * old.file_nbytes / 2**30:.2f} GiB) of 1 other namespaces (old-weights)" \
        in caplog.text
    out = np.empty(BLOCK_NBYTES, dtype=np.uint8)
    assert old.get(11, memoryview(out)) and np.array_equal(out, data)   # still there for whoever uses them
