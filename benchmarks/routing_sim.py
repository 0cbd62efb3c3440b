"""Replay the Mooncake conversation trace against simulated workers and compare routing policies:
prefix-cache hit rate, simulated TTFT (mean/p90/p99) and load imbalance, one table, seeded.

Routing uses the real parts: `policies.make_policy`, `cache.prefix_index.PrefixIndex`,
`gateway.routing.load.LoadTracker` leases and `OutputLengthEstimator`. The index is fed one of two ways (issue 17):
*precise*, by the simulated workers' KV events (stored/evicted blocks, as our workers' `/kv_events` or vLLM's ZMQ
stream tell), or *approximate*, by the gateway's own routing decisions (`record_routed`: the blocks it sent where), in
an LRU of the worker's capacity, as an endpoint without events gets. `session_affinity` runs with the trace's
conversation as `x-session-affinity`, and without any header (the key derived from the prompt's prefix).
Worker model (deliberately simple, stated so the numbers can be read):
  - each worker prefills one request at a time, FIFO; prefill time = overhead + uncached prompt
    tokens / prefill rate, slowed by `decode_interference` per sequence decoding there;
  - decoding runs batched beside it: output tokens x time per output token;
  - a prefix cache of `cache_blocks` blocks (512 tokens, the trace's block) in LRU order; a
    request's blocks are stored when its prefill ends; a hit is the leading run of its blocks.
The prefill rate is set from `--utilization`: offered prompt tokens / (workers x duration x rate).

`--tiers` (issue 14): each policy again with KV tiers below each worker's device pool, added one at a time
(routing_sim_tiers.py): host RAM and disk per worker, then one store for all, LRUs written down on eviction
(device -> RAM -> disk -> store), then the store written through instead (every block a worker caches, as
backends/kv_connectors/tiers/connector.py does). A hit may run on through the tiers; reading a block back takes its
tokens x the medium's restore fraction of prefill time (`--cpu-restore` 1/20, `--disk-restore` 1/8,
`--store-restore` 1/5). The read-back starts when the request reaches its worker, on the worker's one load
channel in arrival order: the engine admits it at once and its connector loads while other sequences run.
The request keeps its place in the queue, and at the head its prefill waits for what is left of its load (and
for any tier block its run gained since). That is the pessimistic side of the engine, which runs the others
meanwhile and gives a loaded sequence its prefill budget in its admission place. `--restore-holds-prefill`:
the read-back starts at the head and holds the prefill instead. The gateway ranks a tier hit below a device
hit: the device run comes from the index (KV events, as above), the tier blocks past it from the workers'
tier holdings (what tier KV events would tell), each weighted 1 - its medium's restore fraction, as
prefix_aware weighs the restore fractions the workers measure and report (`--cpu-weight` etc. set a fixed
weight instead); `prefix_aware` gets the weighted count in tokens (`num_matched_blocks` with a `block_size`
of 1: it scores their product). A store block counts at every worker. `unlimited cache` is one unbounded store written
through and read for free: the hit-rate ceiling under the sim's timing.

    .venv/bin/python benchmarks/routing_sim.py [--workers 8] [--cache-blocks 2000] [--tiers]
"""
from __future__ import annotations

import heapq
import pathlib
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import orjson

from cache.prefix_index import PrefixIndex
from gateway.routing.load import Lease, LoadTracker, OutputLengthEstimator, prefill_work_tokens
from policies.base import DecisionReason, EndpointState, Policy, RequestFacts
from policies.registry import PolicyName, make_policy
from routing_sim_args import parse_args
from routing_sim_report import UNLIMITED, print_approx_ratios, print_row, print_targets, summarize
from routing_sim_rows import Row, policy_rows, replication_rows, tier_rows
from routing_sim_tiers import (
    Lru,
    Medium,
    WorkerCache,
    block_tokens,
    restore_tokens,
    tier_steps,
)
from routing_sim_trace import BLOCK_TOKENS, TraceRequest, copy_trace, load_trace, replay_unlimited, spread_arrivals

