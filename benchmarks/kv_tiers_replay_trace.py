"""kv_tiers_replay.py's workload: a slice of Mooncake's conversation trace, whole sessions, each prompt scaled to
this machine (one 512-token trace block becomes one 16-token worker block, its token ids drawn from a generator
seeded by the block's hash id), and the hit rate one unbounded cache would give it."""
from __future__ import annotations

import collections
import json
import random
from dataclasses import dataclass
from typing import Any

from routing_sim_trace import BLOCK_TOKENS as TRACE_BLOCK, TRACE

BLOCK = 16                        # worker block; one trace block of 512 tokens maps onto one


@dataclass(frozen=True, slots=True)
class Turn:
    session: int                  # the trace's second block id: one conversation
    index: int                    # the turn's place in its session
    token_ids: tuple[int, ...]    # the scaled prompt


def block_tokens(hash_id: int) -> list[int]:
    rng = random.Random(f"trace-block-{hash_id}")
    return [rng.randrange(100, 20000) for _ in range(BLOCK)]


def scaled_prompt(record: dict[str, Any]) -> tuple[int, ...]:
    ids = record["hash_ids"]
    tail = record["input_length"] - TRACE_BLOCK * (len(ids) - 1)
    num_tail = max(1, min(BLOCK, round(tail * BLOCK / TRACE_BLOCK)))
    out = [t for h in ids[:-1] for t in block_tokens(h)]
    return tuple(out + block_tokens(ids[-1])[:num_tail])


def trace_slice(num_requests: int, max_blocks: int, seed: int) -> list[Turn]:
    records = [json.loads(line) for line in TRACE.open()]
    sessions: dict[int, list[int]] = collections.defaultdict(list)
    for i, r in enumerate(records):
        if len(r["hash_ids"]) > 1:
            sessions[r["hash_ids"][1]].append(i)
    keys = sorted(k for k, v in sessions.items()
                  if len(v) >= 2 and max(len(records[i]["hash_ids"]) for i in v) <= max_blocks)
    random.Random(seed).shuffle(keys)
    chosen: list[int] = []
    n = 0
    for k in keys:
        if n >= num_requests:
            break
        chosen.append(k)
        n += len(sessions[k])
    order = sorted((i, k, t) for k in chosen for t, i in enumerate(sessions[k]))
    return [Turn(k, t, scaled_prompt(records[i])) for i, k, t in order]


def ideal_hit_rate(turns: list[Turn]) -> float:
    """Leading full blocks already seen, over prompt tokens: one unbounded cache (the upper bound)."""
    from cache.block_hash import block_hashes
    seen: set[int] = set()
    hit = total = 0
    for t in turns:
        hashes = block_hashes(t.token_ids[:-1], BLOCK)   # the last prompt token is always computed
        n = 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        hit += n * BLOCK
        total += len(t.token_ids)
        seen.update(hashes)
    return hit / total
