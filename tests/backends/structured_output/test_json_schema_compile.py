"""Compiling JSON schemas (what is refused, how values are spelled, what is pruned), and the token masks a compiled
schema gives, against feeding each token byte by byte. The schemas and helpers are test_json_schema.py's."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from backends.structured_output.json_mode import GrammarMasks, TokenMasks, VocabularyTries
from backends.structured_output.json_schema import UnsupportedSchema, compile_schema
from backends.structured_output.schema_grammar import SchemaGrammar
from tests.backends.structured_output.test_json_mode import random_vocab, within_caps
from tests.backends.structured_output.test_json_schema import GRAMMARS, SCHEMAS, accepts, dumps_options, feed, instances

# --- compiling ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schema", [
    {"type": "string", "minLength": 1},
    {"type": "string", "pattern": "^x"},
    {"type": "integer", "minimum": 0},
    {"type": "number", "exclusiveMaximum": 1},
    {"type": "integer", "multipleOf": 2},
    {"not": {"type": "string"}},
    {"if": {}, "then": {}},
    {"type": "object", "patternProperties": {"^a": {}}},
    {"type": "array", "prefixItems": [{}]},
    {"type": "array", "items": [{}, {}]},
    {"type": "array", "uniqueItems": True},
    {"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}},
    {"type": "object", "required": ["a"]},                        # required without properties
    {"type": "object", "properties": {"a": {}}, "required": ["b"]},
    {"type": "object", "properties": {"a": {}}, "allOf": [{"required": ["a"]}]},
    {"allOf": [{"type": "object"}, {"required": ["a"]}]},
    {"$ref": "https://example.com/schema"},
    {"$ref": "#/$defs/missing"},
    {"$ref": "#"},                                                # nothing but itself
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},   # infinitely deep
    {"type": "array", "minItems": 3, "maxItems": 2},
    {"enum": []},
    {"type": "string", "enum": [1, 2]},
    {"const": float("nan")},
    {"type": "date"},
    {"type": []},
    False,
    {"properties": {"a": {"$id": "other"}}},
])
def test_what_cannot_be_honoured_is_refused_at_compile_time(schema: Any) -> None:
    with pytest.raises(UnsupportedSchema):
        compile_schema(schema)


@pytest.mark.parametrize(("schema", "text"), [
    ({"type": "string", "format": "email", "title": "t"}, '"not an email"'),   # an annotation, as in 2020-12
    (True, '{"a": [1, null]}'),
    ({}, '"x"'),
    ({"allOf": [{"type": "integer"}]}, "7"),
    ({"anyOf": [{"type": "integer"}, {"type": "number"}]}, "7"),
    ({"type": "number"}, "-0.5e+10"),
    ({"const": 12}, "12 "),
    ({"enum": [1, 12]}, "1"),
    ({"type": "integer", "enum": [1, 2.0, 2.5, "x"]}, "2.0"),
    ({"type": "object", "additionalProperties": False}, "{ }"),
    ({"items": {"type": "null"}}, "[null]"),                     # no type: array keywords make an array
    ({"type": "array", "uniqueItems": False, "items": False}, "[]"),
    ({"const": {"a": [1, "x"]}}, '{"a":[1,"x"]}'),
    ({"oneOf": [{"const": "a"}, {"const": "b"}], "discriminator": {"propertyName": "kind"}}, '"b"'),
    ({"anyOf": [{"type": "string"}, {"anyOf": [{"type": "integer"}, {"type": ["boolean", "null"]}]}]}, "null"),
])
def test_supported_schemas_compile_and_accept(schema: Any, text: str) -> None:
    assert accepts(compile_schema(schema), text)


def test_enum_and_const_values_are_spelled_as_compact_json_dumps() -> None:
    grammar = compile_schema({"enum": [{"a": [1, "x"]}, "é", 1.0]})
    assert [accepts(grammar, text) for text in ('{"a":[1,"x"]}', '"é"', "1.0")] == [True] * 3
    assert [accepts(grammar, text) for text in ('{"a": [1, "x"]}', '"\\u00e9"', "1")] == [False] * 3
    both = compile_schema({"enum": [1, 2], "const": 2})
    assert accepts(both, "2") and not accepts(both, "1")


def test_unreachable_alternatives_and_properties_are_pruned() -> None:
    grammar = compile_schema({"type": "object", "properties": {"never": False, "a": {"type": "integer"}}})
    assert feed(grammar, b'{"n') is None and accepts(grammar, '{"a": 1}')
    grammar = compile_schema({"anyOf": [{"type": "array", "items": False, "minItems": 1}, {"type": "null"}]})
    assert feed(grammar, b"[") is None and accepts(grammar, "null")


# --- token masks ----------------------------------------------------------------------------------------------

def brute_allowed(grammar: SchemaGrammar, vocab: list[bytes | None], eos: set[int], state: Any) -> list[bool]:
    complete = grammar.is_complete(state)
    return [complete if t in eos else (feed(grammar, data, state) is not None and not (complete and not data.strip())
                                       if data else False)
            for t, data in enumerate(vocab)]


@pytest.fixture(scope="module")
def small() -> tuple[list[bytes | None], set[int], VocabularyTries]:
    vocab, eos = random_vocab(11)
    rng = random.Random(11)
    words = [b'a":1', b'a":', b'a":"', b'"name"', b"name", b'"age":', b"age", b'"kind": "', b"circle", b"rect",
             b'"r', b"null", b"caf", b'"color"', b"red", b"children", b'":[', b"12", b"1.5", b'"value": ']
    vocab += words + [b"".join(rng.choices([*words, b" ", b",", b"{", b'"', b"}"], k=3)) for _ in range(100)]
    return vocab, eos, VocabularyTries(vocab, eos)


@pytest.mark.parametrize("name", SCHEMAS)
@settings(deadline=None, max_examples=15, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_schema_masks_match_brute_force(small: tuple[list[bytes | None], set[int], VocabularyTries], name: str,
                                        data: st.DataObject) -> None:
    vocab, eos, tries = small
    grammar = GRAMMARS[name]
    masks = GrammarMasks(tries, grammar)
    text = json.dumps(data.draw(instances(SCHEMAS[name], SCHEMAS[name])), ensure_ascii=False,
                      **data.draw(dumps_options))
    assume(within_caps(text))
    states = feed(grammar, text.encode())
    assert states is not None
    for state in [grammar.start, *data.draw(st.lists(st.sampled_from(states), max_size=4))]:
        assert masks.allowed(state).tolist() == brute_allowed(grammar, vocab, eos, state)


@pytest.mark.parametrize(("name", "prefix"), [
    ("keyed", b'{"'), ("keyed", b'{"a'), ("keyed", b'{"a":'), ("keyed", b'{"b":"x'), ("person", b'{"name":"x\\u00'),
    ("enums", b'{"color": "ca'), ("enums", b'{"color":"red","size":1'), ("shapes", b'{"shape":{"'),
    ("tree", b'{"value":1,"children":['), ("free", b'{"meta":{"k":['), ("top_array", b"[true,false]"),
])
def test_schema_masks_match_brute_force_at_edge_states(
        small: tuple[list[bytes | None], set[int], VocabularyTries], name: str, prefix: bytes) -> None:
    vocab, eos, tries = small
    grammar = GRAMMARS[name]
    states = feed(grammar, prefix)
    assert states is not None
    assert GrammarMasks(tries, grammar).allowed(states[-1]).tolist() == brute_allowed(grammar, vocab, eos, states[-1])


def test_schema_masks_advance_along_tokens(small: tuple[list[bytes | None], set[int], VocabularyTries]) -> None:
    vocab, _, tries = small
    grammar = GRAMMARS["person"]
    masks = GrammarMasks(tries, grammar)
    data = b'{"name": "A", "age": 3}'
    states = feed(grammar, data)
    assert states is not None
    token_ids = [vocab.index(bytes([b])) for b in data]
    assert masks.state_after(token_ids) == states[-1] and masks.state_after([]) == grammar.start
    assert masks.advance(states[5], 2) is None and masks.advance(states[-1], 2) == states[-1]
    assert masks.state_after([vocab.index(b"[")]) is None


def test_masks_on_the_bundled_tokenizer_share_the_json_mode_tries(smollm2_dir: Path) -> None:
    from tokenizers import Tokenizer

    from backends.structured_output.json_output import token_bytes_of

    vocab = token_bytes_of(smollm2_dir, Tokenizer.from_file(str(smollm2_dir / "tokenizer.json")).get_vocab_size())
    eos = {2}
    json_mode = TokenMasks(vocab, eos)
    grammar = GRAMMARS["person"]
    masks = GrammarMasks(json_mode.tries, grammar)
    assert masks.tries is json_mode.tries
    for prefix in (b"", b"{", b'{"na', b'{"name": "Jo\\', b'{"name":"J","age":1', b'{"name":"J","age":1,"',
                   b'{"name":"J","age":1,"email":', b'{"name":"J","age":1}'):
        states = feed(grammar, prefix)
        assert states is not None
        state = states[-1] if states else grammar.start
        assert masks.allowed(state).tolist() == brute_allowed(grammar, vocab, eos, state), prefix