MODEL = "sim"


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_workers: int            # simulated endpoints
    cache_blocks: int           # prefix-cache capacity per worker, in 512-token blocks
    prefill_tokens_per_s: float  # one worker's prefill rate
    prefill_overhead_s: float   # fixed cost per prefill
    decode_s_per_token: float   # time per output token of one sequence (batched decode)
    decode_interference: float  # relative prefill slowdown per sequence decoding on the worker


@dataclass(slots=True)
class InFlight:
    request: TraceRequest
    worker: int
    lease: Lease
    ttft_s: float = 0.0
    num_cached_tokens: int = 0
    num_cached_blocks: int = 0
    load_s: float = 0.0       # the read-back started on arrival: its length and its end
    loaded_s: float = 0.0
    cached_tokens_by_medium: list[int] = field(default_factory=lambda: [0] * len(Medium))


@dataclass(slots=True)
class Worker:
    endpoint_id: str
    cache: WorkerCache
    queue: deque[InFlight] = field(default_factory=deque)
    busy: bool = False
    num_decoding: int = 0
    prefill_busy_s: float = 0.0
    load_free_s: float = 0.0    # when its load channel has read back every block asked of it so far
    num_requests: int = 0


class Simulation:
    """One policy over the whole trace: a heap of timed events, processed in order. With several
    gateway processes (`policies`, one each), each request reaches a random one; load is shared (leases
    or /load), a precise index too (every process hears the events), an approximate one is each process's
    own unless `row.shared`: then every decision reaches the other processes' indexes after a delay of
    two uniform draws over `share_interval_s` (the publisher's next tick, then the reader's)."""

    def __init__(self, policies: list[Policy], config: SimConfig, row: Row,
                 approx_capacity_blocks: int | None = None, seed: int = 0, share_interval_s: float = 0.25,
                 restore_holds_prefill: bool = False) -> None:
        self.policies = policies
        self.config = config
        self.tiers = row.tiers
        self.load_on_arrival = row.tiers.enabled and not restore_holds_prefill
        store = row.tiers.store_blocks
        shared_store = None if store == 0 else Lru(store)
        self.workers = [Worker(f"http://worker-{i}:8000", WorkerCache(config.cache_blocks, row.tiers, shared_store))
                        for i in range(config.num_workers)]
        self.index = PrefixIndex(max_blocks_per_endpoint=4 * config.cache_blocks)
        self.approximate = row.approximate            # the index learns from routing, not from the workers' events
        self.send_session_key = row.send_session_key  # False: requests carry no x-session-affinity
        self.lease_restores = row.lease_restores
        # Ranked tier hits reach prefix_aware as tokens: it scores num_matched_blocks x block_size, and
        # reads block_size alone only for prefix_key_tokens.
        self.sees_tiers = row.rank_tiers and row.tiers.enabled and not row.approximate   # tier KV events
        self.rank_tiers = (self.sees_tiers and row.policy is PolicyName.PREFIX_AWARE
                           and not row.options.get("prefix_key_tokens"))
        self.match_unit_tokens = 1 if self.rank_tiers else BLOCK_TOKENS
        self.indexes = [self.index]
        if row.approximate:
            self.indexes = [PrefixIndex() for _ in policies]
            for index in self.indexes:
                for worker in self.workers:  # the capacity a load report states (default: the true one)
                    index.track_routed(worker.endpoint_id, approx_capacity_blocks or config.cache_blocks)
        self._rng = random.Random(seed)           # which gateway process a request reaches
        self._share_rng = random.Random(seed + 1)  # how long a shared decision takes to reach the peers
        self.share_interval_s = share_interval_s if row.shared and len(policies) > 1 else None
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
        matched = self._matched(index, request.block_hashes)
        expected = self.estimator.estimate(MODEL, None)
        session_key = request.session_key if self.send_session_key else None
        session_endpoint = self.sessions.get(session_key) if session_key else None
        facts = RequestFacts(MODEL, request.num_prompt_tokens, expected, request.block_hashes,
                             session_key, session_endpoint, self.match_unit_tokens)
        states = [EndpointState(w.endpoint_id, True, *self.tracker.snapshot(w.endpoint_id),
                                matched.get(w.endpoint_id, 0), None) for w in self.workers]
        decision = self.policies[gateway].select(facts, states)
        assert decision is not None
        if session_key is not None:
            self.sessions[session_key] = decision.endpoint_id
        worker_index = next(i for i, w in enumerate(self.workers) if w.endpoint_id == decision.endpoint_id)
        # As the gateway's lease: the prefill work is the prompt tokens the endpoint does not hold, and those it
        # reads back from a tier at their restore fraction (as seen before this request is recorded there).
        prefill_work = self._prefill_work(index, request, self.workers[worker_index])
        index.record_routed(decision.endpoint_id, request.block_hashes)  # a no-op unless approximate
        if self.share_interval_s is not None:
            delay_s = self.share_interval_s * (self._share_rng.random() + self._share_rng.random())
            self._push(now + delay_s, "shared", (gateway, decision.endpoint_id, request.block_hashes))
        self.num_moved += decision.reason is DecisionReason.AFFINITY_MOVED
        lease = self.tracker.lease(decision.endpoint_id, prefill_work, expected)
        flight = InFlight(request, worker_index, lease)
        worker = self.workers[worker_index]
        if self.load_on_arrival:
            self._start_load(now, worker, flight)
        worker.queue.append(flight)
        worker.num_requests += 1
        if not worker.busy:
            self._start_prefill(now, worker)

    def _on_shared(self, now: float, routed: tuple[int, str, tuple[int, ...]]) -> None:
        """A peer's decision reaches every other process's approximate index."""
        gateway, endpoint_id, block_hashes = routed
        for i, index in enumerate(self.indexes):
            if i != gateway:
                index.record_routed(endpoint_id, block_hashes)

    def _matched(self, index: PrefixIndex, block_hashes: tuple[int, ...]) -> dict[str, int]:
        """Per endpoint, the prompt's leading run in units of `match_unit_tokens`: device blocks from
        the index; ranking tiers, the run's tier blocks past them added at their medium's weight."""
        device = index.matched_blocks(block_hashes)
        if not self.rank_tiers:
            return device
        matched = {}
        for worker in self.workers:
            run = device.get(worker.endpoint_id, 0)
            tail = worker.cache.peek_run(block_hashes[run:])   # the tiers' holdings past the device run
            matched[worker.endpoint_id] = int((run + sum(self.tiers.weight(m) for m in tail)) * BLOCK_TOKENS)
        return matched

    def _prefill_work(self, index: PrefixIndex, request: TraceRequest, worker: Worker) -> int:
        """`gateway.routing.load.prefill_work_tokens` of what the gateway sees at `worker`: its device run from the
        index, and the tier blocks past it when the gateway hears the tiers' events, at the restore fractions the
        workers measure (`lease_restores` off: read back for free)."""
        run = index.matched_blocks(request.block_hashes).get(worker.endpoint_id, 0)
        counts = [run, 0, 0, 0]
        for medium in worker.cache.peek_run(request.block_hashes[run:]) if self.sees_tiers else ():
            counts[medium] += 1
        t = self.tiers
        fractions = (t.cpu_restore, t.disk_restore, t.store_restore) if self.lease_restores else (0.0, 0.0, 0.0)
        return prefill_work_tokens((counts[0], counts[1], counts[2], counts[3]), BLOCK_TOKENS,
                                   request.num_prompt_tokens, fractions)

    def _start_load(self, now: float, worker: Worker, flight: InFlight) -> None:
        """The engine admits the request and its connector reads back the tier run past the device's, after
        the loads already asked of this worker."""
        request = flight.request
        run = worker.cache.peek_run(request.block_hashes)
        work = restore_tokens(self.tiers, run, request.num_prompt_tokens, BLOCK_TOKENS)
        flight.load_s = work / self.config.prefill_tokens_per_s
        flight.loaded_s = now
        if flight.load_s > 0:   # nothing to read back: nothing to wait for on the channel
            flight.loaded_s = worker.load_free_s = max(now, worker.load_free_s) + flight.load_s

    def _start_prefill(self, now: float, worker: Worker) -> None:
        flight = worker.queue.popleft()
        worker.busy = True
        request = flight.request
        c = self.config
        run = worker.cache.read_run(request.block_hashes)
        for i, medium in enumerate(run):
            flight.cached_tokens_by_medium[medium] += block_tokens(request.num_prompt_tokens, i, BLOCK_TOKENS)
            flight.num_cached_blocks += 1
        restore_s = restore_tokens(self.tiers, run, request.num_prompt_tokens, BLOCK_TOKENS) / c.prefill_tokens_per_s
        if self.load_on_arrival:  # what is left of the load, and what the run gained since it started
            restore_s = max(0.0, flight.loaded_s - now) + max(0.0, restore_s - flight.load_s)
        flight.num_cached_tokens = sum(flight.cached_tokens_by_medium)
        uncached = request.num_prompt_tokens - flight.num_cached_tokens
        slowdown = 1.0 + c.decode_interference * worker.num_decoding
        prefill_s = (c.prefill_overhead_s + uncached / c.prefill_tokens_per_s) * slowdown
        duration = restore_s + prefill_s
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
        """Cache the request's blocks on the worker (evicted ones written down to its tiers) and,
        precise, tell the index as the worker's device KV events do (stored, then evicted, in order)."""
        events = worker.cache.cache(block_hashes)
        if self.approximate:
            return
        for stored, block_hash in events:
            if stored:
                self.index.store(worker.endpoint_id, (block_hash,))
            else:
                self.index.remove(worker.endpoint_id, (block_hash,))


