"""The Mooncake conversation trace as routing_sim.py replays it: its requests, and the hit rate of one
unbounded cache over them in trace order (the ceiling, without timing)."""
from __future__ import annotations

import itertools
import pathlib
import random
import statistics
from dataclasses import dataclass, replace

import orjson

# shared/ sits beside the checkout (…/main and …/shared); --trace names any other copy.
TRACE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK_TOKENS = 512  # the trace's block size


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float            # from the trace's timestamp
    num_prompt_tokens: int
    num_output_tokens: int
    block_hashes: tuple[int, ...]  # the trace's hash_ids: equal id = equal prefix up to there
    session_key: str | None     # the conversation: its second block id (the first is shared)



def load_trace(path: pathlib.Path, limit: int | None) -> list[TraceRequest]:
    requests = []
    with path.open("rb") as f:
        for line in f:
            row = orjson.loads(line)
            ids = tuple(row["hash_ids"])
            requests.append(TraceRequest(row["timestamp"] / 1000.0, row["input_length"],
                                         max(1, row["output_length"]), ids,
                                         str(ids[1]) if len(ids) > 1 else None))
            if limit is not None and len(requests) >= limit:
                break
    return requests


def spread_arrivals(requests: list[TraceRequest], seed: int) -> list[TraceRequest]:
    """The trace's timestamps come in 3-second slots (1,180 distinct ones for 12,031 requests). Spread each
    slot's requests over the slot, at sorted uniform times, so their order stays the trace's."""
    times = sorted({r.arrival_s for r in requests})
    slot_s = statistics.median(b - a for a, b in itertools.pairwise(times)) if len(times) > 1 else 0.0
    next_time = dict(zip(times, [*times[1:], times[-1] + slot_s], strict=True))
    rng = random.Random(seed)
    by_slot: dict[float, list[int]] = {}
    for i, r in enumerate(requests):
        by_slot.setdefault(r.arrival_s, []).append(i)
    spread = list(requests)
    for start, members in by_slot.items():
        offsets = sorted(rng.uniform(0.0, next_time[start] - start) for _ in members)
        for i, offset in zip(members, offsets, strict=True):
            spread[i] = replace(requests[i], arrival_s=start + offset)
    return sorted(spread, key=lambda r: r.arrival_s)


def copy_trace(requests: list[TraceRequest], num_copies: int, merge: bool) -> list[TraceRequest]:
    """`num_copies` copies of the trace played at once, for a fleet `num_copies` times as large at the same
    utilization: copy k is rotated by k/num_copies of the trace's span (what passes its end wraps to the start), as
    other users' day. `merge`: the copies share every prefix, so each conversation's is `num_copies` times as hot
    (the hot-prefix case); otherwise each copy's blocks are its own past the first (the prompt every request shares)."""
    if num_copies <= 1:
        return requests
    start_s = min(r.arrival_s for r in requests)
    span_s = max(r.arrival_s for r in requests) - start_s + 1.0
    top = 1 + max(h for r in requests for h in r.block_hashes)
    copies = []
    for k in range(num_copies):
        for r in requests:
            ids = r.block_hashes if merge or k == 0 else (r.block_hashes[0], *(h + k * top for h in r.block_hashes[1:]))
            arrival_s = start_s + (r.arrival_s - start_s + k * span_s / num_copies) % span_s
            copies.append(replace(r, arrival_s=arrival_s, block_hashes=ids,
                                  session_key=None if r.session_key is None else f"{k}:{r.session_key}"))
    return sorted(copies, key=lambda r: r.arrival_s)


def replay_unlimited(requests: list[TraceRequest]) -> tuple[float, float]:
    """Hit rate (of blocks, of tokens) of one unbounded cache in trace order, without timing."""
    seen: set[int] = set()
    num_hit_blocks = num_hit_tokens = 0
    for request in requests:
        run = 0
        while run < len(request.block_hashes) and request.block_hashes[run] in seen:
            run += 1
        num_hit_blocks += run
        num_hit_tokens += min(run * BLOCK_TOKENS, request.num_prompt_tokens)
        seen.update(request.block_hashes)
    return (num_hit_blocks / sum(len(r.block_hashes) for r in requests),
            num_hit_tokens / sum(r.num_prompt_tokens for r in requests))
