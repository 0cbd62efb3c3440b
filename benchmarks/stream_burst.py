"""What a streamed answer whose events arrive together costs the gateway's relay, step by step: the lean
client's chunked decoding (gateway/upstream/connection.py) and the SSE event counting
(gateway/server/client_stream.py), for a 32-token stream (34 events, usage and [DONE] among them) in one
read. A fast upstream, or an engine that sends tokens faster than the gateway reads, delivers streams like this.

Runs each step in this checkout and, with `--baseline PATH`, in another checkout (before a change) in the same
run, alternating, and prints best-of-repeats µs per stream for both and their ratio:

    .venv/bin/python benchmarks/stream_burst.py --baseline /tmp/before
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import timeit

from gateway_bench import median

HERE = pathlib.Path(__file__).resolve().parent


def measure(number: int, repeat: int) -> dict[str, float]:
    """µs per stream of each step, in the checkout on sys.path[0]."""
    from gateway.server.client_stream import SseCounter
    from gateway.upstream.connection import UpstreamBody, UpstreamConnection
    from gateway.upstream.deadlines import Deadlines
    from gateway_bench_load import _stream_events

    events = _stream_events()
    wire = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    data = b"".join(events)

    def decode() -> bytes:
        conn = UpstreamConnection(Deadlines())
        conn.buffer += wire
        body = UpstreamBody(conn, "chunked", 0)
        out = body._decode()
        assert body.done and out == data
        return out

    def count() -> int:
        counter = SseCounter()
        num_events = counter.feed(data)
        assert counter.usage.exact
        return num_events

    return {name: min(timeit.repeat(step, number=number, repeat=repeat)) / number * 1e6
            for name, step in (("chunked decoding", decode), ("SSE counting", count))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=pathlib.Path, help="another checkout, measured in the same run")
    parser.add_argument("--number", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of this checkout and the baseline")
    parser.add_argument("--only-here", type=pathlib.Path, help=argparse.SUPPRESS)  # internal: one checkout
    args = parser.parse_args()
    if args.only_here is not None:
        sys.path[:0] = [str(args.only_here), str(HERE)]
        print(json.dumps(measure(args.number, args.repeat)))
        return
    checkouts = {"this checkout": HERE.parent}
    if args.baseline is not None:
        checkouts["baseline"] = args.baseline.resolve()
    results: dict[str, list[dict[str, float]]] = {label: [] for label in checkouts}
    for _ in range(args.rounds):
        for label, root in checkouts.items():   # a fresh process each: the checkout's own modules
            out = subprocess.run([sys.executable, __file__, "--only-here", str(root), "--number", str(args.number),
                                  "--repeat", str(args.repeat)], check=True, capture_output=True, text=True)
            results[label].append(json.loads(out.stdout))
    print(f"µs per 34-event stream in one read, best of {args.repeat}×{args.number}, median of {args.rounds} "
          f"alternating rounds")
    print(f"{'step':<20}" + "".join(f"{label:>16}" for label in checkouts) + ("   ratio" if len(checkouts) > 1 else ""))
    for step in results["this checkout"][0]:
        medians = [median([r[step] for r in results[label]]) for label in checkouts]
        print(f"{step:<20}" + "".join(f"{m:>16.2f}" for m in medians)
              + (f"{medians[0] / medians[1]:>8.2f}" if len(medians) > 1 else ""))


if __name__ == "__main__":
    main()
