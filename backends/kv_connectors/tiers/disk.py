"""The local-disk tier: one file per block under `<dir>/<namespace>/`, framed with its hash and a
checksum (base.frame), LRU by use within `capacity_bytes` (the last local tier: what it evicts is
gone). Files are written to a temporary name and renamed, so a reader sees a whole file or none; a
torn or corrupt one fails its checksum, is deleted and counts as a miss. Files of an earlier run in
the same namespace are adopted at start.

Threads: `put` runs in the writer thread, `get` in the loader thread; the index is under a lock and
file I/O outside it (a file deleted while it is read is a miss).
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from backends.core.block_events import DISK
from backends.kv_connectors.tiers.base import HEADER_BYTES, TierUsage, check_frame, frame_header, leading_run

log = logging.getLogger(__name__)
_SUFFIX = ".kv"

Removed = Callable[[int], None]


class DiskTier:
    medium = DISK

    def __init__(self, directory: str | Path, namespace: str, capacity_bytes: int, block_nbytes: int,
                 removed: Removed | None = None) -> None:
        self.file_nbytes = HEADER_BYTES + block_nbytes
        self.max_files = capacity_bytes // self.file_nbytes
        if self.max_files < 1:
            raise ValueError(f"--kv-disk-gb holds no block of {block_nbytes} bytes")
        self.dir = Path(directory) / namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        self.block_nbytes = block_nbytes
        self.removed = removed
        self._index: OrderedDict[int, None] = OrderedDict()   # block hashes on disk, least recent first
        self._lock = threading.Lock()
        self.num_hits = self.num_puts = self.num_corrupt = self.num_errors = 0
        self._adopt()
        self._note_other_namespaces()

    def _path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}{_SUFFIX}"

    def _adopt(self) -> None:
        """Index the files an earlier run left, oldest first; stray temporaries go."""
        found: list[tuple[float, int]] = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.endswith(_SUFFIX) and len(name) == 16 + len(_SUFFIX):
                try:
                    found.append((entry.stat().st_mtime, int(name[:16], 16)))
                except ValueError:
                    continue
            elif name.endswith(".tmp"):
                Path(entry.path).unlink(missing_ok=True)
        for _, block_hash in sorted(found):
            self._index[block_hash] = None
        while len(self._index) > self.max_files:
            self._path(self._index.popitem(last=False)[0]).unlink(missing_ok=True)
        if self._index:
            log.info("KV disk tier %s: adopted %d blocks", self.dir, len(self._index))

    def _note_other_namespaces(self) -> None:
        """Say what blocks of other namespaces (other weights, an earlier revision) hold in the same directory:
        `capacity_bytes` bounds this namespace only, and those are never read here, nor deleted (another
        worker may still use them)."""
        num_files = num_bytes = 0
        others = []
        for entry in os.scandir(self.dir.parent):
            if entry.name == self.dir.name:
                continue
            try:   # whatever else lies there, or cannot be read, is not ours to count
                if not entry.is_dir():
                    continue
                sizes = [f.stat().st_size for f in os.scandir(entry.path) if f.name.endswith(_SUFFIX)]
            except OSError:
                continue
            if sizes:
                others.append(entry.name)
                num_files += len(sizes)
                num_bytes += sum(sizes)
        if others:
            log.warning("KV disk tier: %s also holds %d blocks (%.2f GiB) of %d other namespaces (%s): other "
                        "weights or model revisions. They do not count against this worker's limit; delete them "
                        "when no worker uses them.", self.dir.parent, num_files, num_bytes / 2**30, len(others),
                        ", ".join(sorted(others)))

    def leading_hits(self, block_hashes: Sequence[int]) -> int:
        with self._lock:
            return leading_run(self._index, block_hashes)

    def get(self, block_hash: int, out: memoryview) -> bool:
        with self._lock:
            if block_hash not in self._index:
                return False
            self._index.move_to_end(block_hash)
        header = bytearray(HEADER_BYTES)
        try:   # straight into `out` (no copy of the block in between), and nothing after it
            with open(self._path(block_hash), "rb", buffering=0) as f:
                whole = os.readv(f.fileno(), [header, out]) == self.file_nbytes and not f.read(1)
        except OSError:
            whole = False
        if whole and check_frame(block_hash, header, out):
            self.num_hits += 1
            return True
        self.num_corrupt += 1
        log.warning("KV disk tier: block %016x is missing or corrupt; recomputing it", block_hash)
        self._forget(block_hash)
        return False

    def borrow(self, block_hash: int) -> None:
        return None     # blocks are read into the caller's buffer (`get`)

    def put(self, block_hash: int, data: memoryview) -> bool:
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True
        while True:
            with self._lock:
                if len(self._index) < self.max_files:
                    break
                victim, _ = self._index.popitem(last=False)
            self._evict(victim)
        path = self._path(block_hash)
        tmp = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")   # thread ids repeat across processes
        try:
            with open(tmp, "wb", buffering=0) as f:
                header = frame_header(block_hash, data)
                if f.write(header) != len(header) or f.write(data) != len(data):
                    raise OSError("short write")
            os.replace(tmp, path)
        except OSError as exc:
            self.num_errors += 1
            log.warning("KV disk tier: cannot write %s: %s", path, exc)
            tmp.unlink(missing_ok=True)
            return False
        with self._lock:
            self._index[block_hash] = None
        self.num_puts += 1
        return True

    def _evict(self, block_hash: int) -> None:
        self._path(block_hash).unlink(missing_ok=True)
        if self.removed is not None:
            self.removed(block_hash)

    def _forget(self, block_hash: int) -> None:
        with self._lock:
            known = block_hash in self._index
            self._index.pop(block_hash, None)
        self._path(block_hash).unlink(missing_ok=True)
        if known and self.removed is not None:
            self.removed(block_hash)

    def usage(self) -> TierUsage:
        with self._lock:
            n = len(self._index)
        return TierUsage(DISK, n, n * self.file_nbytes, self.max_files * self.file_nbytes)

    def close(self) -> None:
        pass
