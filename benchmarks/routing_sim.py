"""Replay the Mooncake conversation trace against simulated workers and compare routing policies:
prefix-cache hit rate, simulated TTFT (mean/p90/p99) and load imbalance, one table, seeded.

Routing uses the real parts: `policies.make_policy`, `cache.prefix_index.PrefixIndex`, `gateway.load.LoadTracker`
leases and `OutputLengthEstimator`. The index is fed one of two ways (issue 17): *precise*, by the simulated
workers' KV events (stored/evicted blocks, as our workers' `/kv_events` or vLLM's ZMQ stream tell), or
*approximate*, by the gateway's own routing decisions (`record_routed`: the blocks it sent where), in an LRU
of the worker's capacity, as an endpoint without events gets. `session_affinity` runs with the trace's
conversation as `x-session-affinity`, and without any header (the key derived from the prompt's prefix).
Worker model (deliberately simple, stated so the numbers can be read):
  - each worker prefills one request at a time, FIFO; prefill time = overhead + uncached prompt
    tokens / prefill rate, slowed by `decode_interference` per sequence decoding there;
  - decoding runs batched beside it: output tokens x time per output token;
  - a prefix cache of `cache_blocks` blocks (512 tokens, the trace's block) in LRU order; a
    request's blocks are stored when its prefill ends; a hit is the leading run of its blocks.
The prefill rate is set from `--utilization`: offered prompt tokens / (workers x duration x rate).

    .venv/bin/python benchmarks/routing_sim.py [--workers 8] [--cache-blocks 2000]
"""
from __future__ import annotations

import argparse
import heapq
import pathlib
import random
import statistics
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import orjson

from cache.prefix_index import PrefixIndex
from gateway.load import Lease, LoadTracker, OutputLengthEstimator
from policies.base import DecisionReason, EndpointState, Policy, RequestFacts
from policies.registry import PolicyName, make_policy

# shared/ sits beside the checkout (…/main and …/shared); --trace names any other copy.
TRACE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK_TOKENS = 512  # the trace's block size
MODEL = "sim"


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_workers: int            # simulated endpoints
    cache_blocks: int           # prefix-cache capacity per worker, in 512-token blocks
    prefill_tokens_per_s: float  # one worker's prefill rate
    prefill_overhead_s: float   # fixed cost per prefill
    decode_s_per_token: float   # time per output token of one sequence (batched decode)
    decode_interference: float  # relative prefill slowdown per sequence decoding on the worker


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float            # from the trace's timestamp
    num_prompt_tokens: int
    num_output_tokens: int
    block_hashes: tuple[int, ...]  # the trace's hash_ids: equal id = equal prefix up to there
    session_key: str | None     # the conversation: its second block id (the first is shared)


@dataclass(slots=True)
class InFlight:
    request: TraceRequest
    worker: int
    lease: Lease
    ttft_s: float = 0.0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class Worker:
    endpoint_id: str
    queue: deque[InFlight] = field(default_factory=deque)
    busy: bool = False
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)
    num_decoding: int = 0
    prefill_busy_s: float = 0.0
    num_requests: int = 0


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