def main() -> None:
    args = parse_args(__doc__)
    if not args.trace.is_file():
        sys.exit(f"no trace at {args.trace}: pass --trace PATH (Mooncake's conversation trace, JSONL)")
    requests = load_trace(args.trace, args.limit)
    if args.spread_arrivals:
        requests = spread_arrivals(requests, args.seed)
    requests = copy_trace(requests, args.copies, args.merge_copies)
    duration_s = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    offered = sum(r.num_prompt_tokens for r in requests) / duration_s
    config = SimConfig(num_workers=args.workers, cache_blocks=args.cache_blocks,
                       prefill_tokens_per_s=offered / (args.workers * args.utilization),
                       prefill_overhead_s=0.02, decode_s_per_token=0.03, decode_interference=0.01)
    replay_blocks, replay_tokens = replay_unlimited(requests)
    print(f"{len(requests)} requests over {duration_s:.0f} s; {args.workers} workers, "
          f"{args.cache_blocks} cached blocks each, prefill {config.prefill_tokens_per_s:.0f} tok/s "
          f"per worker (utilization {args.utilization} without hits); seed {args.seed}; an unlimited cache in "
          f"trace order (no timing) hits {replay_blocks:.1%} of blocks, {replay_tokens:.1%} of tokens")
    seed = {"seed": args.seed}
    rows = (tier_rows(args, seed) if args.tiers else replication_rows(args, seed) if args.replication
            else policy_rows(seed))
    if args.only:
        rows = [r for r in rows if r.label == UNLIMITED or any(word in r.label for word in args.only)]
    if args.no_unlimited:
        rows = [r for r in rows if r.label != UNLIMITED]
    if args.tiers:
        print(f"tiers: {tier_steps(args)[-1][1].describe()}")
    header = (f"{'policy':<46}{'hit rate':>9}{'blocks':>8}{'of unl.':>9}{'TTFT mean':>11}{'p50':>8}{'p90':>8}"
              f"{'p99':>8}{'busy':>7}{'reqs':>7}{'moved':>6}  {'dev/cpu/disk/store':<16}{'util':>9}{'wall':>6}")
    print(header + "\n" + "-" * len(header))
    results: dict[str, dict[str, Any]] = {}
    for spec in rows:
        start = time.perf_counter()
        sim = Simulation([make_policy(spec.policy, spec.options) for _ in range(args.gateways)], config, spec,
                         args.approx_capacity, args.seed, args.share_interval, args.restore_holds_prefill)
        sim.run(requests)
        results[spec.label] = summarize(spec.label, sim, time.perf_counter() - start)
        print_row(results[spec.label], results.get(UNLIMITED))
        if args.json:
            print(orjson.dumps(results[spec.label]).decode())
    print_approx_ratios(results)
    print_targets(results, rows, replay_blocks)


if __name__ == "__main__":
    main()
