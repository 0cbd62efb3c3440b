"""A spawned rank's life (ranks 1..N-1): join the group, load its shard (its stage's layers, its slices of them),
then run its part of each step rank 0 sends until it sends Stop, goes silent, or dies. Never serves HTTP,
schedules or samples.

It dies with rank 0: the kernel kills it when rank 0's engine thread ends (PR_SET_PDEATHSIG), a closed pipe
ends its wait for the next step, and a collective whose peer is gone raises within the group's timeout.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from backends.executor.collectives import GroupPlace, group_shape, join_group, leave_group
from backends.executor.messages import Failed, Ping, Pong, RankSpec, Ready, Step
from backends.executor.pipeline import pipeline_step
from backends.worker.heap import keep_freed_memory
from backends.worker.model_runner import ModelRunner, runner_for

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def rank_main(spec: RankSpec, conn: Connection) -> None:
    """The spawned process's entry point (multiprocessing's target)."""
    _die_with_parent()
    keep_freed_memory()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank {spec.rank} %(name)s: %(message)s")
    config = spec.engine_config
    torch.set_num_threads(config.resolved_torch_threads())
    try:
        place = join_group(spec.rank, group_shape(config, Path(spec.model_dir)), None, spec.store_port,
                           config.device, config.distributed_timeout_s)
        before = rss_anon_bytes()
        runner = runner_for(config, Path(spec.model_dir), 0, place)
    except Exception as exc:  # boundary: the start-up error goes to rank 0, which fails the worker's start
        log.exception("rank %d could not start", spec.rank)
        conn.send(Failed(spec.rank, f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    conn.send(Ready(rank=spec.rank, num_blocks=runner.num_blocks, weight_bytes=runner.weight_bytes(),
                    read_bytes=runner.read_bytes, rss_anon_bytes=rss_anon_bytes(), rss_anon_before_bytes=before,
                    weights_fingerprint=runner.weights_fingerprint or "", kv_region=runner.kv_cache.shared_region,
                    kv_layers=runner.kv_cache.spec.num_layers))
    code = _serve(spec, conn, runner, place)
    leave_group()
    sys.exit(code)


def _serve(spec: RankSpec, conn: Connection, runner: ModelRunner, place: GroupPlace) -> int:
    """Run rank 0's steps; the exit code: 0 when told to stop, 1 when rank 0 or the group went away."""
    while True:
        try:
            if not conn.poll(spec.heartbeat_timeout_s):
                log.error("rank 0 sent nothing for %.0f s (no step, no ping): leaving the group",
                          spec.heartbeat_timeout_s)
                return 1
            message = conn.recv()
        except (EOFError, OSError):
            log.error("rank 0's pipe closed: leaving the group")
            return 1
        if isinstance(message, Step):
            try:
                if place.links is None:
                    runner.execute(message.batch)
                else:
                    pipeline_step(runner, place.links, message.batch, message.all_hidden)
            except ValueError as exc:   # refused before any collective, on every rank alike
                log.warning("batch refused: %s", exc)
            except Exception:  # boundary: a collective failed (a peer died or stalled): the group is over
                log.exception("step failed: leaving the group")
                return 1
        elif isinstance(message, Ping):
            conn.send(Pong(spec.rank, message.seq))
        else:
            log.info("stopping (%s)", place.traffic())
            return 0


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the thread that spawned it (rank 0's engine thread) ends."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:   # rank 0 died before the line above ran
        sys.exit(1)


def rss_anon_bytes() -> int:
    """This process's anonymous resident memory (weights, KV cache, heap; not the mapped checkpoint), or 0."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
