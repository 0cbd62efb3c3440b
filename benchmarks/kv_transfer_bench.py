"""KV transfer throughput over loopback vs a plain memcpy of the same bytes, in one run.

Server processes (the prefill side: one on asyncio, one on uvloop, one on uvloop whose cache is in shared
memory as a prefill worker's is, plus a raw-socket ceiling) hold N MiB of KV in SmolLM2-135M's layout (30
layers, 3 KV heads, head_dim 64, block 16, bf16) at block ids scattered one by one, in runs of 64, or in one
run; this process pulls it into its own paged cache, its block ids following the same pattern. Every row is
measured once per round, rounds interleaved, so load from other processes hits all rows alike; the best round
is shown.
GB/s means 1e9 bytes/s.

    .venv/bin/python benchmarks/kv_transfer_bench.py --mb 256 --rounds 7
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backends.core.kv_transfer_params import RemoteBlocks
from backends.kv_transfer import ChecksumKind, KVTransferConfig, ReleaseMode, TcpTransport
from backends.kv_transfer.shm import SharedKVFile
from backends.kv_transfer.torch_cache import TorchPagedKV

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; block 16; bf16
NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, DTYPE = 30, 16, 3, 64, torch.bfloat16
BYTES_PER_BLOCK = 2 * NUM_LAYERS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize  # all layers, K and V
LOOPS = ("asyncio", "uvloop")
PATTERNS = ("scattered", "runs", "contiguous")
RUN_BLOCKS = 64  # "runs": 64 blocks = 384 KiB per layer's K (or V), like a fresh allocation's


def make_cache(num_blocks: int, seed: int, stacked: bool = False, shared: SharedKVFile | None = None) -> TorchPagedKV:
    """Random KV: separate tensors per layer, one stacked buffer as the worker's KVCache allocates, or
    `shared`'s buffer (the caller keeps `shared` open)."""
    gen = torch.Generator().manual_seed(seed)
    dims = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if not stacked and shared is None:
        return TorchPagedKV([(torch.randn(dims, generator=gen).to(DTYPE), torch.randn(dims, generator=gen).to(DTYPE))
                             for _ in range(NUM_LAYERS)])
    buffer = shared.tensor if shared is not None else torch.empty((NUM_LAYERS, 2, *dims), dtype=DTYPE)
    buffer.copy_(torch.randn(buffer.shape, generator=gen))
    return TorchPagedKV([(buffer[i, 0], buffer[i, 1]) for i in range(NUM_LAYERS)],
                        region=shared.region if shared is not None else None)


