"""A compiled JSON schema's byte-level recognizer (`json_schema.compile_schema` builds it): a pushdown automaton over
compiled nodes, tracking every reading of the output at once while `anyOf` alternatives or optional keys are
undecided. Pure; immutable once built. What a schema means is `json_schema.py`'s; this module only runs nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from backends.structured_output.json_mode import MAX_DEPTH, MAX_WHITESPACE

Frame = tuple[int, int, int, int]
"""(node, phase, arg, whitespace): a position inside compiled node `node`. arg: the property index (objects),
the item count (arrays; capped at minItems when there is no maxItems), hex digits due (strings), the literal
trie's node (enums). whitespace: the current run, in phases that allow it."""
Config = tuple[Frame, ...]
"""One reading of the output so far: the open frames, outermost (the document's own) first."""
SchemaState = frozenset[Config]
"""Every reading still possible (several while `anyOf` alternatives or optional keys are undecided)."""

# Node kinds. A union is epsilon: entering it enters its concrete alternatives (`Node.alts`).
STRING, NUMBER, INTEGER, LITERAL, OBJECT, ARRAY, UNION = range(7)
# Phases. Structural ones (up to _A_AFTER) allow whitespace, but for _T_BEFORE (the document's first byte).
_T_BEFORE, _T_AFTER, _O_FIRST, _O_COLON, _O_VALUE, _O_AFTER, _O_NEXT, _A_FIRST, _A_NEXT, _A_AFTER = range(10)
_S_IN, _S_ESC, _S_HEX = range(10, 13)
_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_EXP_MARK, _N_EXP_SIGN, _N_EXP = range(20, 28)
_L = 30
_NUMBER_ENDS = frozenset({_N_ZERO, _N_INT, _N_FRAC, _N_EXP})
_NUMBER_STARTS = {0x2D: _N_MINUS, 0x30: _N_ZERO, **{b: _N_INT for b in range(0x31, 0x3A)}}
_TOP = -1   # the node of the document's own frame

_WHITESPACE = frozenset(b" \t\n\r")
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset(b'"\\/bfnrt')
UNREACHABLE = 1 << 30   # the min_depth of a node that no finite document reaches


@dataclass(slots=True)
class Node:
    """One compiled schema node; which fields mean something depends on `kind`."""

    kind: int
    targets: list[int] = field(default_factory=list)     # union: its alternatives, before flattening
    keys: list[int] = field(default_factory=list)        # object: each property's key node (a literal)
    values: list[int] = field(default_factory=list)      # object: each property's value node
    required: list[bool] = field(default_factory=list)   # object: whether each property is required
    repeat: bool = False                  # object: a map (one free-string key property, any number of times)
    items: int = 0                        # array: the item node
    min_items: int = 0
    max_items: int | None = None
    trie: int = 0                         # literal: its trie's root
    # Filled once every node is compiled (json_schema's compiler):
    cands: tuple[tuple[int, ...], ...] = ()   # object: the properties that may come next from index i
    can_close: tuple[bool, ...] = ()          # object: whether no required property remains from index i
    alts: tuple[int, ...] = ()                # the concrete nodes that entering this one enters
    min_depth: int = UNREACHABLE              # the fewest containers a document of this node opens


