"""What the gateway does per request between admission and a chosen endpoint, at fleet size (issue 52): the
prompt's block hashes (cache/block_hash.py), then `Legs.choose` (gateway/upstream/legs.py) on a real registry,
load tracker and prefix index: the index lookup, the candidates' states or the pool's live view
(gateway/routing/live_pools.py), the policy. Each size runs every policy twice in the same process, `listed` (the
way before issue 52: every candidate's `EndpointState` per request, `LivePools` off) and `live`.

The index is full: every endpoint holds `--blocks` device blocks (a common 4-block system prompt, then chains of
64 blocks that start with one of the fleet's hot 32-block prefixes, Zipf-chosen, so prefixes are shared between
endpoints). Between decisions the load churns as in a serving gateway: a lease opens at the chosen endpoint, the
oldest of 4 x endpoints in flight is released, and 4 random ones stream output tokens; that upkeep is timed inside
`choose` (the view catches up then). Then the KV-event ingestion: `/kv_events` JSON pages parsed and applied to a
full index (each stored block evicts one), per event.

With `--tiers store` every endpoint also reads one shared store (Mooncake's) that holds every hot prefix, so each
is credited with those blocks past its device run (PrefixIndex.share_store); with `--tiers cpu` each endpoint's
host RAM tier holds 16 chains of its own. Either way each reports a measured restore fraction for the tier
(0.03-0.14 for the store, 0.003-0.04 for RAM, as CPU workers measured).

    .venv/bin/python benchmarks/routing_scale.py [--sizes 8 100 1000 5000] [--blocks 10000] [--decisions 2000] \
        [--tiers none|store|cpu]
"""
from __future__ import annotations

import argparse
import array
import gc
import math
import pathlib
import random
import statistics
import sys
import time
from collections import deque
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import orjson

from cache.block_hash import ROOT_HASH, block_hashes, hash_block_tokens
from cache.kv_events import CPU, STORE, KvEventBatch
from cache.prefix_index import PrefixIndex
from gateway.config.gateway_config import GatewayConfig, parse_config
from gateway.routing.endpoints import UpstreamRegistry
from gateway.routing.load import Lease, LoadReport, LoadTracker
from gateway.state.memory import MemoryStore
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import Tracing
from gateway.upstream.legs import Legs
from gateway.upstream.request import Progress, RoutedRequest
from policies.base import RequestFacts
from policies.registry import PolicyName, make_policy

BLOCK = 16
PROMPT_TOKENS = 2048          # a request's prompt: 128 blocks
POLICIES = (PolicyName.PREFIX_AWARE, PolicyName.SESSION_AFFINITY, PolicyName.LEAST_TOKENS,
            PolicyName.POWER_OF_TWO, PolicyName.ROUND_ROBIN)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def config_for(num_endpoints: int) -> GatewayConfig:
    urls = [f"http://w{i}:8000" for i in range(num_endpoints)]
    return parse_config(orjson.dumps({"models": {"m": {"providers": ["p"]}},
                                      "providers": {"p": {"endpoints": urls}}}).decode(), {})


def chain(parent: int, tag: int, num_blocks: int) -> list[int]:
    hashes = []
    for i in range(num_blocks):
        parent = hash_block_tokens(parent, (tag, i))
        hashes.append(parent)
    return hashes


