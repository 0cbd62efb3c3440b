"""Compiled JSON schemas against documents: valid ones (drawn from each schema, serialized in schema order with
varied whitespace) are accepted and complete at their last byte; invalid ones are refused; whatever completes
parses and validates; what is accepted can be finished (compiling and token masks: test_json_schema_compile.py).
jsonschema is not installed, so `valid` below is a small independent validator of the keywords used here."""
from __future__ import annotations

import json
from collections import deque
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from backends.structured_output.json_mode import MAX_DEPTH, MAX_WHITESPACE
from backends.structured_output.json_schema import compile_schema
from backends.structured_output.schema_grammar import SchemaGrammar
from tests.backends.structured_output.test_json_mode import within_caps

PROPERTY = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])

_ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                             "zip": {"type": "string"}},
            "required": ["street", "city"], "additionalProperties": False}
_CIRCLE = {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
           "required": ["kind", "r"], "additionalProperties": False}
_RECT = {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "number"},
                                          "h": {"type": "number"}},
         "required": ["kind", "w", "h"], "additionalProperties": False}
SCHEMAS: dict[str, Any] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "description": "full name"}, "age": {"type": "integer"},
        "email": {"type": ["string", "null"], "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}}, "address": _ADDRESS},
        "required": ["name", "age"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "color": {"type": "string", "enum": ["red", "green", "café", "a\"b"]},
        "size": {"enum": [1, 12, 1.5, None, True, "L"]}},
        "required": ["color", "size"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"nick": {"type": ["string", "null"]},
                                                  "score": {"type": ["number", "null"]}},
                 "required": ["nick", "score"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"count": {"type": "integer"}, "ratio": {"type": "number"}},
                "required": ["count", "ratio"], "additionalProperties": False},
    "matrix": {"type": "object", "properties": {"rows": {
        "type": "array", "minItems": 2, "maxItems": 3,
        "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}}},
        "required": ["rows"], "additionalProperties": False},
    "shapes": {"type": "object", "properties": {"shape": {"anyOf": [_CIRCLE, _RECT]},
                                                "others": {"type": "array", "items": {"oneOf": [_CIRCLE, _RECT]}}},
               "required": ["shape"], "additionalProperties": False},
    "tree": {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["value", "children"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
    "const": {"type": "object", "properties": {"version": {"const": 2}, "mode": {"const": "fast"},
                                               "on": {"const": True}},
              "required": ["version", "mode"], "additionalProperties": False},
    "free": {"type": "object", "properties": {"meta": {"type": "object"}, "any": {}, "list": {"type": "array"},
                                              "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
                                              "none": {"type": "object", "additionalProperties": False}},
             "required": ["meta"]},
    "top_array": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    "keyed": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                         "additionalProperties": False},
                        {"type": "object", "additionalProperties": {"type": "string"}}]},
}
GRAMMARS = {name: compile_schema(schema) for name, schema in SCHEMAS.items()}


# --- a reference validator, and documents drawn from a schema ------------------------------------------------

def resolve(root: Any, pointer: str) -> Any:
    target = root
    for part in pointer.lstrip("#").split("/")[1:]:
        target = target[int(part)] if isinstance(target, list) else target[part]
    return target


def is_type(value: Any, type_name: str) -> bool:
    if isinstance(value, bool):
        return type_name == "boolean"
    if isinstance(value, int | float):
        return type_name == "number" or (type_name == "integer" and float(value).is_integer())
    return {str: "string", type(None): "null", list: "array", dict: "object"}.get(type(value)) == type_name


def same(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1."""
    if type(a) is not type(b) and (isinstance(a, bool | dict | list) or isinstance(b, bool | dict | list)):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def valid(value: Any, schema: Any, root: Any) -> bool:
    """JSON Schema's verdict on the keywords these tests use (property order does not matter to it)."""
    if isinstance(schema, bool):
        return schema
    checks = [
        "$ref" not in schema or valid(value, resolve(root, schema["$ref"]), root),
        "anyOf" not in schema or any(valid(value, s, root) for s in schema["anyOf"]),
        "oneOf" not in schema or sum(valid(value, s, root) for s in schema["oneOf"]) == 1,
        "const" not in schema or same(value, schema["const"]),
        "enum" not in schema or any(same(value, v) for v in schema["enum"]),
        "type" not in schema or any(is_type(value, t) for t in
                                    ([schema["type"]] if isinstance(schema["type"], str) else schema["type"])),
    ]
    if isinstance(value, dict):
        properties, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
        checks.append(all(name in value for name in schema.get("required", [])))
        checks += [valid(v, properties.get(k, extra), root) for k, v in value.items()]
    if isinstance(value, list):
        checks.append(schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)))
        checks += [valid(v, schema.get("items", True), root) for v in value]
    return all(checks)


