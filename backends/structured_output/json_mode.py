"""JSON mode's grammar: a byte-level pushdown recognizer of one JSON object (RFC 8259, top level an object) and,
per tokenizer, the mask of tokens that keep the output a valid prefix under any byte-level `Grammar` (this one,
or a compiled JSON schema's). Pure: no engine, sampler or device code; masks are CPU bool tensors that the
caller moves and applies.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

MAX_WHITESPACE = 16   # consecutive whitespace bytes outside strings: a small model can loop on them forever
MAX_DEPTH = 32        # open objects and arrays

State = tuple[int, str, int]
"""(mode, stack, aux), immutable and hashable. mode: one of the `_*` modes below. stack: the open containers,
outermost first, as "{" and "[" characters. aux: the whitespace run in a structural mode, the hex digits still
due in a \\u escape, the bytes of a literal matched so far; otherwise 0."""

# Structural modes (aux = the current whitespace run).
_START, _OBJ_FIRST, _OBJ_KEY, _COLON, _VALUE, _ARR_FIRST, _AFTER, _DONE = range(8)
# Inside a value string, then inside a key string: plain, after a backslash, in \uXXXX (aux = digits due).
_STR, _STR_ESC, _STR_HEX, _KEY, _KEY_ESC, _KEY_HEX = range(10, 16)
# Inside a number: after "-", after a leading "0", integer digits, after ".", fraction digits, after "e",
# after the exponent's sign, exponent digits.
_MINUS, _ZERO, _INT, _DOT, _FRAC, _EXP_MARK, _EXP_SIGN, _EXP = range(20, 28)
# Inside a literal (aux = bytes matched).
_TRUE, _FALSE, _NULL = range(30, 33)

START: State = (_START, "", 0)

_WHITESPACE = frozenset(b" \t\n\r")
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset(b'"\\/bfnrt')
_LITERALS = {_TRUE: b"true", _FALSE: b"false", _NULL: b"null"}
_LITERAL_STARTS = {ord("t"): _TRUE, ord("f"): _FALSE, ord("n"): _NULL}
_STRING_SPECIAL = re.compile(rb'["\\\x00-\x1f]')   # the bytes that end or escape a string, or may not be in one


def step(state: State, byte: int) -> State | None:
    """The state after one more byte of output; None when no valid document continues with it."""
    mode, stack, aux = state
    if mode in (_STR, _KEY):   # the hot case: most bytes of most outputs
        if byte == 0x22:
            return (_COLON, stack, 0) if mode == _KEY else (_AFTER, stack, 0)
        if byte == 0x5C:
            return (mode + 1, stack, 0)
        return state if byte >= 0x20 else None
    if mode < _STR:
        return _structural(mode, stack, aux, byte)
    if mode < _MINUS:
        return _escape(mode, stack, aux, byte)
    if mode < _TRUE:
        return _number(mode, stack, byte)
    word = _LITERALS[mode]
    if byte != word[aux]:
        return None
    return (_AFTER, stack, 0) if aux + 1 == len(word) else (mode, stack, aux + 1)


def is_complete(state: State) -> bool:
    """Whether the top-level object has closed (the output may end here)."""
    return state[0] == _DONE


def plain_string(state: State) -> bool:
    """Whether the output is inside a string, where any byte but '"', '\\' and control bytes keeps the state."""
    return state[0] in (_STR, _KEY)


S = TypeVar("S", bound=Hashable)


class Grammar(Protocol[S]):
    """A byte-level recognizer, as `TokenMasks` walks it. States are immutable and hashable (masks are cached by
    state). `plain_string(state)` promises that every byte >= 0x20 other than '"' and '\\' steps `state` to
    itself: the masks then allow every token of such bytes at once and walk only the others."""

    @property
    def start(self) -> S: ...

    def step(self, state: S, byte: int) -> S | None: ...

    def is_complete(self, state: S) -> bool: ...

    def plain_string(self, state: S) -> bool: ...


class JsonObject:
    """JSON mode's grammar (one JSON object) as a `Grammar`: the functions of this module."""

    start: State = START
    step = staticmethod(step)
    is_complete = staticmethod(is_complete)
    plain_string = staticmethod(plain_string)


def _structural(mode: int, stack: str, whitespace: int, byte: int) -> State | None:
    if byte in _WHITESPACE:
        if mode == _START or whitespace >= MAX_WHITESPACE:
            return None
        return (mode, stack, whitespace + 1)
    if mode in (_VALUE, _ARR_FIRST):
        if byte == 0x5D and mode == _ARR_FIRST:
            return _close(stack)
        return _value_start(stack, byte)
    if mode == _AFTER:
        top = stack[-1]
        if byte == 0x2C:
            return (_OBJ_KEY if top == "{" else _VALUE, stack, 0)
        if (byte == 0x7D and top == "{") or (byte == 0x5D and top == "["):
            return _close(stack)
        return None
    if mode in (_OBJ_FIRST, _OBJ_KEY):
        if byte == 0x22:
            return (_KEY, stack, 0)
        return _close(stack) if byte == 0x7D and mode == _OBJ_FIRST else None
    if mode == _COLON:
        return (_VALUE, stack, 0) if byte == 0x3A else None
    if mode == _START:
        return (_OBJ_FIRST, "{", 0) if byte == 0x7B else None
    return None   # _DONE: only whitespace may follow


