"""KV between a prefill and a decode process on one GPU: CUDA IPC against the other paths, in one run (needs CUDA).

A server process holds a prompt's KV in a worker-shaped cache (one buffer, bf16); this process pulls it into its
own cache through each path, block ids contiguous (a fresh allocation) or scattered:
- cuda_ipc: the decode side opens the prefill side's GPU memory and copies device to device (cuda_ipc.py);
- tcp (pinned): the same two CUDA caches, IPC off: gathered on the GPU, through pinned host memory and loopback TCP;
- shm (CPU): both caches on the CPU, the prefill one in shared memory: what P/D without a GPU does (shm.py);
- d2d copy: the same gather and scatter between two caches of this one process, no transfer at all (the floor).
Each row is the median wall time of one whole pull (control frames included) over --reps, after a warm-up.

    python benchmarks/gpu_kv_transfer.py [--tokens 1024,8192] [--shapes smollm2,llama8b] [--reps 10]
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backends.core.kv_transfer_params import RemoteBlocks
from backends.kv_transfer import KVTransferConfig, ReleaseMode, TcpTransport
from backends.kv_transfer.cuda_ipc import copy_blocks
from backends.kv_transfer.shm import stacked_bytes
from backends.kv_transfer.torch_cache import DictBlockHolds, TorchPagedKV
from backends.worker.kv_cache import KVCache, KVCacheSpec
from benchmarks.gpu_disagg import pct

SHAPES = {"smollm2": (30, 3, 64), "llama8b": (32, 8, 128)}   # layers, KV heads, head dim
BLOCK = 16
PATHS = ("cuda_ipc", "tcp (pinned)", "shm (CPU)", "d2d copy")


def make_cache(shape: str, num_blocks: int, device: str, shared: bool = False) -> KVCache:
    layers, heads, dim = SHAPES[shape]
    cache = KVCache(KVCacheSpec(layers, num_blocks, BLOCK, heads, dim, torch.bfloat16), device, shared=shared)
    cache.stacked.view(-1).view(torch.int16).random_()
    return cache


def paged(cache: KVCache, holds: DictBlockHolds | None = None) -> TorchPagedKV:
    return TorchPagedKV(list(zip(cache.k, cache.v, strict=True)), holds, region=cache.shared_region)


def serve(shape: str, num_blocks: int, device: str, holds: dict[str, list[int]], ports: Any, stop: Any) -> None:
    """The prefill side, in its own process, until told to stop."""
    async def main() -> None:
        cache, held = make_cache(shape, num_blocks, device, shared=device == "cpu"), DictBlockHolds()
        for transfer_id, ids in holds.items():
            held.hold(transfer_id, ids)
        server = TcpTransport()
        _, port = await server.serve(paged(cache, held), "127.0.0.1", 0)
        ports.put(port)
        await asyncio.to_thread(stop.wait)
        await server.close()

    asyncio.run(main())


def block_patterns(n: int, num_blocks: int, seed: int) -> dict[str, tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return {"contiguous": (list(range(n)), list(range(num_blocks - n, num_blocks))),
            "scattered": (rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n))}


async def time_pulls(port: int, dst: TorchPagedKV, src_ids: list[int], dst_ids: list[int], transfer_id: str,
                     path: str, reps: int) -> list[float]:
    shared = path != "tcp (pinned)"
    client = TcpTransport(KVTransferConfig(shared_memory=shared, release=ReleaseMode.NEVER))
    remote = RemoteBlocks("127.0.0.1", port, transfer_id, len(src_ids))
    times = []
    for i in range(reps + 1):
        start = time.perf_counter()
        result = await client.pull(remote, dst, dst_ids)
        if i:
            times.append(time.perf_counter() - start)
        # the path asked for is the path taken
        assert result.shared_memory is shared and result.cuda_ipc is (path == "cuda_ipc"), (path, result)
    await client.close()
    return times


def d2d_times(shape: str, num_blocks: int, src_ids: list[int], dst_ids: list[int], reps: int) -> list[float]:
    src, dst = (stacked_bytes(paged(make_cache(shape, num_blocks, "cuda")).layers) for _ in range(2))
    assert src is not None and dst is not None
    times = []
    for i in range(reps + 1):
        start = time.perf_counter()
        copy_blocks(src, src_ids, dst, dst_ids)   # synchronises
        if i:
            times.append(time.perf_counter() - start)
    return times


def run_server(shape: str, num_blocks: int, device: str, holds: dict[str, list[int]]) -> tuple[Any, Any, int]:
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve, args=(shape, num_blocks, device, holds, ports, stop), daemon=True)
    proc.start()
    return proc, stop, ports.get(timeout=120)


def measure(shape: str, tokens: int, reps: int, devices: list[str]) -> dict[tuple[str, str], list[float]]:
    n = -(-tokens // BLOCK)
    num_blocks = 2 * n + 64
    patterns = block_patterns(n, num_blocks, seed=tokens)
    holds = {name: src for name, (src, _) in patterns.items()}
    out: dict[tuple[str, str], list[float]] = {}
    for device in devices:
        proc, stop, port = run_server(shape, num_blocks, device, holds)
        try:
            dst = paged(make_cache(shape, num_blocks, device))
            for name, (src_ids, dst_ids) in patterns.items():
                for path in ("cuda_ipc", "tcp (pinned)") if device == "cuda" else ("shm (CPU)",):
                    out[(path, name)] = asyncio.run(time_pulls(port, dst, src_ids, dst_ids, name, path, reps))
        finally:
            stop.set()
            proc.join(30)
    for name, (src_ids, dst_ids) in patterns.items():
        if "cuda" in devices:
            out[("d2d copy", name)] = d2d_times(shape, num_blocks, src_ids, dst_ids, reps)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1024,8192", help="prompt tokens whose KV moves, comma-separated")
    p.add_argument("--shapes", default="smollm2,llama8b")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--devices", default="cuda,cpu", help="cpu alone: a dry run of the shm row without a GPU")
    args = p.parse_args()
    devices = args.devices.split(",")
    paths = [p for p in PATHS if "cuda" in devices or p == "shm (CPU)"]
    gpu = torch.cuda.get_device_name() if "cuda" in devices else "no GPU"
    print(f"# KV transfer on one GPU: {gpu}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; median of {args.reps} pulls (p90 beside)")
    print("| shape | tokens | MB | blocks | " + " | ".join(f"{p} ms" for p in paths) + " | fastest GB/s |")
    print("|---|---|---|---|" + "---|" * (len(paths) + 1))
    for shape in args.shapes.split(","):
        layers, heads, dim = SHAPES[shape]
        for tokens in map(int, args.tokens.split(",")):
            nbytes = -(-tokens // BLOCK) * BLOCK * 2 * layers * heads * dim * 2
            times = measure(shape, tokens, args.reps, devices)
            for name in ("contiguous", "scattered"):
                med = {path: statistics.median(times[(path, name)]) for path in paths}
                cells = " | ".join(f"{med[p] * 1e3:.3f} ({pct(times[(p, name)], 90) * 1e3:.3f})" for p in paths)
                best = min(med[p] for p in paths if p != "d2d copy")
                print(f"| {shape} | {tokens} | {nbytes / 1e6:.1f} | {name} | {cells} | {nbytes / best / 1e9:.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