class SchemaGrammar:
    """A compiled schema as a `json_mode.Grammar` over `SchemaState`s. Immutable once built; share freely."""

    def __init__(self, nodes: list[Node], root: int, trie_next: list[dict[int, int]], trie_end: list[bool]) -> None:
        self._nodes = nodes
        self._root = root
        self._trie_next = trie_next
        self._trie_end = trie_end
        self.start: SchemaState = frozenset({((_TOP, _T_BEFORE, 0, 0),)})

    def step(self, state: SchemaState, byte: int) -> SchemaState | None:
        """The state after one more byte of output; None when no valid document continues with it."""
        out: set[Config] = set()
        for config in state:
            self._step(config, byte, out)
        return frozenset(out) if out else None

    def is_complete(self, state: SchemaState) -> bool:
        """Whether the output so far is a whole valid document (it may end here)."""
        for config in state:
            top = config[-1]
            if top[1] == _T_AFTER or (len(config) == 2 and self._may_end(top)):
                return True
        return False

    def plain_string(self, state: SchemaState) -> bool:
        """Whether every reading is inside a free string (no enum), where plain bytes keep the state."""
        return all(config[-1][1] == _S_IN for config in state)

    def _may_end(self, frame: Frame) -> bool:
        return frame[1] in _NUMBER_ENDS or (frame[1] == _L and self._trie_end[frame[2]])

    def _step(self, config: Config, byte: int, out: set[Config]) -> None:
        node, phase, arg, whitespace = config[-1]
        rest = config[:-1]
        if phase == _S_IN:   # the hot case
            if byte == 0x22:
                out.add(rest)
            elif byte == 0x5C:
                out.add((*rest, (node, _S_ESC, 0, 0)))
            elif byte >= 0x20:
                out.add(config)
        elif phase <= _A_AFTER:
            if byte not in _WHITESPACE:
                self._structural(rest, node, phase, arg, byte, out)
            elif phase != _T_BEFORE and whitespace < MAX_WHITESPACE:
                out.add((*rest, (node, phase, arg, whitespace + 1)))
        elif phase < _N_MINUS:
            self._escape(rest, node, phase, arg, byte, out)
        elif phase < _L:
            self._number(rest, node, phase, byte, out)
        else:
            self._literal(rest, node, arg, byte, out)

    def _structural(self, rest: Config, node: int, phase: int, arg: int, byte: int, out: set[Config]) -> None:
        if phase == _T_BEFORE:
            self._enter(self._root, byte, ((node, _T_AFTER, 0, 0),), out)
            return
        if phase == _T_AFTER:
            return
        n = self._nodes[node]
        if phase in (_O_FIRST, _O_NEXT):
            if byte == 0x22:
                for j in n.cands[arg]:
                    self._enter(n.keys[j], byte, (*rest, (node, _O_COLON, j, 0)), out)
            elif byte == 0x7D and phase == _O_FIRST and n.can_close[0]:
                out.add(rest)
        elif phase == _O_COLON:
            if byte == 0x3A:
                out.add((*rest, (node, _O_VALUE, arg, 0)))
        elif phase == _O_VALUE:
            self._enter(n.values[arg], byte, (*rest, (node, _O_AFTER, arg, 0)), out)
        elif phase == _O_AFTER:
            if byte == 0x2C and n.cands[arg + 1]:
                out.add((*rest, (node, _O_NEXT, arg + 1, 0)))
            elif byte == 0x7D and n.can_close[arg + 1]:
                out.add(rest)
        elif phase == _A_AFTER:
            if byte == 0x2C and (n.max_items is None or arg < n.max_items):
                out.add((*rest, (node, _A_NEXT, arg, 0)))
            elif byte == 0x5D and arg >= n.min_items:
                out.add(rest)
        elif byte == 0x5D and phase == _A_FIRST:
            if n.min_items == 0:
                out.add(rest)
        elif n.max_items != 0:   # _A_FIRST or _A_NEXT: an item starts
            count = arg + 1 if n.max_items is not None else min(arg + 1, n.min_items)
            self._enter(n.items, byte, (*rest, (node, _A_AFTER, count, 0)), out)

    def _enter(self, node: int, byte: int, parent: Config, out: set[Config]) -> None:
        """Start a value (or key) of `node` with `byte`, under `parent` (already in its after-the-value phase)."""
        depth = len(parent) - 1   # below a value's parent lie only containers and the document's frame
        for alt in self._nodes[node].alts:
            n = self._nodes[alt]
            kind = n.kind
            if kind == STRING:
                if byte == 0x22:
                    out.add((*parent, (alt, _S_IN, 0, 0)))
            elif kind == LITERAL:
                self._literal(parent, alt, n.trie, byte, out)
            elif kind in (OBJECT, ARRAY):
                if byte == (0x7B if kind == OBJECT else 0x5B) and depth + n.min_depth <= MAX_DEPTH:
                    out.add((*parent, (alt, _O_FIRST if kind == OBJECT else _A_FIRST, 0, 0)))
            else:
                phase = _NUMBER_STARTS.get(byte)
                if phase is not None:
                    out.add((*parent, (alt, phase, 0, 0)))

    def _escape(self, rest: Config, node: int, phase: int, digits_due: int, byte: int, out: set[Config]) -> None:
        if phase == _S_ESC:
            if byte == 0x75:
                out.add((*rest, (node, _S_HEX, 4, 0)))
            elif byte in _SIMPLE_ESCAPES:
                out.add((*rest, (node, _S_IN, 0, 0)))
        elif byte in _HEX_DIGITS:
            out.add((*rest, (node, _S_IN, 0, 0) if digits_due == 1 else (node, _S_HEX, digits_due - 1, 0)))

    def _number(self, rest: Config, node: int, phase: int, byte: int, out: set[Config]) -> None:
        digit = 0x30 <= byte <= 0x39
        after: int | None = None
        if phase == _N_MINUS:
            after = (_N_ZERO if byte == 0x30 else _N_INT) if digit else None
        elif phase in (_N_DOT, _N_EXP_SIGN):
            after = (_N_FRAC if phase == _N_DOT else _N_EXP) if digit else None
        elif phase == _N_EXP_MARK:
            after = _N_EXP_SIGN if byte in (0x2B, 0x2D) else (_N_EXP if digit else None)
        elif digit and phase != _N_ZERO:
            after = phase
        elif byte == 0x2E and phase in (_N_ZERO, _N_INT) and self._nodes[node].kind == NUMBER:
            after = _N_DOT
        elif byte in (0x65, 0x45) and phase != _N_EXP and self._nodes[node].kind == NUMBER:
            after = _N_EXP_MARK
        else:
            self._step(rest, byte, out)   # the number ended; the byte follows the value
        if after is not None:
            out.add((*rest, (node, after, 0, 0)))

    def _literal(self, parent: Config, node: int, position: int, byte: int, out: set[Config]) -> None:
        following = self._trie_next[position].get(byte)
        if following is not None:   # a literal with no continuation is whole: its frame closes at once
            out.add((*parent, (node, _L, following, 0)) if self._trie_next[following] else parent)
        if self._trie_end[position]:   # a whole literal that a longer one extends (numbers: 1 and 12)
            self._step(parent, byte, out)
