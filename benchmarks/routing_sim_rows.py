"""routing_sim.py's rows: which policies it runs, with which options, index and KV tiers."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from policies.registry import PolicyName
from routing_sim_report import UNLIMITED
from routing_sim_tiers import NO_TIERS, UNLIMITED_TIERS, StoreWrite, TierConfig, tier_steps


@dataclass(frozen=True, slots=True)
class Row:
    label: str                          # the table's first column (and --only's match)
    policy: PolicyName
    options: dict[str, Any]             # the policy's options (make_policy)
    approximate: bool = False           # the index learns from routing decisions, not from KV events
    send_session_key: bool = True       # requests carry x-session-affinity (the trace's conversation)
    tiers: TierConfig = NO_TIERS        # KV tiers below each worker's device pool (none by default)
    rank_tiers: bool = True             # the gateway scores tier hits; False: it sees device blocks only
    shared: bool = False                # approximate: processes share their routing decisions (prefix_share.py)
    lease_restores: bool = True         # a lease counts tier read-backs at their restore fraction; False: as free


def policy_rows(seed: dict[str, Any]) -> list[Row]:
    return [
        Row(UNLIMITED, PolicyName.PREFIX_AWARE, seed, tiers=UNLIMITED_TIERS),
        Row("round_robin", PolicyName.ROUND_ROBIN, {}),
        Row("least_requests", PolicyName.LEAST_REQUESTS, seed),
        Row("least_tokens", PolicyName.LEAST_TOKENS, seed),
        Row("power_of_two", PolicyName.POWER_OF_TWO, seed),
        Row("session_affinity", PolicyName.SESSION_AFFINITY, seed),
        Row("session_aff. no hdr", PolicyName.SESSION_AFFINITY, seed, send_session_key=False),
        Row("prefix_aware precise", PolicyName.PREFIX_AWARE, seed),
        Row("prefix_aware approx", PolicyName.PREFIX_AWARE, seed, approximate=True),
        Row("prefix_aware approx shared", PolicyName.PREFIX_AWARE, seed, approximate=True, shared=True),
        Row("prefix_aware approx+key", PolicyName.PREFIX_AWARE, {**seed, "prefix_key_tokens": 1024}, approximate=True),
    ]


def replication_rows(args: argparse.Namespace, seed: dict[str, Any]) -> list[Row]:
    """Issue 52: hot prefixes across a large fleet. prefix_aware as it is (load bound 1.5), with a tight bound
    (1.1: a prefix whose holders are over it is copied to the least loaded worker, by recomputing it), and with
    that bound and one store that every worker writes through, so that the new holder reads the hot prefix's KV
    from the store instead of computing it, and the router counts the store's blocks at every worker; that one
    twice: its leases counting each read-back at the store's restore fraction (as the gateway's do), and, before
    that change, as free."""
    base = tier_steps(args)[0][1]
    store = replace(base, store_blocks=args.cache_blocks * 64 if args.store_blocks is None else args.store_blocks,
                    store_write=StoreWrite.THROUGH)
    tight = {**seed, "load_factor": args.replicate_load_factor}
    return [Row(UNLIMITED, PolicyName.PREFIX_AWARE, seed, tiers=UNLIMITED_TIERS),
            Row("prefix_aware precise", PolicyName.PREFIX_AWARE, seed),
            Row(f"prefix_aware bound {args.replicate_load_factor}, recompute", PolicyName.PREFIX_AWARE, tight),
            Row(f"prefix_aware bound {args.replicate_load_factor}, copy via store, free read-backs",
                PolicyName.PREFIX_AWARE, tight, tiers=store, lease_restores=False),
            Row(f"prefix_aware bound {args.replicate_load_factor}, copy via store", PolicyName.PREFIX_AWARE, tight,
                tiers=store)]


def tier_rows(args: argparse.Namespace, seed: dict[str, Any]) -> list[Row]:
    """Each policy on a precise index with each step of tiers; then prefix_aware with local tiers, and
    with every tier, blind to tier hits (it sees device blocks only)."""
    steps = tier_steps(args)
    policies = [("round_robin", PolicyName.ROUND_ROBIN, {}), ("least_requests", PolicyName.LEAST_REQUESTS, seed),
                ("least_tokens", PolicyName.LEAST_TOKENS, seed), ("power_of_two", PolicyName.POWER_OF_TWO, seed),
                ("session_affinity", PolicyName.SESSION_AFFINITY, seed),
                ("prefix_aware", PolicyName.PREFIX_AWARE, seed)]
    rows = [Row(UNLIMITED, PolicyName.PREFIX_AWARE, seed, tiers=UNLIMITED_TIERS)]
    rows += [Row(label + suffix, name, options, tiers=tiers) for label, name, options in policies
             for suffix, tiers in steps]
    return [*rows, *(Row(f"prefix_aware{suffix}, unranked", PolicyName.PREFIX_AWARE, seed, tiers=tiers,
                         rank_tiers=False) for suffix, tiers in (steps[2], steps[-1]))]