class Simulation:
    """One policy over the whole trace: a heap of timed events, processed in order. With several
    gateway processes (`policies`, one each), each request reaches a random one; load is shared (leases
    or /load), a precise index too (every process hears the events), an approximate one is not."""

    def __init__(self, policies: list[Policy], config: SimConfig, approximate: bool = False,
                 send_session_key: bool = True, approx_capacity_blocks: int | None = None, seed: int = 0) -> None:
        self.policies = policies
        self.config = config
        self.workers = [Worker(f"http://worker-{i}:8000") for i in range(config.num_workers)]
        self.index = PrefixIndex(max_blocks_per_endpoint=4 * config.cache_blocks)
        self.approximate = approximate            # the index learns from routing, not from the workers' events
        self.send_session_key = send_session_key  # False: requests carry no x-session-affinity
        self.indexes = [self.index]
        if approximate:
            self.indexes = [PrefixIndex() for _ in policies]
            for index in self.indexes:
                for worker in self.workers:  # the capacity a load report states (default: the true one)
                    index.track_routed(worker.endpoint_id, approx_capacity_blocks or config.cache_blocks)
        self._rng = random.Random(seed)           # which gateway process a request reaches
        self.tracker = LoadTracker()
        self.estimator = OutputLengthEstimator()
        self.sessions: dict[str, str] = {}
        self.finished: list[InFlight] = []
        self.num_moved = 0
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = 0

    def run(self, requests: list[TraceRequest]) -> None:
        for request in requests:
            self._push(request.arrival_s, "arrive", request)
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            getattr(self, f"_on_{kind}")(now, payload)

    def _push(self, at_s: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at_s, self._seq, kind, payload))

    def _on_arrive(self, now: float, request: TraceRequest) -> None:
        gateway = self._rng.randrange(len(self.policies))
        index = self.indexes[gateway] if self.approximate else self.index
        matched = index.matched_blocks(request.block_hashes)
        expected = self.estimator.estimate(MODEL, None)
        session_key = request.session_key if self.send_session_key else None
        session_endpoint = self.sessions.get(session_key) if session_key else None
        facts = RequestFacts(MODEL, request.num_prompt_tokens, expected, request.block_hashes,
                             session_key, session_endpoint, BLOCK_TOKENS)
        states = [EndpointState(w.endpoint_id, True, *self.tracker.snapshot(w.endpoint_id),
                                matched.get(w.endpoint_id, 0), None) for w in self.workers]
        decision = self.policies[gateway].select(facts, states)
        assert decision is not None
        if session_key is not None:
            self.sessions[session_key] = decision.endpoint_id
        index.record_routed(decision.endpoint_id, request.block_hashes)  # a no-op unless approximate
        self.num_moved += decision.reason is DecisionReason.AFFINITY_MOVED
        worker_index = next(i for i, w in enumerate(self.workers) if w.endpoint_id == decision.endpoint_id)
        lease = self.tracker.lease(decision.endpoint_id, request.num_prompt_tokens, expected)
        flight = InFlight(request, worker_index, lease)
        worker = self.workers[worker_index]
        worker.queue.append(flight)
        worker.num_requests += 1
        if not worker.busy:
            self._start_prefill(now, worker)

    def _start_prefill(self, now: float, worker: Worker) -> None:
        flight = worker.queue.popleft()
        worker.busy = True
        run = 0
        for block_hash in flight.request.block_hashes:
            if block_hash not in worker.lru:
                break
            worker.lru.move_to_end(block_hash)
            run += 1
        flight.num_cached_tokens = min(run * BLOCK_TOKENS, flight.request.num_prompt_tokens)
        uncached = flight.request.num_prompt_tokens - flight.num_cached_tokens
        c = self.config
        duration = (c.prefill_overhead_s + uncached / c.prefill_tokens_per_s) * (
            1.0 + c.decode_interference * worker.num_decoding)
        worker.prefill_busy_s += duration
        self._push(now + duration, "prefill_done", flight)

    def _on_prefill_done(self, now: float, flight: InFlight) -> None:
        worker = self.workers[flight.worker]
        flight.ttft_s = now - flight.request.arrival_s
        flight.lease.prefill_done()
        self._store_blocks(worker, flight.request.block_hashes)
        worker.num_decoding += 1
        self._push(now + flight.request.num_output_tokens * self.config.decode_s_per_token,
                   "decode_done", flight)
        worker.busy = False
        if worker.queue:
            self._start_prefill(now, worker)

    def _on_decode_done(self, now: float, flight: InFlight) -> None:
        worker = self.workers[flight.worker]
        worker.num_decoding -= 1
        flight.lease.release()
        self.estimator.observe(MODEL, flight.request.num_output_tokens)
        self.finished.append(flight)

    def _store_blocks(self, worker: Worker, block_hashes: tuple[int, ...]) -> None:
        """Cache the request's blocks on the worker and, precise, tell the index as the worker's KV
        events do (stored, then evicted, in order)."""
        tell = not self.approximate
        for block_hash in block_hashes:
            if block_hash in worker.lru:
                worker.lru.move_to_end(block_hash)
                continue
            worker.lru[block_hash] = None
            if tell:
                self.index.store(worker.endpoint_id, (block_hash,))
            if len(worker.lru) > self.config.cache_blocks:
                evicted, _ = worker.lru.popitem(last=False)
                if tell:
                    self.index.remove(worker.endpoint_id, (evicted,))