leaves = (st.none() | st.booleans() | st.integers(-(10**20), 10**20)
          | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6))
any_values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)


def instances(schema: Any, root: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    """Valid values of `schema`; objects keep the schema's property order."""
    if schema is True or schema == {}:
        return any_values
    if "$ref" in schema:
        return instances(resolve(root, schema["$ref"]), root, depth + 1)
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([instances(s, root, depth) for s in schema.get("anyOf", schema.get("oneOf"))])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if isinstance(schema["type"], list):
        return st.one_of([instances({**schema, "type": t}, root, depth) for t in schema["type"]])
    kind = schema["type"]
    if kind == "object":
        if "properties" not in schema:
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return st.just({})
            values = any_values if extra is True else instances(extra, root, depth + 1)
            return st.dictionaries(st.text(max_size=4), values, max_size=3)
        names = list(schema["properties"])
        required = schema.get("required", [])
        parts = [st.tuples(st.just(True) if name in required else st.booleans(),
                           instances(schema["properties"][name], root, depth + 1)) for name in names]
        return st.tuples(*parts).map(lambda drawn: {n: v for n, (keep, v) in zip(names, drawn, strict=True) if keep})
    if kind == "array":
        low, high = schema.get("minItems", 0), schema.get("maxItems", 3)
        if depth >= 4 and low == 0:
            return st.just([])
        return st.lists(instances(schema.get("items", True), root, depth + 1), min_size=low, max_size=high)
    return {"string": st.text(max_size=6), "integer": st.integers(-(10**6), 10**15), "boolean": st.booleans(),
            "number": st.integers(-99, 99) | st.floats(allow_nan=False, allow_infinity=False),
            "null": st.none()}[kind]


dumps_options: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries({
    "indent": st.sampled_from([None, 0, 1, 2]),
    "separators": st.sampled_from([None, (",", ":"), (", ", ": "), (" , ", " : ")]),
})


def feed(grammar: SchemaGrammar, data: bytes, state: Any = None) -> list[Any] | None:
    """The state after each byte; None as soon as one is refused."""
    states, current = [], grammar.start if state is None else state
    for byte in data:
        current = grammar.step(current, byte)
        if current is None:
            return None
        states.append(current)
    return states


def accepts(grammar: SchemaGrammar, text: str) -> bool:
    states = feed(grammar, text.encode())
    return states is not None and bool(states) and grammar.is_complete(states[-1])


def loads(text: str) -> tuple[bool, Any]:
    def refuse(name: str) -> Any:
        raise ValueError(name)

    try:
        return True, json.loads(text, parse_constant=refuse)
    except ValueError:
        return False, None


# --- documents ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEMAS)
@PROPERTY
@given(data=st.data())
def test_valid_documents_are_accepted_and_complete_at_their_last_byte(name: str, data: st.DataObject) -> None:
    schema, grammar = SCHEMAS[name], GRAMMARS[name]
    value = data.draw(instances(schema, schema))
    assert valid(value, schema, schema)
    text = json.dumps(value, ensure_ascii=False, **data.draw(dumps_options))
    trailing = data.draw(st.sampled_from(["", " ", "\n", "\r\n\t "]))
    assume(within_caps(text + trailing))
    states = feed(grammar, (text + trailing).encode())
    assert states is not None, text
    closed, total = len(text.encode()), len((text + trailing).encode())
    assert [grammar.is_complete(s) for s in states] == [False] * (closed - 1) + [True] * (total - closed + 1)


INVALID = [   # (schema, document, whether JSON Schema itself rejects it; False: only our spelling or order)
    ("person", '{"name": "A"}', True),                                   # a required property missing
    ("person", '{"name": "A", "age": "3"}', True),                       # wrong type
    ("person", '{"name": "A", "age": 3.5}', True),
    ("person", '{"name": "A", "age": 3, "nick": "x"}', True),            # an extra key
    ("person", '{"name": "A", "age": 3, "email": 5}', True),
    ("person", '{"name": "A", "age": 3, "address": {"street": "s"}}', True),
    ("person", '{"name": "A", "age": 3, "tags": [1]}', True),
    ("person", '{"age": 3, "name": "A"}', False),                        # keys out of schema order
    ("person", '{"name": "A", "age": 3, "age": 4}', False),              # a key twice
    ("person", '{"name": "A", "age": 3.0}', False),                      # an integer written as a number
    ("person", '{"name": "A", "age": 1e3}', False),
    ("person", '{"na\\u006de": "A", "age": 3}', False),                  # a key not in its canonical spelling
    ("person", ' {"name": "A", "age": 3}', False),                       # whitespace before the document
    ("person", '{"name": "A", "age": 3}}', True),
    ("enums", '{"color": "blue", "size": 1}', True),                     # not in the enum
    ("enums", '{"color": "red", "size": 2}', True),
    ("enums", '{"color": "red", "size": "1"}', True),
    ("enums", '{"color": "red", "size": 12.5}', True),
    ("enums", '{"color": "red", "size": false}', True),
    ("enums", '{"color": "caf\\u00e9", "size": 1}', False),              # an enum value not in its spelling
    ("enums", '{"color": "red", "size": 1.50}', False),
    ("nullable", '{"nick": null}', True),
    ("nullable", '{"nick": null, "score": "1"}', True),
    ("nullable", '{"nick": 1, "score": 1}', True),
    ("numbers", '{"count": 1, "ratio": 01}', True),                      # not JSON
    ("numbers", '{"count": -, "ratio": 1}', True),
    ("matrix", '{"rows": [[1]]}', True),                                 # too few items
    ("matrix", '{"rows": [[1], [2], [3], [4]]}', True),                  # too many
    ("matrix", '{"rows": [[1], []]}', True),
    ("matrix", '{"rows": [[1], [2, 3, 4]]}', True),
    ("matrix", '{"rows": [[1], [2.5]]}', True),
    ("shapes", '{"shape": {"kind": "circle", "w": 1, "h": 2}}', True),   # neither alternative
    ("shapes", '{"shape": {"kind": "rect", "w": 1}}', True),
    ("shapes", '{"shape": {"kind": "oval", "r": 1}}', True),
    ("tree", '{"value": 1, "children": [{"value": 2}]}', True),
    ("tree", '{"value": 1, "children": [{"value": 2, "children": [3]}]}', True),
    ("const", '{"version": 3, "mode": "fast"}', True),
    ("const", '{"version": 2, "mode": "slow"}', True),
    ("const", '{"version": 2, "mode": "fast", "on": false}', True),
    ("const", '{"version": 2.0, "mode": "fast"}', False),                # a const not in its spelling
    ("free", '{"any": 1}', True),
    ("free", '{"meta": []}', True),
    ("free", '{"meta": {}, "counts": {"a": 1.5}}', True),
    ("free", '{"meta": {}, "none": {"a": 1}}', True),
    ("top_array", '[true, false, true]', True),
    ("top_array", '[1]', True),
    ("top_array", '{}', True),
    ("keyed", '{"a": 1, "b": "x"}', True),
    ("keyed", '{"b": 1}', True),
]


@pytest.mark.parametrize(("name", "text", "schema_rejects"), INVALID)
def test_invalid_documents_are_refused(name: str, text: str, schema_rejects: bool) -> None:
    assert not accepts(GRAMMARS[name], text)
    parsed, value = loads(text)
    assert (not parsed or not valid(value, SCHEMAS[name], SCHEMAS[name])) == schema_rejects


VALID = [
    ("person", '{"name":"A","age":-0}'),
    ("person", '{\n  "name": "\\u00e9\\"\\n",\n  "age": 3,\n  "email": null,\n  "tags": [],\n'
               '  "address": {"street": "s", "city": "c", "zip": "1"}\n}'),
    ("person", '{"name": "A", "age": 3, "address": {"street": "s", "city": "c"}}'),
    ("enums", '{"color": "a\\"b", "size": 12}'),
    ("enums", '{"color": "café", "size": 1.5}'),
    ("enums", '{"color": "red", "size": null}'),
    ("numbers", '{"count": 0, "ratio": -1.5E-3}'),
    ("matrix", '{"rows": [[1], [2, 3]]}'),
    ("shapes", '{"shape": {"kind": "rect", "w": 1, "h": 2}, "others": [{"kind": "circle", "r": 0}]}'),
    ("tree", '{"value": 1, "children": [{"value": 2, "children": []}, {"value": 3, "children": []}]}'),
    ("const", '{"version":2,"mode":"fast","on":true}'),
    ("free", '{"meta": {"x": [1, {"y": null}]}, "any": "s", "list": [1, "a", {}], "counts": {"a": 1, "a": 2},'
             ' "none": {}}'),
    ("top_array", "[]"),
    ("top_array", "[false, true]"),
    ("keyed", '{"a": 1}'),
    ("keyed", '{"a": "x", "b": "y"}'),
    ("keyed", "{}"),
]


@pytest.mark.parametrize(("name", "text"), VALID)
def test_table_of_valid_documents_is_accepted(name: str, text: str) -> None:
    assert accepts(GRAMMARS[name], text)
    parsed, value = loads(text)
    assert parsed and valid(value, SCHEMAS[name], SCHEMAS[name])


@st.composite
def mutated(draw: st.DrawFn, name: str) -> str:
    """A valid document with a few characters or JSON fragments deleted, replaced or inserted."""
    schema = SCHEMAS[name]
    text = json.dumps(draw(instances(schema, schema)), ensure_ascii=False, **draw(dumps_options))
    fragments = st.sampled_from([*'{}[]:,"\\ 0123456789-.eE', "null", "true", '"x"', '"name"', '"age"', "[]",
                                 "{}", '"kind"', '"circle"', "1.5", ', "a": 1'])
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 4))
        text = text[:at] + draw(st.one_of(st.just(""), fragments)) + text[at + cut:]
    return text


