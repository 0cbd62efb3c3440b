"""JSON mode's recognizer against Python's json module, and its token masks against feeding every token byte by
byte (a random vocabulary, then the bundled model's own)."""
from __future__ import annotations

import json
import random
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from backends.structured_output.json_mode import MAX_DEPTH, MAX_WHITESPACE, START, State, TokenMasks, is_complete, step

PROPERTY = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])


def feed(data: bytes, state: State = START) -> list[State] | None:
    """The state after each byte; None as soon as one is refused."""
    states = []
    for byte in data:
        after = step(state, byte)
        if after is None:
            return None
        states.append(state := after)
    return states


def accepted_prefix(data: bytes) -> list[State]:
    """The states of the longest prefix of `data` that is accepted."""
    states: list[State] = []
    for byte in data:
        after = step(states[-1] if states else START, byte)
        if after is None:
            break
        states.append(after)
    return states


def final(data: bytes) -> State | None:
    states = feed(data)
    return None if states is None else (states[-1] if states else START)


def loads_object(text: str) -> bool:
    """json.loads' verdict: a JSON object (NaN and Infinity, which json.loads allows and JSON does not, are not)."""
    def refuse(name: str) -> Any:
        raise ValueError(name)

    try:
        return isinstance(json.loads(text, parse_constant=refuse), dict)
    except ValueError:
        return False


def limits(text: str) -> tuple[int, int]:
    """(longest whitespace run outside strings, deepest nesting) of a text whose strings are well formed."""
    in_string = escaped = False
    run = longest = depth = deepest = 0
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch in " \t\n\r":
            run += 1
            longest = max(longest, run)
            continue
        run = 0
        if ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "}]":
            depth -= 1
    return longest, deepest


def within_caps(text: str) -> bool:
    longest, deepest = limits(text)
    return longest <= MAX_WHITESPACE and deepest <= MAX_DEPTH


def completion(state: State) -> bytes | None:
    """The shortest bytes that close the document from `state`: a breadth-first search, bounded for safety."""
    frontier, seen = deque([(state, b"")]), {state}
    while frontier:
        current, suffix = frontier.popleft()
        if is_complete(current):
            return suffix
        if len(suffix) > 2 * MAX_DEPTH + 16:
            return None
        for byte in b'{"}]0:,truefalsn':
            after = step(current, byte)
            if after is not None and after not in seen:
                seen.add(after)
                frontier.append((after, suffix + bytes([byte])))
    return None


leaves = (st.none() | st.booleans() | st.integers(-(10**20), 10**20)
          | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=16)
objects = st.dictionaries(st.text(max_size=6), values, max_size=5)
dumps_options = st.fixed_dictionaries({
    "indent": st.sampled_from([None, 0, 1, 2]),
    "separators": st.sampled_from([None, (",", ":"), (", ", ": "), (" , ", " : ")]),
    "ensure_ascii": st.booleans(),
})


@PROPERTY
@given(objects, dumps_options, st.sampled_from(["", " ", "\n", "\r\n\t "]))
def test_every_serialized_object_is_accepted_and_completes_at_its_last_brace(
        obj: dict[str, Any], options: dict[str, Any], trailing: str) -> None:
    text = json.dumps(obj, **options)
    assume(within_caps(text + trailing))
    data = (text + trailing).encode()
    states = feed(data)
    assert states is not None
    closed = len(text.encode())
    assert [is_complete(s) for s in states] == [False] * (closed - 1) + [True] * (len(data) - closed + 1)


alphabet = st.sampled_from([*'{}[]:,"\\ \n\t0123456789-+.eEtruefalsnbu/', "é", "\x01", "x", "A"])
scraps = st.text(alphabet, max_size=24)


@st.composite
def mutated_objects(draw: st.DrawFn) -> str:
    """A serialized object with a few characters deleted, replaced or inserted: often still JSON, often not."""
    options: dict[str, Any] = draw(dumps_options)
    text = json.dumps(draw(objects), **options)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 1))
        text = text[:at] + draw(st.text(alphabet, max_size=1)) + text[at + cut:]
    return text


numbers = st.text(st.sampled_from("0123456789-+.eE"), max_size=8).map(lambda s: '{"k": [' + s + "]}")
texts = (scraps | scraps.map(lambda s: "{" + s) | scraps.map(lambda s: '{"k": ' + s) | mutated_objects()
         | numbers)


@PROPERTY
@given(texts)
def test_arbitrary_text_completes_iff_json_loads_gives_an_object(text: str) -> None:
    state = final(text.encode())
    if state is not None and is_complete(state):
        assert loads_object(text)
    if loads_object(text) and text[:1] not in (" ", "\t", "\n", "\r") and within_caps(text):
        assert state is not None and is_complete(state)


