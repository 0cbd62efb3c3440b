"""What JSON mode's token masks cost on the bundled model's tokenizer: the one-off build of `TokenMasks`, and
`allowed()` for representative recognizer states, uncached (the cost of the first sequence to reach a state)
and cached; then the same for a JSON schema's grammar over the same tries, after its compile time. Prints
tables of medians.

    python benchmarks/json_mode_cost.py [--repeats 50] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from tokenizers import Tokenizer

from backends.structured_output.json_mode import START, GrammarMasks, State, TokenMasks, step
from backends.structured_output.json_output import token_bytes_of
from backends.structured_output.json_schema import compile_schema
from backends.structured_output.schema_grammar import SchemaGrammar, SchemaState
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

SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": ["string", "null"]},
        "role": {"enum": ["admin", "editor", "viewer"]}, "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "extra": {"anyOf": [{"type": "number"}, {"type": "object"}]},
    },
}
SCHEMA_STATES = [
    ("after {", b"{"),
    ("inside a key", b'{"na'),
    ("after :", b'{"name":'),
    ("inside a value string", b'{"name": "Jo'),
    ("inside an integer", b'{"name": "J", "age": 12'),
    ("after , (optional keys)", b'{"name": "J", "age": 12,'),
    ("after , and \"", b'{"name": "J", "age": 12, "'),
    ("after : of string|null", b'{"name": "J", "age": 12, "email":'),
    ("inside an enum", b'{"name": "J", "age": 12, "role": "ed'),
    ("after : of anyOf", b'{"name": "J", "age": 1, "role": "admin", "extra":'),
    ("inside a free object", b'{"name": "J", "age": 1, "role": "admin", "extra": {"k": ['),
    ("complete", b'{"name": "J", "age": 1, "role": "admin"}'),
]


def state_of(output: bytes) -> State:
    state: State | None = START
    for byte in output:
        assert state is not None
        state = step(state, byte)
    assert state is not None, output
    return state


def schema_state_of(grammar: SchemaGrammar, output: bytes) -> SchemaState:
    state: SchemaState | None = grammar.start
    for byte in output:
        assert state is not None
        state = grammar.step(state, byte)
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

    compile_ms = median_ms(partial(compile_schema, SCHEMA), args.repeats)
    grammar = compile_schema(SCHEMA)
    schema_uncached = GrammarMasks(cached.tries, grammar, max_cached_states=0)   # the tries are shared
    schema_cached = GrammarMasks(cached.tries, grammar)
    print(f"\nA JSON schema (7 properties) compiled in {compile_ms:.2f} ms; its masks")
    print(f"| {'state':<24} | {'uncached ms':>11} | {'cached ms':>9} | {'allowed':>7} |")
    print(f"|{'-' * 26}|{'-' * 13}|{'-' * 11}|{'-' * 9}|")
    for what, output in SCHEMA_STATES:
        schema_state = schema_state_of(grammar, output)
        num_allowed = int(schema_cached.allowed(schema_state).sum())
        cold = median_ms(partial(schema_uncached.allowed, schema_state), args.repeats)
        warm = median_ms(partial(schema_cached.allowed, schema_state), args.repeats)
        print(f"| {what:<24} | {cold:>11.3f} | {warm:>9.4f} | {num_allowed:>7} |")


if __name__ == "__main__":
    main()