@pytest.mark.parametrize("name", SCHEMAS)
@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_whatever_completes_parses_and_validates(name: str, data: st.DataObject) -> None:
    text = data.draw(mutated(name))
    if accepts(GRAMMARS[name], text):
        parsed, value = loads(text)
        assert parsed and valid(value, SCHEMAS[name], SCHEMAS[name]), text


def completion(grammar: SchemaGrammar, state: Any, alphabet: bytes) -> bytes | None:
    """The shortest bytes over `alphabet` that complete the document from `state` (breadth first, bounded)."""
    frontier, seen = deque([(state, b"")]), {state}
    while frontier and len(seen) < 50_000:
        current, suffix = frontier.popleft()
        if grammar.is_complete(current):
            return suffix
        for byte in alphabet:
            after = grammar.step(current, byte)
            if after is not None and after not in seen:
                seen.add(after)
                frontier.append((after, suffix + bytes([byte])))
    return None


@pytest.mark.parametrize("name", SCHEMAS)
@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_what_is_accepted_can_be_finished(name: str, data: st.DataObject) -> None:
    grammar, data_bytes = GRAMMARS[name], data.draw(mutated(name)).encode()
    state, accepted = grammar.start, 0
    for byte in data_bytes:
        after = grammar.step(state, byte)
        if after is None:
            break
        state, accepted = after, accepted + 1
    alphabet = bytes(sorted(set(json.dumps(SCHEMAS[name], ensure_ascii=False).encode()) | set(b"{}[]:,0truefalsn")))
    suffix = completion(grammar, state, alphabet)
    assert suffix is not None
    parsed, value = loads((data_bytes[:accepted] + suffix).decode())
    assert parsed and valid(value, SCHEMAS[name], SCHEMAS[name])


