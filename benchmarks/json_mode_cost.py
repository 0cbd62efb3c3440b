"""What JSON mode's token masks cost on the bundled model's tokenizer: the one-off build of `TokenMasks`, and
`allowed()` for representative recognizer states, uncached (the cost of the first sequence to reach a state)
and cached. Prints a table of medians.

    python benchmarks/json_mode_cost.py [--repeats 50] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from tokenizers import Tokenizer

from backends.engine.json_mode import START, State, TokenMasks, step
from backends.engine.json_output import token_bytes_of
from backends.worker.loader import resolve_model

STATES = [   # (what, the output so far)
    ("after {", b"{"),
    ("inside a key string", b'{"na'),
    ("after :", b'{"name":'),
    ("after : and a space", b'{"name": '),
    ("inside a value string", b'{"name": "Jo'),
    ("inside a \\u escape", b'{"name": "Jo\\u00'),
    ("inside a number", b'{"age": 12'),
    ("after , in an array", b'{"tags": [1,'),
    ("complete", b'{"a": 1}'),
]


def state_of(output: bytes) -> State:
    state: State | None = START
    for byte in output:
        assert state is not None
        state = step(state, byte)
    assert state is not None, output
    return state


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model("smollm2")
    token_bytes = token_bytes_of(model_dir, Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size())

    start = time.perf_counter()
    TokenMasks(token_bytes, [2])
    build_s = time.perf_counter() - start
    uncached = TokenMasks(token_bytes, [2], max_cached_states=0)   # every call computes its mask
    cached = TokenMasks(token_bytes, [2])
    print(f"{len(token_bytes)} tokens; TokenMasks built in {build_s:.2f} s; median of {args.repeats}")
    print(f"| {'state':<24} | {'uncached ms':>11} | {'cached ms':>9} | {'allowed':>7} |")
    print(f"|{'-' * 26}|{'-' * 13}|{'-' * 11}|{'-' * 9}|")
    for what, output in STATES:
        state = state_of(output)
        num_allowed = int(cached.allowed(state).sum())
        cold = median_ms(partial(uncached.allowed, state), args.repeats)
        warm = median_ms(partial(cached.allowed, state), args.repeats)
        print(f"| {what:<24} | {cold:>11.3f} | {warm:>9.4f} | {num_allowed:>7} |")


if __name__ == "__main__":
    main()