def _close(stack: str) -> State:
    rest = stack[:-1]
    return (_AFTER, rest, 0) if rest else (_DONE, "", 0)


def _value_start(stack: str, byte: int) -> State | None:
    if byte == 0x22:
        return (_STR, stack, 0)
    if byte == 0x7B or byte == 0x5B:
        if len(stack) >= MAX_DEPTH:
            return None
        return (_OBJ_FIRST if byte == 0x7B else _ARR_FIRST, stack + chr(byte), 0)
    if byte == 0x2D:
        return (_MINUS, stack, 0)
    if byte == 0x30:
        return (_ZERO, stack, 0)
    if 0x31 <= byte <= 0x39:
        return (_INT, stack, 0)
    literal = _LITERAL_STARTS.get(byte)
    return None if literal is None else (literal, stack, 1)


def _escape(mode: int, stack: str, digits_due: int, byte: int) -> State | None:
    string = _KEY if mode >= _KEY else _STR
    if mode == string + 1:   # right after the backslash
        if byte == 0x75:
            return (string + 2, stack, 4)
        return (string, stack, 0) if byte in _SIMPLE_ESCAPES else None
    if byte not in _HEX_DIGITS:
        return None
    return (string, stack, 0) if digits_due == 1 else (mode, stack, digits_due - 1)


def _number(mode: int, stack: str, byte: int) -> State | None:
    digit = 0x30 <= byte <= 0x39
    if mode == _MINUS:
        return ((_ZERO if byte == 0x30 else _INT), stack, 0) if digit else None
    if mode in (_DOT, _EXP_SIGN):
        return ((_FRAC if mode == _DOT else _EXP), stack, 0) if digit else None
    if mode == _EXP_MARK:
        if byte == 0x2B or byte == 0x2D:
            return (_EXP_SIGN, stack, 0)
        return (_EXP, stack, 0) if digit else None
    # _ZERO, _INT, _FRAC, _EXP: the number may end here
    if digit and mode != _ZERO:
        return (mode, stack, 0)
    if byte == 0x2E and mode in (_ZERO, _INT):
        return (_DOT, stack, 0)
    if (byte == 0x65 or byte == 0x45) and mode != _EXP:
        return (_EXP_MARK, stack, 0)
    return _structural(_AFTER, stack, 0, byte)   # the number ended; the byte follows a value


class _Node:
    """A radix-trie node: edges labelled with one or more bytes, and the tokens that end here."""

    __slots__ = ("edges", "ids")

    def __init__(self) -> None:
        self.edges: list[tuple[bytes, _Node]] = []
        self.ids: list[int] = []


def _build_trie(pieces: dict[bytes, list[int]]) -> _Node:
    """The radix trie of the non-empty byte strings in `pieces`, each node holding the ids spelled by its path."""
    keys = sorted(pieces)

    def build(lo: int, hi: int, depth: int) -> _Node:   # keys[lo:hi] share their first `depth` bytes
        node = _Node()
        if len(keys[lo]) == depth:   # sorted: the one key that ends here comes first
            node.ids = pieces[keys[lo]]
            lo += 1
        while lo < hi:
            first, end = keys[lo][depth], lo + 1
            while end < hi and keys[end][depth] == first:
                end += 1
            a, b = keys[lo], keys[end - 1]   # sorted: their common prefix is the group's
            common = depth + 1
            while common < len(a) and common < len(b) and a[common] == b[common]:
                common += 1
            node.edges.append((a[depth:common], build(lo, end, common)))
            lo = end
        return node

    return build(0, len(keys), 0) if keys else _Node()


def _walk(root: _Node, step: Callable[[S, int], S | None], state: S, out: list[int]) -> None:
    """Append to `out` every token of the trie whose bytes all step from `state` without failing."""
    todo = [(root, state)]
    while todo:
        node, start = todo.pop()
        for label, child in node.edges:
            current = start
            for byte in label:
                after = step(current, byte)
                if after is None:
                    break
                current = after
            else:
                out.extend(child.ids)
                if child.edges:
                    todo.append((child, current))


