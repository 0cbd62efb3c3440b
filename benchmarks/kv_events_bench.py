"""CPU cost of consuming vLLM's KV events in the gateway (gateway/routing/vllm_kv_events.py): per BlockStored batch of a
512-token prompt (16 vLLM blocks of 32 tokens, 32 gateway blocks of 16), msgpack decoding alone (the
baseline: what any consumer pays), our decoding and validation, and the whole apply (decode, rehash onto
cache.block_hash, store in the prefix index). CPU time (process_time), best of --repeats.

    .venv/bin/python benchmarks/kv_events_bench.py [--batches 500] [--repeats 5]
"""
from __future__ import annotations

import argparse
import hashlib
import pathlib
import sys
import time
from collections.abc import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import msgpack

from cache.prefix_index import PrefixIndex
from cache.vllm_events import VllmBlockMap, decode_batch
from gateway.routing.vllm_kv_events import apply_batch

PROMPT_TOKENS = 512
VLLM_BLOCK = 32
OUR_BLOCK = 16


def payloads(num_batches: int) -> list[bytes]:
    """BlockStored batches shaped as vLLM 0.32 sends them (a tagged map per event), distinct prompts."""
    out = []
    for r in range(num_batches):
        hashes = [int.from_bytes(hashlib.sha256(f"{r}/{i}".encode()).digest()[:8], "big")
                  for i in range(PROMPT_TOKENS // VLLM_BLOCK)]
        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                 "token_ids": list(range(r * 1000, r * 1000 + PROMPT_TOKENS)), "block_size": VLLM_BLOCK,
                 "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None] * len(hashes),
                 "group_idx": 0}
        out.append(msgpack.packb([time.time(), [event], 0]))
    return out


def best_cpu_s(run: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    batches = payloads(args.batches)

    def unpack() -> None:
        for p in batches:
            msgpack.unpackb(p, raw=False, strict_map_key=False)

    def decode() -> None:
        for p in batches:
            decode_batch(p)

    def apply() -> None:
        index, block_map = PrefixIndex(), VllmBlockMap(OUR_BLOCK)
        for p in batches:
            apply_batch(index, "http://vllm-0:8000", block_map, p)

    print(f"{args.batches} BlockStored batches of {PROMPT_TOKENS} tokens; CPU time per batch, best of {args.repeats}")
    for label, run in (("msgpack.unpackb only (baseline)", unpack), ("decode_batch", decode),
                       ("apply_batch (decode, rehash, index)", apply)):
        per_batch = best_cpu_s(run, args.repeats) / args.batches
        print(f"{label:<38}{per_batch * 1e6:>8.0f} us  {PROMPT_TOKENS / per_batch / 1e6:>6.2f} M tokens/s")


if __name__ == "__main__":
    main()