def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def summarize(name: str, sim: Simulation, wall_s: float) -> dict[str, Any]:
    ttfts = sorted(f.ttft_s for f in sim.finished)
    prompt = sum(f.request.num_prompt_tokens for f in sim.finished)
    cached = sum(f.num_cached_tokens for f in sim.finished)
    busy = [w.prefill_busy_s for w in sim.workers]
    counts = [w.num_requests for w in sim.workers]
    leftover = [sim.tracker.snapshot(w.endpoint_id) for w in sim.workers]
    assert all(s == (0, 0, 0) for s in leftover), leftover  # every lease released
    return {"policy": name, "hit_rate": cached / prompt, "ttft_mean_s": statistics.fmean(ttfts),
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
            "ttft_p99_s": percentile(ttfts, 0.99),
            "busy_imbalance": max(busy) / statistics.fmean(busy),
            "request_imbalance": max(counts) / statistics.fmean(counts),
            "moved": sim.num_moved, "wall_s": wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=pathlib.Path, default=TRACE)
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--cache-blocks", type=int, default=2000, help="per worker, 512-token blocks")
    parser.add_argument("--utilization", type=float, default=0.8,
                        help="offered prefill load / fleet prefill capacity, with no cache hits")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print one JSON line per policy")
    parser.add_argument("--gateways", type=int, default=1,
                        help="gateway processes (switchyard gateway --workers N), each request to a random one")
    parser.add_argument("--approx-capacity", type=int, default=None,
                        help="blocks the approximate index assumes per worker (default: --cache-blocks)")
    parser.add_argument("--only", nargs="*", help="run only the rows whose label contains one of these words")
    args = parser.parse_args()
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}: pass --trace PATH (Mooncake's conversation trace, JSONL)")

    requests = load_trace(args.trace, args.limit)
    duration_s = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    offered = sum(r.num_prompt_tokens for r in requests) / duration_s
    config = SimConfig(num_workers=args.workers, cache_blocks=args.cache_blocks,
                       prefill_tokens_per_s=offered / (args.workers * args.utilization),
                       prefill_overhead_s=0.02, decode_s_per_token=0.03, decode_interference=0.01)
    print(f"{len(requests)} requests over {duration_s:.0f} s; {args.workers} workers, "
          f"{args.cache_blocks} cached blocks each, prefill {config.prefill_tokens_per_s:.0f} tok/s "
          f"per worker (utilization {args.utilization} without hits); seed {args.seed}")
    seed = {"seed": args.seed}
    # (label, policy, options, approximate index, requests carry x-session-affinity)
    policies: list[tuple[str, PolicyName, dict[str, Any], bool, bool]] = [
        ("round_robin", PolicyName.ROUND_ROBIN, {}, False, True),
        ("least_requests", PolicyName.LEAST_REQUESTS, seed, False, True),
        ("least_tokens", PolicyName.LEAST_TOKENS, seed, False, True),
        ("power_of_two", PolicyName.POWER_OF_TWO, seed, False, True),
        ("session_affinity", PolicyName.SESSION_AFFINITY, seed, False, True),
        ("session_aff. no hdr", PolicyName.SESSION_AFFINITY, seed, False, False),
        ("prefix_aware precise", PolicyName.PREFIX_AWARE, seed, False, True),
        ("prefix_aware approx", PolicyName.PREFIX_AWARE, seed, True, True),
        ("prefix_aware approx+key", PolicyName.PREFIX_AWARE, {**seed, "prefix_key_tokens": 1024}, True, True),
    ]
    if args.only:
        policies = [p for p in policies if any(word in p[0] for word in args.only)]
    header = (f"{'policy':<25}{'hit rate':>9}{'TTFT mean':>11}{'p50':>8}{'p90':>8}{'p99':>8}"
              f"{'busy max/mean':>15}{'reqs max/mean':>15}{'moved':>7}{'wall':>7}")
    print(header)
    print("-" * len(header))
    hit_rates: dict[str, float] = {}
    for label, name, options, approximate, send_session_key in policies:
        start = time.perf_counter()
        sim = Simulation([make_policy(name, options) for _ in range(args.gateways)], config, approximate,
                         send_session_key, args.approx_capacity, args.seed)
        sim.run(requests)
        row = summarize(label, sim, time.perf_counter() - start)
        print(f"{label:<25}{row['hit_rate']:>9.1%}{row['ttft_mean_s']:>10.2f}s{row['ttft_p50_s']:>7.2f}s"
              f"{row['ttft_p90_s']:>7.2f}s{row['ttft_p99_s']:>7.2f}s{row['busy_imbalance']:>15.2f}"
              f"{row['request_imbalance']:>15.2f}{row['moved']:>7}{row['wall_s']:>6.1f}s")
        if args.json:
            print(orjson.dumps(row).decode())
        hit_rates[label] = row["hit_rate"]
    if "prefix_aware precise" in hit_rates and "prefix_aware approx" in hit_rates:
        print(f"approximate reaches {hit_rates['prefix_aware approx'] / hit_rates['prefix_aware precise']:.1%} "
              "of precise's hit rate")


if __name__ == "__main__":
    main()