@PROPERTY
@given(texts)
def test_what_is_accepted_can_still_be_finished(text: str) -> None:
    data = text.encode()
    states = accepted_prefix(data)
    suffix = completion(states[-1] if states else START)
    assert suffix is not None
    assert loads_object((data[:len(states)] + suffix).decode())


@pytest.mark.parametrize(("text", "accepted"), [
    ('{"a": [1, -0.5e+3, true, false, null, {"b": "\\u00e9\\n\\"x\\""}]}', True),
    ("{}", True),
    ('{"é": "日本"}', True),
    (' {"a": 1}', False),          # whitespace before the object
    ("[1]", False),                # the top level must be an object
    ('"a"', False),
    ('{"a": 01}', False),
    ('{"a": 1.}', False),
    ('{"a": .5}', False),
    ('{"a": 1e}', False),
    ('{"a": -}', False),
    ('{"a": 1e5e3}', False),
    ('{"a": 1.5.2}', False),
    ('{"a": 0x1}', False),
    ('{"a": +1}', False),
    ('{"a": tru}', False),
    ('{"a": True}', False),
    ('{"a": NaN}', False),
    ('{"a": 1,}', False),
    ('{"a": [1,]}', False),
    ('{"a" 1}', False),
    ("{'a': 1}", False),
    ('{"a": "\\x"}', False),
    ('{"a": "\\u12g4"}', False),
    ('{"a": "tab\there"}', False),  # a raw control byte inside a string
    ('{"a": 1]', False),
    ('{"a": 1}}', False),
    ('{"a": 1} x', False),
    ('{"a": 1}{}', False),
])
def test_table_of_documents_agrees_with_json_loads(text: str, accepted: bool) -> None:
    state = final(text.encode())
    assert (state is not None and is_complete(state)) == accepted
    assert loads_object(text) == accepted or text.startswith(" ")


def test_whitespace_runs_and_depth_are_capped() -> None:
    limit = " " * MAX_WHITESPACE
    assert final(f'{{{limit}"a":{limit}1{limit}}}{limit}'.encode()) is not None
    assert final(b"{" + b" " * (MAX_WHITESPACE + 1)) is None
    assert final(b'{"a": 1' + b"\n" * (MAX_WHITESPACE + 1)) is None
    assert final(b"{}" + b" " * (MAX_WHITESPACE + 1)) is None
    assert final(b'{"a": "' + b" " * 100 + b'"}') is not None   # whitespace inside a string is text
    deep = '{"a":' + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "}"
    state = final(deep.encode())
    assert state is not None and is_complete(state)
    assert final(('{"a":' + "[" * MAX_DEPTH).encode()) is None


def test_states_are_hashable_and_shared() -> None:
    first, second = final(b'{"a": "xy'), final(b'{"b": "z')
    assert first is not None and first == second and len({first, second}) == 1


# --- token masks ---------------------------------------------------------------------------------------------

def brute_allowed(token_bytes: list[bytes | None], eos: set[int], state: State) -> list[bool]:
    """Token t is allowed iff each of its bytes steps from `state`; EOS iff complete; once complete, no token
    of whitespace alone (it would only pad the document)."""
    complete = is_complete(state)
    return [complete if t in eos else (feed(data, state) is not None and not (complete and not data.strip())
                                       if data else False)
            for t, data in enumerate(token_bytes)]


def random_vocab(seed: int) -> tuple[list[bytes | None], set[int]]:
    """Every byte alone (as in byte-level BPE), then pieces of JSON, text, UTF-8 and escapes glued at random."""
    rng = random.Random(seed)
    pieces = [b"{", b"}", b"[", b"]", b":", b",", b'"', b"\\", b" ", b"  ", b"\n", b"\t", b"\r", b"0", b"1",
              b"42", b"-", b"+", b".", b"e", b"E", b"true", b"false", b"null", b"tr", b"ue", b"u", b"00e9",
              b"n", b"/", b"\x01", b"abc", b"key", "é".encode(), "é".encode()[:1], "é".encode()[1:],
              "日".encode(), b'":', b'",', b'"}', b'\\"', b"\\u", b"\\n"]
    vocab: list[bytes | None] = [None, b"", b"<eos>"]
    vocab += [bytes([b]) for b in range(256)]
    vocab += [b" " * n for n in range(2, MAX_WHITESPACE + 3)]
    vocab += [b"".join(rng.choices(pieces, k=rng.randint(1, 4))) for _ in range(400)]
    vocab += [vocab[rng.randrange(3, len(vocab))] for _ in range(20)]   # the same bytes under two ids
    return vocab, {2}