class VocabularyTries:
    """Per tokenizer, for every grammar: the vocabulary as byte tries (under a second and about 20 MB for a 49k
    vocab: build once, share between grammars). Read-only once built."""

    def __init__(self, token_bytes: Sequence[bytes | None], eos_token_ids: Iterable[int]) -> None:
        """token_bytes[i]: token i's exact bytes; None or b"" for a token never emitted in JSON (special
        tokens: their text would land inside a string). Masks over these tries are [len(token_bytes)]."""
        self.vocab_size = len(token_bytes)
        self.eos = frozenset(eos_token_ids)
        self.eos_index = np.array(sorted(t for t in self.eos if 0 <= t < self.vocab_size), dtype=np.int64)
        self.token_bytes = [b"" if data is None or i in self.eos else data for i, data in enumerate(token_bytes)]
        pieces: dict[bytes, list[int]] = {}
        tails: dict[bytes, list[int]] = {}   # from the first '"' or '\\' on, of tokens that have one
        plain: list[int] = []
        for token_id, data in enumerate(self.token_bytes):
            if not data:
                continue
            pieces.setdefault(data, []).append(token_id)
            special = _STRING_SPECIAL.search(data)
            if special is None:
                plain.append(token_id)
            elif data[special.start()] >= 0x20:
                tails.setdefault(data[special.start():], []).append(token_id)
        self.trie = _build_trie(pieces)
        # Inside a string, a plain byte leaves a plain-interior state as it was; so a plain token is allowed in
        # every such state, and any other token's fate is its tail's (one with a control byte first: refused).
        self.string_trie = _build_trie(tails)
        self.plain_mask = np.zeros(self.vocab_size, dtype=np.bool_)
        self.plain_mask[plain] = True
        # Tokens of whitespace alone: once a document is whole they would only pad it, so EOS is its one way on.
        self.blank_mask = np.array([bool(data) and not data.strip(b" \t\n\r") for data in self.token_bytes],
                                   dtype=np.bool_)


class GrammarMasks(Generic[S]):
    """Which tokens may follow a grammar state, over shared `VocabularyTries`: cheap to build, one per grammar.
    The cache keeps each state's mask as bits (6 KB for a 49k vocab: 4,096 states take 25 MB) and unpacks it per
    call (about 10 µs). Not thread-safe (the per-state cache is unlocked)."""

    def __init__(self, tries: VocabularyTries, grammar: Grammar[S], max_cached_states: int = 4096) -> None:
        self.tries = tries
        self.grammar = grammar
        self.vocab_size = tries.vocab_size
        self._max_cached_states = max_cached_states
        self._cache: OrderedDict[S, np.ndarray] = OrderedDict()

    def allowed(self, state: S) -> torch.Tensor:
        """[vocab] bool: token t is allowed iff each of its bytes steps from `state`; EOS iff the document is
        complete. A new tensor each call (the cache holds the bits)."""
        bits = self._cache.get(state)
        if bits is None:
            mask = self._compute(state)
            self._cache[state] = np.packbits(mask)
            if len(self._cache) > self._max_cached_states:
                self._cache.popitem(last=False)
            return torch.from_numpy(mask)
        self._cache.move_to_end(state)
        return torch.from_numpy(np.unpackbits(bits, count=self.vocab_size).view(np.bool_))

    def advance(self, state: S, token_id: int) -> S | None:
        """The state after the token's bytes; None when it is not allowed. EOS (once allowed) keeps the state."""
        if token_id in self.tries.eos:
            return state if self.grammar.is_complete(state) else None
        data = self.tries.token_bytes[token_id] if 0 <= token_id < self.vocab_size else b""
        if not data:
            return None
        step = self.grammar.step
        for byte in data:
            after = step(state, byte)
            if after is None:
                return None
            state = after
        return state

    def state_after(self, token_ids: Iterable[int]) -> S | None:
        """The state after these tokens from the start (to resume an output); None when they begin no document."""
        state = self.grammar.start
        for token_id in token_ids:
            after = self.advance(state, token_id)
            if after is None:
                return None
            state = after
        return state

    def _compute(self, state: S) -> np.ndarray:
        # numpy, not torch, builds the mask: torch fills 49k elements on two threads, and under CPU contention
        # waiting for the second one cost milliseconds.
        tries, ids = self.tries, list[int]()
        if self.grammar.plain_string(state):
            _walk(tries.string_trie, self.grammar.step, state, ids)
            mask = tries.plain_mask.copy()
        else:
            _walk(tries.trie, self.grammar.step, state, ids)
            mask = np.zeros(self.vocab_size, dtype=np.bool_)
        mask[ids] = True
        if self.grammar.is_complete(state):
            mask &= ~tries.blank_mask
            mask[tries.eos_index] = True
        return mask


class TokenMasks(GrammarMasks[State]):
    """JSON mode's masks in one call: the JSON-object grammar over tries built here (under a second for a 49k
    vocab). `.tries` serves further grammars of the same tokenizer."""

    def __init__(self, token_bytes: Sequence[bytes | None], eos_token_ids: Iterable[int],
                 max_cached_states: int = 4096) -> None:
        super().__init__(VocabularyTries(token_bytes, eos_token_ids), JsonObject(), max_cached_states)