class Fleet:
    """The registry, tracker, full index and `Legs` of one fleet size, and the hot prefixes its prompts share."""

    def __init__(self, num_endpoints: int, num_blocks: int, rng: random.Random, tiers: str = "none") -> None:
        self.config = config_for(num_endpoints)
        self.tracker, self.index = LoadTracker(), PrefixIndex()
        self.registry = UpstreamRegistry(self.config, self.tracker, self.index)
        self.pool = self.registry.pool("p")
        self.ids = [e.endpoint_id for e in self.pool]
        self.system = chain(ROOT_HASH, 1 << 31, 4)
        self.hot = [chain(self.system[-1], (1 << 30) + k, 32) for k in range(max(16, num_endpoints // 4))]
        self.weights = [1.0 / (k + 1) for k in range(len(self.hot))]
        before = rss_bytes()
        for endpoint_id in self.ids:
            self.index.set_capacity(endpoint_id, num_blocks)
            self.index.store(endpoint_id, self.system)
            n = 0
            while n < num_blocks:
                hot = rng.choices(self.hot, self.weights)[0]
                self.index.store(endpoint_id, hot + [rng.getrandbits(63) for _ in range(32)])   # its own tail
                n += 64
        if tiers == "store":   # every worker reads one Mooncake store, which holds every hot prefix
            for endpoint_id in self.ids:
                self.index.share_store(endpoint_id, "the-store")
            for hot in self.hot:
                self.index.store(self.ids[0], self.system + hot, STORE)
        elif tiers == "cpu":   # every worker's host RAM holds 16 chains its device let go
            for endpoint_id in self.ids:
                for _ in range(16):
                    hot = rng.choices(self.hot, self.weights)[0]
                    self.index.store(endpoint_id, self.system + hot + [rng.getrandbits(63) for _ in range(32)], CPU)
        for endpoint_id in self.ids if tiers != "none" else ():
            # what reading a token back costs against computing it, as CPU workers measured it (docs/benchmarks.md:
            # host RAM 0.003-0.04, a Mooncake store 0.03-0.14)
            fractions = (rng.uniform(0.003, 0.04), None, None) if tiers == "cpu" else (
                None, None, rng.uniform(0.03, 0.14))
            self.tracker.reconcile(endpoint_id, LoadReport(0, 0, 0, 0, 1000, 1000, 0, BLOCK,
                                                           restore_fractions=fractions))
        self.index_bytes = rss_bytes() - before
        self.legs = Legs(None, self.registry, self.tracker, self.index, MemoryStore(), Metrics(tuple),  # type: ignore[arg-type]
                         Tracing(self.config.tracing), 0.0)
        self.leases: deque[Lease] = deque()
        for _ in range(4 * num_endpoints):
            self.leases.append(self.tracker.lease(rng.choice(self.ids), rng.randrange(0, 4096),
                                                  rng.randrange(16, 512)))

    def churn(self, endpoint_id: str, num_uncached: int, rng: random.Random) -> None:
        self.leases.append(self.tracker.lease(endpoint_id, num_uncached, 256))
        self.leases.popleft().release()
        for _ in range(4):
            self.leases[rng.randrange(len(self.leases))].on_output_tokens(8)


def facts_for(fleet: Fleet, rng: random.Random, sessions: dict[str, str]) -> RequestFacts:
    hot = rng.choices(fleet.hot, fleet.weights)[0]
    hashes = tuple(fleet.system + hot + [rng.getrandbits(63) for _ in range(92)])   # a new tail
    session_key = f"s{rng.randrange(4 * len(fleet.ids))}"
    return RequestFacts("m", PROMPT_TOKENS, 256, hashes, session_key, sessions.get(session_key), BLOCK)


def time_decisions(fleet: Fleet, policy_name: PolicyName, live: bool, num_decisions: int,
                   seed: int) -> list[float]:
    """CPU µs per `Legs.choose`, for `num_decisions` requests with load churn between them."""
    rng = random.Random(seed)
    fleet.legs.live_pools.min_endpoints = 32 if live else math.inf
    policy = make_policy(policy_name, {} if policy_name is PolicyName.ROUND_ROBIN else {"seed": seed})
    model = fleet.config.models["m"]
    sessions: dict[str, str] = {}
    times = []
    gc.collect()
    for _ in range(num_decisions):
        facts = facts_for(fleet, rng, sessions)
        request = RoutedRequest(model, "/v1/chat/completions", {}, b"", False, facts, "r", 0.0, facts.session_key)
        progress = Progress(request, None, policy)
        start = time.thread_time_ns()   # CPU time: other processes' preemption on a loaded machine left out
        chosen = fleet.legs.choose(progress, fleet.pool, policy)
        times.append((time.thread_time_ns() - start) / 1000)
        assert chosen is not None
        sessions[facts.session_key or ""] = chosen.endpoint.endpoint_id
        fleet.churn(chosen.endpoint.endpoint_id, chosen.prefill_work, rng)
    return times


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def hashing_us(rng: random.Random, repeats: int = 200) -> float:
    prompts = [[rng.randrange(50_000) for _ in range(PROMPT_TOKENS)] for _ in range(repeats)]
    times = []
    for tokens in prompts:
        start = time.perf_counter_ns()
        block_hashes(tokens, BLOCK)
        times.append((time.perf_counter_ns() - start) / 1000)
    return statistics.median(times)


def ingestion(fleet: Fleet, num_pages: int, page_events: int) -> dict[str, float]:
    """µs per KV event: a /kv_events page's JSON parsed (`KvEventBatch.from_mapping`) and applied to the full index
    (`apply_batch`; each stored block evicts the endpoint's oldest), STORED events chained as a prompt's are."""
    endpoint_id = fleet.ids[0]
    parent, seq, pages = fleet.system[-1], 10**6, []
    for _ in range(num_pages):
        events = []
        for _ in range(page_events):
            seq += 1
            block = hash_block_tokens(parent, (seq,))
            events.append({"seq_no": seq, "kind": "stored", "block_hash": block, "parent_hash": parent,
                           "num_tokens": BLOCK, "medium": "device"})
            parent = block
        pages.append(orjson.dumps({"events": events, "next": seq, "reset": False}))
    parse_s = apply_s = 0.0
    for body in pages:
        start = time.perf_counter()
        batch = KvEventBatch.from_mapping(orjson.loads(body))
        mid = time.perf_counter()
        fleet.index.apply_batch(endpoint_id, batch)
        apply_s += time.perf_counter() - mid
        parse_s += mid - start
    num_events = num_pages * page_events
    per_event_us = (parse_s + apply_s) / num_events * 1e6
    packed_s = packed_ingestion(fleet, parent, num_pages, page_events)
    return {"parse_us": parse_s / num_events * 1e6, "apply_us": apply_s / num_events * 1e6,
            "per_event_us": per_event_us, "events_per_s": 1e6 / per_event_us,
            "packed_us": packed_s / num_events * 1e6}


def packed_ingestion(fleet: Fleet, parent: int, num_pages: int, page_events: int) -> float:
    """Seconds to apply the same number of STORED events as packed pages (one array of 64-bit block hashes per
    page, as a relay that coalesces events could send them): unpacked and stored (`PrefixIndex.store`)."""
    endpoint_id, pages = fleet.ids[-1], []
    for page in range(num_pages):
        hashes = []
        for i in range(page_events):
            parent = hash_block_tokens(parent, (page, i, 7))
            hashes.append(parent)
        pages.append(array.array("Q", hashes).tobytes())
    start = time.perf_counter()
    for body in pages:
        fleet.index.store(endpoint_id, array.array("Q", body))
    return time.perf_counter() - start


def upkeep_us(fleet: Fleet, rng: random.Random, repeats: int = 300) -> float:
    """CPU µs per changed endpoint for the live view to catch up (`LivePools` re-reading it): leases opened and
    released at random endpoints, then one `view_for`."""
    fleet.legs.live_pools.min_endpoints = 32
    fleet.legs.live_pools.view_for(fleet.pool, ())
    total_ns = num_changed = 0
    for _ in range(repeats):
        for _ in range(8):
            fleet.churn(rng.choice(fleet.ids), 512, rng)
        num_changed += len(fleet.tracker.changed)
        start = time.thread_time_ns()
        fleet.legs.live_pools.view_for(fleet.pool, ())
        total_ns += time.thread_time_ns() - start
    return total_ns / 1000 / max(1, num_changed)


def yardstick_us(n: int = 1000, repeats: int = 2000, q: float = 0.5) -> float:
    """This machine's speed now: CPU µs for `sum(range(n))` at quantile `q` (n = 1,000 on an idle 2020s core: about
    8 at the median). Its p99 against its p50 at a decision's length (n = 4,000) is the machine's own tail."""
    times = []
    for _ in range(repeats):
        start = time.thread_time_ns()
        sum(range(n))
        times.append((time.thread_time_ns() - start) / 1000)
    return p(times, q)


def machine_tail() -> str:
    """p50 / p99 CPU µs of two yardsticks about a decision's length: pure arithmetic, and 300 lookups in a dict of 2
    million keys (as the index's, missing the caches)."""
    rng = random.Random(1)
    big = {rng.getrandbits(63): None for _ in range(2_000_000)}
    keys = rng.sample(list(big), 20_000)

    def lookups() -> None:
        first = rng.randrange(len(keys) - 300)
        get = big.get
        for key in keys[first:first + 300]:
            get(key)
    times = []
    for _ in range(4000):
        start = time.thread_time_ns()
        lookups()
        times.append((time.thread_time_ns() - start) / 1000)
    arithmetic = [yardstick_us(4000, 4000, q) for q in (0.5, 0.99)]
    return (f"sum(range(4000)) p50 {arithmetic[0]:.1f} / p99 {arithmetic[1]:.1f} µs, 300 lookups in 2M keys p50 "
            f"{p(times, 0.5):.1f} / p99 {p(times, 0.99):.1f} µs")


def run_size(num_endpoints: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    num_blocks = args.blocks if num_endpoints <= 1000 else args.blocks_at_5000
    start = time.perf_counter()
    fleet = Fleet(num_endpoints, num_blocks, rng, args.tiers)
    built_s = time.perf_counter() - start
    print(f"\n{num_endpoints} endpoints x {num_blocks} blocks, KV tiers: {args.tiers}; index "
          f"{fleet.index_bytes / 2**20:.0f} MiB RSS ({fleet.index_bytes / (num_endpoints * num_blocks):.0f} B/block), "
          f"built in {built_s:.0f} s")
    rows = []
    num_decisions = args.decisions if num_endpoints <= 1000 else args.decisions // 4
    for policy_name in POLICIES:
        for live in (False, True):
            times = time_decisions(fleet, policy_name, live, num_decisions, args.seed)
            row = {"endpoints": num_endpoints, "policy": policy_name.value, "mode": "live" if live else "listed",
                   "p50_us": p(times, 0.5), "p99_us": p(times, 0.99), "decisions": num_decisions}
            rows.append(row)
            print(f"  {row['policy']:<18}{row['mode']:<8}p50 {row['p50_us']:>9.1f} µs  p99 {row['p99_us']:>9.1f} µs")
    upkeep = upkeep_us(fleet, rng)
    print(f"  live view upkeep: {upkeep:.1f} µs per changed endpoint; "
          f"yardstick sum(range(1000)) {yardstick_us():.1f} µs")
    ing = ingestion(fleet, args.pages, 256)
    print(f"  KV events into the full index: parse {ing['parse_us']:.2f} + apply {ing['apply_us']:.2f} = "
          f"{ing['per_event_us']:.2f} µs/event, {ing['events_per_s']:,.0f} events/s on one core; packed pages "
          f"{ing['packed_us']:.2f} µs/event")
    rows.append({"endpoints": num_endpoints, "ingestion": ing, "index_bytes": fleet.index_bytes, "upkeep_us": upkeep})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=[8, 100, 1000, 5000])
    parser.add_argument("--blocks", type=int, default=10_000, help="device blocks per endpoint (up to 1,000)")
    parser.add_argument("--blocks-at-5000", type=int, default=2_000, help="per endpoint above 1,000 (memory)")
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--pages", type=int, default=200, help="/kv_events pages of 256 events")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiers", choices=["none", "store", "cpu"], default="none",
                        help="store: every endpoint reads one shared KV store holding the hot prefixes; cpu: every "
                             "endpoint's host RAM tier holds 16 chains of its own")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--machine-tail", action="store_true",
                        help="first time yardsticks of a decision's length: what p99 / p50 this machine gives any code")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print(f"yardstick: sum(range(1000)) {yardstick_us():.1f} µs CPU (an idle 2020s core: about 8)")
    if args.machine_tail:
        print(f"this machine's tail: {machine_tail()}")
    print(f"block hashing, {PROMPT_TOKENS}-token prompt ({PROMPT_TOKENS // BLOCK} blocks): "
          f"{hashing_us(rng):.0f} µs median (any fleet size)")
    for num_endpoints in args.sizes:
        rows = run_size(num_endpoints, args)
        if args.json:
            for row in rows:
                print(orjson.dumps(row).decode())


if __name__ == "__main__":
    main()
