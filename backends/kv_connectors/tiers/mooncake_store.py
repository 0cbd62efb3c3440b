"""The shared-store tier: blocks in a Mooncake Store (`--kv-store mooncake://HOST:PORT`, its master's address),
shared by every worker of one namespace. Each worker lends `segment_bytes` of its RAM to the store's pool and a
block may land in any worker's segment, so a worker that exits takes the blocks it hosted with it.

An outage is an expected outcome, not an error: a call that fails or overruns `timeout_s` marks the store down,
every call then answers at once with a miss, and a background thread looks for the master every `retry_s`.
Calls run on a small pool under that deadline because the client's own waits are long (about 4 s a call once
the master is gone; its RPC timeout while the master hangs).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, TimeoutError as CallTimeout
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from backends.core.block_events import STORE
from backends.kv_connectors.tiers.base import HEADER_BYTES, TierUsage, frame, unframe

log = logging.getLogger(__name__)

_OBJECT_ALREADY_EXISTS = -705        # mooncake-store ErrorCode; a missing key (-704) reaches get as b""
_PROBE_KEY = "switchyard/probe"      # never written: looking it up tells whether the master answers
_INSTALL = "pip install mooncake-transfer-engine-non-cuda (and apt-get install libibverbs1 libnuma1)"


class MooncakeStoreTier:
    medium = STORE

    def __init__(self, url: str, namespace: str, block_nbytes: int, segment_bytes: int = 256 << 20,
                 buffer_bytes: int = 32 << 20, timeout_s: float = 1.0, retry_s: float = 3.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "mooncake" or not parts.hostname or not parts.port:
            raise ValueError(f"--kv-store wants mooncake://HOST:PORT (the master's address), not {url!r}")
        self.host, self.port = parts.hostname, parts.port
        self.prefix = f"switchyard/{namespace}/"
        # What the gateway sees as one shared store (KVTierLoad.shared): workers that dial the master by
        # another name count as another store, which only costs them credit for each other's blocks.
        self.shared = hashlib.blake2b(f"{self.host}:{self.port}|{self.prefix}".encode(), digest_size=8).hexdigest()
        self.block_nbytes = block_nbytes
        self.segment_bytes = segment_bytes   # RAM this worker lends to the store's pool (0: lends none)
        self.buffer_bytes = max(buffer_bytes, 2 * (HEADER_BYTES + block_nbytes))   # the client's staging buffer
        self.timeout_s = timeout_s           # the longest one call holds its caller
        self.retry_s = retry_s
        self._store_class = _store_class()
        self._client: Any = None             # a MooncakeDistributedStore; replaced only while down
        self._up = False
        self._failed_checks = 0
        self._lock = threading.Lock()
        self._calls = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-store-call")
        self._closed = threading.Event()
        self.num_puts = self.num_hits = self.num_misses = self.num_corrupt = self.num_errors = 0
        self.num_outages = 0
        if not self._reconnect():
            self.num_outages += 1
            log.warning("KV store %s:%d is unreachable; running without it, retrying every %.0f s",
                        self.host, self.port, retry_s)
        self._watcher = threading.Thread(target=self._watch, name="kv-store-reconnect", daemon=True)
        self._watcher.start()

    @property
    def is_up(self) -> bool:
        return self._up

    def _key(self, block_hash: int) -> str:
        return f"{self.prefix}{block_hash:016x}"

    def leading_hits(self, block_hashes: Sequence[int]) -> int:
        client = self._usable()
        if client is None or not block_hashes:
            return 0
        found = self._call("batch_is_exist", client.batch_is_exist, [self._key(h) for h in block_hashes])
        if found is None:
            return 0
        if min(found) < 0:
            self._mark_down(f"batch_is_exist answered {min(found)}")
            return 0
        n = 0
        while n < len(found) and found[n] == 1:
            n += 1
        return n

    def get(self, block_hash: int, out: memoryview) -> bool:
        client = self._usable()
        key = self._key(block_hash)
        data = None if client is None else self._call("get", client.get, key)
        if data and unframe(block_hash, data, out):
            self.num_hits += 1
            return True
        self.num_misses += 1
        if data:
            self.num_corrupt += 1
            log.warning("KV store: block %016x is corrupt; removing it and recomputing", block_hash)
            self._call("remove", client.remove, key, True)   # force: our own get holds a lease on it
        elif data is not None and client.health_check() != 0:   # b"" says "missing" and "failed" alike
            self._mark_down("get failed")
        return False

    def borrow(self, block_hash: int) -> None:
        return None     # blocks are read into the caller's buffer (`get`)

    def put(self, block_hash: int, data: memoryview) -> bool:
        client = self._usable()
        if client is None:
            return False
        rc = self._call("put", client.put, self._key(block_hash), frame(block_hash, data))
        if rc == 0 or rc == _OBJECT_ALREADY_EXISTS:
            self.num_puts += 1
            return True
        if rc is None:
            return False
        if -1000 < rc <= -900 or client.health_check() != 0:   # an RPC error: the master is gone
            self._mark_down(f"put answered {rc}")
        else:                                # the pool is full (-200), a segment's owner is gone (-800)
            with self._lock:
                self.num_errors += 1
        return False

    def usage(self) -> TierUsage:
        # The pool is all workers' segments together; this worker knows only what it put.
        return TierUsage(STORE, self.num_puts, self.num_puts * (HEADER_BYTES + self.block_nbytes), 0)

    def close(self) -> None:
        """After the loader and writer threads stop. Waits out calls still running (each within the client's
        own timeouts), so none runs on a closed client. A client whose master is gone is left to the process's
        exit: closing it would wait out the client's retries."""
        self._closed.set()
        self._watcher.join()
        self._calls.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            client, was_up, self._client, self._up = self._client, self._up, None, False
        if client is not None and was_up:
            client.close()   # unregisters its segment: a round trip to the master (seconds of retries if it is gone)

    def _usable(self) -> Any:
        """The client, or None while the store is down. health_check is the client's own view of its master
        (it pings once a second), read without a round trip."""
        client = self._client
        if not self._up or client is None:
            return None
        if client.health_check() != 0:
            self._mark_down("the client lost its master")
            return None
        return client

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) under the deadline; None, with the store marked down, if it raises or overruns. A call left
        running finishes on the pool and its answer is dropped."""
        try:
            return self._calls.submit(fn, *args).result(timeout=self.timeout_s)
        except CallTimeout:
            self._mark_down(f"{what} took over {self.timeout_s} s")
        except RuntimeError as exc:          # the client's C++ errors, or a call after close()
            self._mark_down(f"{what} raised {exc!r}")
        return None

    def _mark_down(self, reason: str) -> None:
        with self._lock:
            self.num_errors += 1
            was_up, self._up = self._up, False
            if was_up:
                self.num_outages += 1
        if was_up:
            log.warning("KV store %s:%d is down (%s); running without it, retrying every %.0f s",
                        self.host, self.port, reason, self.retry_s)

    def _watch(self) -> None:
        while not self._closed.wait(self.retry_s):
            try:
                if not self._up and self._reconnect():
                    log.info("KV store %s:%d is back", self.host, self.port)
            except Exception:                # a background loop: log it and try again next round
                log.exception("KV store: reconnecting to %s:%d failed", self.host, self.port)

    def _reconnect(self) -> bool:
        """One attempt (the constructor, then only the watcher thread). The port is probed first, since setting
        up a client against a dead master takes seconds. A client rejoins a restarted master by itself; one that
        has not after three checks is replaced."""
        if not _port_open(self.host, self.port, self.timeout_s):
            return False
        if self._client is None:
            # Read when a client starts: one setup attempt (not 20 of about 4 s each), and the RPC deadline.
            os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
            os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(int(self.timeout_s * 1000)))
            client = self._store_class()
            if client.setup(_local_ip(self.host, self.port), "P2PHANDSHAKE", self.segment_bytes,
                            self.buffer_bytes, "tcp", "", f"{self.host}:{self.port}") != 0:
                return False
            self._client = client
        if self._client.health_check() == 0 and self._client.batch_is_exist([_PROBE_KEY]) in ([0], [1]):
            self._failed_checks = 0
            with self._lock:
                self._up = not self._closed.is_set()
            return self._up
        self._failed_checks += 1
        if self._failed_checks >= 3:
            self._failed_checks, self._client = 0, None   # freed once the calls still running on it return
        return False


def _store_class() -> Any:
    """Imported here: a worker without --kv-store needs no mooncake package (which ships no type hints)."""
    try:
        return importlib.import_module("mooncake.store").MooncakeDistributedStore
    except ImportError as exc:
        raise RuntimeError(f"--kv-store mooncake:// needs the Mooncake client: {_INSTALL} ({exc})") from exc


def _port_open(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _local_ip(host: str, port: int) -> str:
    """The address other clients reach this one at: the interface facing the master (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        return str(sock.getsockname()[0])


def master_path() -> str:
    """The `mooncake_master` binary inside the installed mooncake package, else one on PATH."""
    spec = importlib.util.find_spec("mooncake")
    for folder in list(spec.submodule_search_locations or []) if spec is not None else []:
        if os.access(Path(folder) / "mooncake_master", os.X_OK):
            return str(Path(folder) / "mooncake_master")
    found = shutil.which("mooncake_master")
    if found is None:
        raise RuntimeError(f"mooncake_master is not installed: {_INSTALL}")
    return found


def start_master(port: int, *, metrics_port: int, host: str = "127.0.0.1", lease_ttl_ms: int = 10_000,
                 log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """Launch a master on host:port, its HTTP /health and /metrics on `metrics_port` (the default, 9003, would
    clash between two masters); then call wait_ready. It keeps its metadata in memory: a restarted master
    starts empty. A block can be evicted once `lease_ttl_ms` has passed since anyone last read or looked it up."""
    command = [master_path(), f"--rpc_port={port}", f"--rpc_address={host}", f"--metrics_port={metrics_port}",
               f"--metrics_host={host}", f"--default_kv_lease_ttl={lease_ttl_ms}",
               "--enable_metric_reporting=false", "--logtostderr"]
    if log_path is None:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file)


def wait_ready(proc: subprocess.Popen[bytes], port: int, host: str = "127.0.0.1", timeout_s: float = 30.0) -> None:
    """Return once the master accepts connections; RuntimeError if it exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while not _port_open(host, port, 0.5):
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode} (is port {port} taken?)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"mooncake_master on {host}:{port} is not ready after {timeout_s} s")
        time.sleep(0.02)