def test_caps_on_whitespace_and_depth() -> None:
    grammar = GRAMMARS["person"]
    run = " " * MAX_WHITESPACE
    assert accepts(grammar, f'{{{run}"name"{run}:{run}"A"{run},"age":1{run}}}{run}')
    assert not accepts(grammar, '{"name":"A","age":1' + " " * (MAX_WHITESPACE + 1) + "}")
    tree = GRAMMARS["tree"]   # each node is two containers: the object and its children's array
    nodes = MAX_DEPTH // 2
    assert accepts(tree, '{"value":1,"children":[' * nodes + "]}" * nodes)
    assert feed(tree, ('{"value":1,"children":[' * nodes + "{").encode()) is None


def test_a_container_is_entered_only_when_it_can_close_within_the_depth_cap() -> None:
    schema = {"$defs": {"n": {"type": "object", "properties": {
        "leaf": {"type": "object", "properties": {"x": {"type": "object", "additionalProperties": False}},
                 "required": ["x"]},
        "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}, "required": ["leaf", "next"]}},
        "$ref": "#/$defs/n"}
    grammar = compile_schema(schema)   # an n opens 3 containers at least: at most MAX_DEPTH - 2 nested n's
    level = '{"leaf":{"x":{}},"next":'
    assert feed(grammar, (level * (MAX_DEPTH - 3) + "{").encode()) is not None
    assert feed(grammar, (level * (MAX_DEPTH - 2) + "{").encode()) is None
    assert accepts(grammar, level * (MAX_DEPTH - 2) + "null" + "}" * (MAX_DEPTH - 2))


def test_states_are_hashable_and_shared_between_outputs() -> None:
    grammar = GRAMMARS["person"]
    first, second = feed(grammar, b'{"name": "xy'), feed(grammar, b'{"name":"z')
    assert first is not None and second is not None
    assert first[-1] == second[-1] and len({first[-1], second[-1]}) == 1
    assert grammar.plain_string(first[-1])
    after_enum = feed(GRAMMARS["enums"], b'{"color": "re')
    assert after_enum is not None and not GRAMMARS["enums"].plain_string(after_enum[-1])