def block_ids(pattern: str, num_blocks: int, seed: int) -> list[int]:
    """num_blocks ids in a cache twice that size: one run, runs of RUN_BLOCKS in random order,
    or single blocks at random ("scattered")."""
    if pattern == "contiguous":
        return list(range(num_blocks))
    run = RUN_BLOCKS if pattern == "runs" else 1
    order = torch.randperm(2 * num_blocks // run, generator=torch.Generator().manual_seed(seed)).tolist()
    return [first * run + i for first in order for i in range(run)][:num_blocks]


def run_loop(coro: Coroutine[Any, Any, Any], loop_name: str) -> Any:
    if loop_name == "uvloop":
        import uvloop
        return uvloop.run(coro)
    return asyncio.run(coro)


def kv_serve(num_blocks: int, loop_name: str, port_queue: mp.Queue, stop: mp.Event) -> None:
    """A prefill worker holding N MiB of blocks under each pattern's name ("shm": uvloop, cache in
    shared memory)."""
    shared = SharedKVFile(NUM_LAYERS, 2 * num_blocks, (BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), DTYPE) \
        if loop_name == "shm" else None
    kv = make_cache(2 * num_blocks, seed=1, shared=shared)
    for pattern in PATTERNS:
        kv.holds.hold(pattern, block_ids(pattern, num_blocks, seed=2))

    async def main() -> None:
        transport = TcpTransport()
        _, port = await transport.serve(kv, "127.0.0.1", 0)
        port_queue.put(port)
        await asyncio.to_thread(stop.wait)   # set by the parent process
        await transport.close()

    run_loop(main(), "uvloop" if loop_name == "shm" else loop_name)


def raw_serve(nbytes: int, port_queue: mp.Queue) -> None:
    """The ceiling for any TCP transport here: blocking sendall of one contiguous buffer."""
    listener = socket.create_server(("127.0.0.1", 0))
    port_queue.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    payload = memoryview(os.urandom(nbytes))
    while conn.recv(1):
        conn.sendall(payload)
    conn.close()


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_pull(conn: socket.socket, sink: memoryview) -> None:
    conn.send(b"x")
    got = 0
    while got < len(sink):
        got += conn.recv_into(sink[got:])


def kv_pull(port: int, loop_name: str, kv: TorchPagedKV, transfer_id: str, local: list[int],
            checksum: ChecksumKind, transports: dict[ChecksumKind, TcpTransport], shared: bool = False) -> float:
    """One pull, timed from connect to DONE; one transport per checksum for the whole run, as a decode
    worker keeps one (its shared-memory mappings stay open between pulls)."""
    if checksum not in transports:
        transports[checksum] = TcpTransport(KVTransferConfig(checksum=checksum, release=ReleaseMode.NEVER))
    remote = RemoteBlocks("127.0.0.1", port, transfer_id, len(local))
    result = run_loop(transports[checksum].pull(remote, kv, local), loop_name)
    assert result.shared_memory == shared, "pulled by the wrong transport"
    return result.elapsed_s


def start_servers(nbytes: int, num_blocks: int) -> tuple[Any, list[Any], dict[str, int]]:
    """The server processes (raw socket, then KV on each loop and on shared memory): (stop event, processes,
    port by name)."""
    ctx = mp.get_context("spawn")
    stop, procs, ports = ctx.Event(), [], {}
    servers = [("raw", raw_serve, (nbytes,)), *((n, kv_serve, (num_blocks, n)) for n in (*LOOPS, "shm"))]
    for name, target, extra in servers:
        port_queue = ctx.Queue()
        procs.append(ctx.Process(target=target, args=(*extra, port_queue) + ((stop,) if target is kv_serve else ())))
        procs[-1].start()
        ports[name] = port_queue.get(timeout=300)
    return stop, procs, ports


def print_table(times: dict[str, list[float]], nbytes: int, num_blocks: int, rounds: int) -> None:
    best = {name: nbytes / min(ts) / 1e9 for name, ts in times.items()}
    median = {name: nbytes / statistics.median(ts) / 1e9 for name, ts in times.items()}
    memcpy = max(best["memcpy torch.Tensor.copy_"], best["memcpy numpy.copyto"])
    print(f"\n{nbytes / 2**20:.0f} MiB of KV per transfer ({num_blocks} blocks x 30 layers, SmolLM2-135M layout, "
          f"bf16), {rounds} interleaved rounds, {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.1f}, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'what':<42} {'best GB/s':>9} {'median':>7} {'best % of memcpy':>17}")
    for name in times:
        print(f"{name:<42} {best[name]:9.2f} {median[name]:7.2f} {100 * best[name] / memcpy:16.0f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="KV bytes per transfer, in MiB")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    num_blocks = max(1, args.mb * 2**20 // BYTES_PER_BLOCK)
    nbytes = num_blocks * BYTES_PER_BLOCK
    stop, procs, ports = start_servers(nbytes, num_blocks)

    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    src_np, dst_np = src.numpy(), dst.numpy()
    raw_sink = memoryview(bytearray(nbytes))
    kv = make_cache(2 * num_blocks, seed=3)
    kv_stacked = make_cache(2 * num_blocks, seed=3, stacked=True)   # the worker's own cache layout
    local = {pattern: block_ids(pattern, num_blocks, seed=4) for pattern in PATTERNS}
    transports: dict[ChecksumKind, TcpTransport] = {}
    raw_conn = socket.create_connection(("127.0.0.1", ports["raw"]), timeout=120)

    rows: dict[str, Callable[[], float]] = {
        "memcpy torch.Tensor.copy_": lambda: timed(lambda: dst.copy_(src)),
        "memcpy numpy.copyto": lambda: timed(lambda: np.copyto(dst_np, src_np)),
        "raw TCP sendall -> recv_into, 1 buffer": lambda: timed(lambda: raw_pull(raw_conn, raw_sink)),
    }
    for loop_name in LOOPS:
        for pattern in PATTERNS:
            kinds = list(ChecksumKind) if pattern == "scattered" else [ChecksumKind.NONE, ChecksumKind.CRC32C]
            for checksum in kinds:
                rows[f"KV pull {loop_name:<7} {pattern:<10} {checksum.value}"] = (
                    lambda loop=loop_name, p=pattern, c=checksum:
                    kv_pull(ports[loop], loop, kv, p, local[p], c, transports))

    for pattern in PATTERNS:
        rows[f"KV pull shared memory {pattern:<10}"] = (
            lambda p=pattern: kv_pull(ports["shm"], "uvloop", kv_stacked, p, local[p], ChecksumKind.NONE, transports,
                                      shared=True))

    times: dict[str, list[float]] = {name: [] for name in rows}
    try:
        for round_index in range(args.rounds + 1):  # round 0 warms up: page faults, staging pools
            for name, measure in rows.items():
                elapsed = measure()
                if round_index:
                    times[name].append(elapsed)
    finally:
        raw_conn.close()
        stop.set()
        for proc in procs:
            proc.join(30)
    print_table(times, nbytes, num_blocks, args.rounds)


if __name__ == "__main__":
    main()