@pytest.fixture(scope="module")
def small() -> tuple[list[bytes | None], set[int], TokenMasks]:
    vocab, eos = random_vocab(7)
    return vocab, eos, TokenMasks(vocab, eos)


edge_prefixes = [b"", b"{", b"{" + b" " * MAX_WHITESPACE, b'{"a', b'{"a\\', b'{"a\\u0', b'{"a\\u00e',
                 b'{"a":', b'{"a":"x', b'{"a":["x', b'{"a":{"b":"', b'{"a":-', b'{"a":0', b'{"a":12',
                 b'{"a":1.', b'{"a":1.5', b'{"a":1e', b'{"a":1e-', b'{"a":1e5', b'{"a":t', b'{"a":nul',
                 b'{"a":[', b'{"a":[1,', b'{"a":[1 ', b'{"a":1}', b'{"a":1}' + b" " * MAX_WHITESPACE,
                 b'{"a":' + b"[" * (MAX_DEPTH - 1)]


@pytest.mark.parametrize("prefix", edge_prefixes)
def test_mask_matches_brute_force_at_edge_states(small: tuple[list[bytes | None], set[int], TokenMasks],
                                                 prefix: bytes) -> None:
    vocab, eos, masks = small
    state = final(prefix)
    assert state is not None
    assert masks.allowed(state).tolist() == brute_allowed(vocab, eos, state)


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(objects, dumps_options, st.randoms(use_true_random=False))
def test_mask_matches_brute_force_along_serialized_objects(
        small: tuple[list[bytes | None], set[int], TokenMasks], obj: dict[str, Any], options: dict[str, Any],
        rng: random.Random) -> None:
    vocab, eos, masks = small
    text = json.dumps(obj, **options)
    assume(within_caps(text))
    states = feed(text.encode())
    assert states is not None
    for state in rng.sample(states, min(4, len(states))):
        assert masks.allowed(state).tolist() == brute_allowed(vocab, eos, state)


def test_advance_and_state_after_follow_the_bytes(small: tuple[list[bytes | None], set[int], TokenMasks]) -> None:
    vocab, eos, masks = small
    data = '{"a": [1, "é\\u00e9"], "b": {"c": null}}'.encode()
    token_ids = [vocab.index(bytes([b])) for b in data]
    states = feed(data)
    assert states is not None
    assert masks.state_after(token_ids) == states[-1]
    assert masks.state_after([]) == START
    assert masks.state_after(token_ids[:5]) == states[4]
    assert masks.state_after([vocab.index(b"}")]) is None
    for t, token in enumerate(vocab):
        expected = feed(token, states[3]) if token and t not in eos else None
        assert masks.advance(states[3], t) == (expected[-1] if expected else None)
    assert masks.advance(states[3], 2) is None                # EOS before the object has closed
    assert masks.advance(states[-1], 2) == states[-1]         # and after
    assert masks.advance(states[-1], len(vocab)) is None      # past the vocabulary


def test_masks_are_cached_per_state_and_evicted(small: tuple[list[bytes | None], set[int], TokenMasks]) -> None:
    vocab, eos, _ = small
    masks = TokenMasks(vocab, eos, max_cached_states=2)
    a, b, c = (final(p) for p in (b"{", b'{"a', b'{"a":1'))
    assert a is not None and b is not None and c is not None
    computed: list[object] = []
    compute = masks._compute
    masks._compute = lambda state: computed.append(state) or compute(state)  # type: ignore[method-assign]
    first = masks.allowed(a)
    cached = masks.allowed(a)                   # unpacked from the cache's bits
    assert computed == [a] and torch.equal(cached, first) and cached.dtype == torch.bool
    masks.allowed(b)
    masks.allowed(c)
    again = masks.allowed(a)                    # evicted by the cap of 2: computed again
    assert computed == [a, b, c, a] and torch.equal(again, first)


def test_masks_on_the_bundled_tokenizer_match_brute_force(smollm2_dir: Path) -> None:
    from tokenizers import Tokenizer

    from backends.structured_output.json_output import token_bytes_of

    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    vocab = token_bytes_of(smollm2_dir, tokenizer.get_vocab_size())
    eos = {2}
    masks = TokenMasks(vocab, eos)
    for prefix in (b"{", b'{"na', b'{"name": ', b'{"name": "Jo\\', b'{"n": [1, 2.5', b'{"n": [1, ', b'{"n": 1}'):
        state = final(prefix)
        assert state is not None
        allowed = masks.allowed(state)
        assert allowed.shape == (len(vocab),) and allowed.dtype == torch.bool
        assert allowed.tolist() == brute_allowed(vocab, eos, state), prefix
        assert not allowed[sorted(special - eos)].any()
