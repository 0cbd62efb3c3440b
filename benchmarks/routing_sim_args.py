"""routing_sim.py's command line."""
from __future__ import annotations

import argparse
import pathlib

from routing_sim_tiers import add_tier_arguments
from routing_sim_trace import TRACE


def parse_args(description: str | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=pathlib.Path, default=TRACE)
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--cache-blocks", type=int, default=2000, help="per worker, 512-token blocks")
    parser.add_argument("--utilization", type=float, default=0.8,
                        help="offered prefill load / fleet prefill capacity, with no cache hits")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spread-arrivals", action="store_true",
                        help="spread each 3-second timestamp slot's requests over the slot, in trace order")
    parser.add_argument("--json", action="store_true", help="also print one JSON line per policy")
    parser.add_argument("--gateways", type=int, default=1,
                        help="gateway processes (switchyard gateway --workers N), each request to a random one")
    parser.add_argument("--approx-capacity", type=int, default=None,
                        help="blocks the approximate index assumes per worker (default: --cache-blocks)")
    parser.add_argument("--share-interval", type=float, default=0.25,
                        help="approx shared: seconds between a process's publishing and reading its peers'")
    parser.add_argument("--copies", type=int, default=1,
                        help="play this many copies of the trace at once (a fleet this many times as large: pass "
                             "--workers accordingly, for the same utilization)")
    parser.add_argument("--merge-copies", action="store_true",
                        help="the copies share every prefix (hot prefixes); default: their own past the first block")
    parser.add_argument("--only", nargs="*", help="run only the rows whose label contains one of these words")
    parser.add_argument("--no-unlimited", action="store_true",
                        help="skip the unlimited cache's row (run it in another process: the sim is seeded)")
    parser.add_argument("--replication", action="store_true",
                        help="issue 52: prefix_aware, with a tight load bound, and copying hot prefixes via the store")
    parser.add_argument("--replicate-load-factor", type=float, default=1.1,
                        help="--replication: the tight load bound")
    add_tier_arguments(parser)
    return parser.parse_args()
