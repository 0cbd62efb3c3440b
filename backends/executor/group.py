"""Rank 0's side of a group: it spawns ranks 1..N-1, sends each step down their pipes, and a watchdog fails the
whole group, within the group's timeout, when a rank exits or stops answering; failing kills every other rank.

Liveness: while a step runs, the step's own collectives prove every rank alive (or raise after the timeout);
between steps the watchdog pings each rank and expects a Pong within the timeout. A rank that hears nothing
from rank 0 for as long exits by itself (rank_process.py).
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import pickle
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import cast

from backends.core.batch import ForwardBatch
from backends.core.engine_config import EngineConfig
from backends.core.engine_errors import EngineDeadError
from backends.executor.collectives import START_TIMEOUT_S, master_store
from backends.executor.messages import Failed, Ping, Pong, RankSpec, Ready, Step, Stop, ToRank
from backends.executor.rank_process import rank_main

log = logging.getLogger(__name__)
_STOP_GRACE_S = 10.0


class RankGroup:
    """The spawned ranks of one worker, their control pipes, and the group's health."""

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.size = config.world_size
        self.timeout_s = config.distributed_timeout_s
        self.store = master_store(self.size)   # rank 0 joins the group over it
        self._interval_s = min(1.0, self.timeout_s / 4)
        context = multiprocessing.get_context("spawn")   # a fresh interpreter: no forked torch threads
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        for rank in range(1, self.size):
            ours, theirs = context.Pipe()
            spec = RankSpec(rank=rank, world_size=self.size, store_port=self.store.port, model_dir=str(model_dir),
                            engine_config=config, heartbeat_timeout_s=self.timeout_s)
            proc = context.Process(target=rank_main, args=(spec, theirs), name=f"switchyard-rank-{rank}",
                                   daemon=True)
            proc.start()
            theirs.close()
            log.info("rank %d of %d started, pid %d", rank, self.size, proc.pid)
            self._procs.append(proc)
            self._conns.append(ours)
        self._send_lock = threading.Lock()
        self._failure: str | None = None
        self._in_step = False
        self._last_step_end = time.monotonic()
        self._last_pong = [time.monotonic()] * len(self._procs)
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def pids(self) -> list[int]:
        return [proc.pid or 0 for proc in self._procs]

    def wait_ready(self) -> list[Ready]:
        """Each spawned rank's Ready, in rank order; RuntimeError if one fails or exits first. Then the watchdog
        starts."""
        ready: dict[int, Ready] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(ready) < len(self._procs):
            waiting = [c for i, c in enumerate(self._conns) if i + 1 not in ready]
            sentinels = {proc.sentinel: i + 1 for i, proc in enumerate(self._procs) if i + 1 not in ready}
            found = wait([*waiting, *sentinels], timeout=max(0.0, deadline - time.monotonic()))
            if not found:
                raise RuntimeError(f"ranks {sorted(set(range(1, self.size)) - set(ready))} did not start within "
                                   f"{START_TIMEOUT_S:.0f} s")
            for item in found:
                if isinstance(item, int):
                    raise RuntimeError(f"rank {sentinels[item]} exited while starting (code "
                                       f"{self._procs[sentinels[item] - 1].exitcode})")
                message = cast(Connection, item).recv()
                if isinstance(message, Failed):
                    raise RuntimeError(f"rank {message.rank} could not start: {message.error}")
                if isinstance(message, Ready):
                    ready[message.rank] = message
        self._last_step_end = time.monotonic()
        self._last_pong = [self._last_step_end] * len(self._procs)
        self._watchdog = threading.Thread(target=self._watch, name="switchyard-rank-watchdog", daemon=True)
        self._watchdog.start()
        return [ready[rank] for rank in sorted(ready)]

    # --- steps (the engine thread) ------------------------------------------------------------
    def begin_step(self, batch: ForwardBatch, all_hidden: bool = False) -> None:
        """Send the step to every rank; EngineDeadError if the group is down."""
        self._raise_if_failed()
        self._in_step = True
        self._send(Step(batch, all_hidden))

    def end_step(self) -> None:
        self._last_step_end = time.monotonic()
        self._in_step = False

    def failure(self) -> str | None:
        return self._failure

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise EngineDeadError(self._failure)

    def _send(self, message: ToRank) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)   # once, for every rank
        with self._send_lock:
            for rank, conn in enumerate(self._conns, start=1):
                try:
                    conn.send_bytes(payload)
                except OSError as exc:
                    self.fail(f"rank {rank}'s pipe is closed ({exc})")
                    break
        self._raise_if_failed()

    # --- failure --------------------------------------------------------------------------------
    def fail(self, reason: str) -> None:
        """Take the group down (any thread; the first reason is kept): every other rank is killed and reaped."""
        if self._failure is None:
            self._failure = reason
            log.error("the group of ranks failed: %s; stopping every rank", reason)
        self._stop.set()
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(_STOP_GRACE_S)

    def _watch(self) -> None:
        """The watchdog: rank exits, Pongs, and ranks silent past the timeout between steps."""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs, start=1)}
        conns = {id(conn): rank for rank, conn in enumerate(self._conns, start=1)}
        seq, last_ping = 0, 0.0
        while not self._stop.is_set():
            for item in wait([*sentinels, *self._conns], timeout=self._interval_s):
                if isinstance(item, int):
                    rank = sentinels[item]
                    self.fail(f"rank {rank} exited (code {self._procs[rank - 1].exitcode})")
                    return
                self._read_pong(cast(Connection, item), conns[id(item)])
            if self._in_step or self._stop.is_set():
                continue   # the step's collectives watch the ranks now, under the same timeout
            now = time.monotonic()
            for index, pong in enumerate(self._last_pong):
                if now - max(pong, self._last_step_end) > self.timeout_s:
                    self.fail(f"rank {index + 1} has not answered for {self.timeout_s:.0f} s")
                    return
            if now - last_ping >= self._interval_s:
                seq, last_ping = seq + 1, now
                try:
                    self._send(Ping(seq))
                except EngineDeadError:
                    return

    def _read_pong(self, conn: Connection, rank: int) -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            self.fail(f"rank {rank}'s pipe closed")
            return
        if isinstance(message, Pong):
            self._last_pong[rank - 1] = time.monotonic()

    def close(self) -> None:
        """Stop every rank (a clean exit where they answer, killed where they do not) and the watchdog."""
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join()
        if self._failure is None:
            with contextlib.suppress(EngineDeadError):   # a rank that cannot hear it is killed below
                self._send(Stop())
        for proc in self._procs:
            proc.join(_STOP_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
