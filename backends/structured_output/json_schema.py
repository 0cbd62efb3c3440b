"""JSON-schema constrained output: `compile_schema` turns a schema (OpenAI's `response_format` json_schema) into a
byte-level `json_mode.Grammar` whose complete documents validate against it. Pure: no tokenizer, engine or
device code; masks come from `json_mode.GrammarMasks` over the tokenizer's shared `VocabularyTries`.

Honoured: `type` (one or a list), `properties` (emitted in schema order; a property not in `required` may be
skipped; no other keys, whatever `additionalProperties` says), `required`, `additionalProperties` /
`unevaluatedProperties` (only for an object without `properties`: false gives `{}`, true or absent any object,
a schema a map of such values), `items`, `minItems`, `maxItems`, `enum`, `const`, `anyOf`, `oneOf` (as anyOf:
a document may match several alternatives), `allOf` of at most one schema, `$ref` to `#` or a JSON pointer
inside the document (recursion allowed), `true` / `{}` (any JSON value), `uniqueItems: false`.
`format` is an annotation, as JSON Schema 2020-12 has it by default (a validator does not assert it either).
Annotations (`title`, `description`, `default`, ...) mean nothing here. Anything else raises
`UnsupportedSchema` at compile time, so the server refuses the request rather than answer what may break the
schema: the assertions this grammar does not track (`pattern`, `minimum`, `maximum`, `exclusiveMinimum`,
`exclusiveMaximum`, `multipleOf`, `minLength`, `maxLength`, ...) included.

Spelling: an `enum` / `const` value and a property name must be written exactly as
`json.dumps(v, ensure_ascii=False, separators=(",", ":"))` writes them (`1.0` stays `1.0`; `"é"` is not
`"\\u00e9"`); whitespace between tokens is free (runs capped at MAX_WHITESPACE), none before the document.
A schema without `type` but with object (or array) keywords produces objects (or arrays) only; an `integer`
is written without fraction or exponent. Nesting is capped at MAX_DEPTH open containers; the grammar never
enters a container it could not close within the cap, so every accepted prefix can be finished.
"""
from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from backends.structured_output.json_mode import MAX_DEPTH
from backends.structured_output.schema_grammar import (
    ARRAY,
    INTEGER,
    LITERAL,
    NUMBER,
    OBJECT,
    STRING,
    UNION,
    UNREACHABLE,
    Node,
    SchemaGrammar,
)


class UnsupportedSchema(ValueError):
    """A schema this compiler cannot honour; the message names the part (a JSON pointer) and why."""


_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$comment", "$defs",
                          "definitions", "deprecated", "readOnly", "writeOnly", "contentEncoding",
                          "contentMediaType", "discriminator"})   # discriminator: pydantic's hint beside oneOf
_IGNORED = frozenset({"format"})
_COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
_HANDLED = frozenset({"type", "properties", "required", "additionalProperties", "unevaluatedProperties", "items",
                      "minItems", "maxItems", "uniqueItems", "enum", "const", *_COMBINATORS})
_KNOWN = _ANNOTATIONS | _IGNORED | _HANDLED
_INFERRED = {"object": {"properties", "required", "additionalProperties", "unevaluatedProperties"},
             "array": {"items", "minItems", "maxItems"}}
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def compile_schema(schema: dict[str, Any] | bool) -> SchemaGrammar:
    """The grammar of the documents valid under `schema` (see the module docstring for what is honoured).
    Raises UnsupportedSchema for what it cannot honour, or when no document within the caps is valid."""
    compiler = _Compiler(schema)
    root = compiler.schema(schema, "#")
    compiler.finish()
    if compiler.nodes[root].alts == () or compiler.nodes[root].min_depth > MAX_DEPTH:
        raise UnsupportedSchema(f"#: no document within {MAX_DEPTH} levels of nesting satisfies the schema")
    return SchemaGrammar(compiler.nodes, root, compiler.trie_next, compiler.trie_end)


class _Compiler:
    """Schema dict -> nodes, then `finish` flattens unions and prunes what no finite document reaches."""

    def __init__(self, document: dict[str, Any] | bool) -> None:
        self.document = document
        self.nodes: list[Node] = []
        self.trie_next: list[dict[int, int]] = []
        self.trie_end: list[bool] = []
        self.refs: dict[str, int] = {}
        self.any_node: int | None = None

    def add(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def schema(self, schema: object, where: str) -> int:
        if schema is True:
            return self.any()
        if schema is False:
            return self.add(Node(UNION))
        if not isinstance(schema, dict):
            raise UnsupportedSchema(f"{where}: a schema must be an object or a boolean")
        unknown = sorted(schema.keys() - _KNOWN)
        if unknown or ("$id" in schema and where != "#"):
            raise UnsupportedSchema(f"{where}: unsupported keyword {(unknown or ['$id'])[0]!r}")
        if schema.get("uniqueItems", False) is not False:
            raise UnsupportedSchema(f"{where}: unsupported keyword 'uniqueItems'")
        free = _ANNOTATIONS | _IGNORED
        combinators = [k for k in _COMBINATORS if k in schema]
        if combinators:
            beside = sorted(schema.keys() - free - {combinators[0]})
            if beside:
                raise UnsupportedSchema(f"{where}: {combinators[0]!r} beside {beside[0]!r} is not supported")
            return self.combinator(combinators[0], schema[combinators[0]], f"{where}/{combinators[0]}")
        types = self.types(schema, where)
        if "enum" in schema or "const" in schema:
            beside = sorted(schema.keys() - free - {"enum", "const", "type"})
            if beside:
                raise UnsupportedSchema(f"{where}: enum or const beside {beside[0]!r} is not supported")
            return self.literal(self.values(schema, types, where))
        if types is None:
            types = [t for t, keywords in _INFERRED.items() if keywords & schema.keys()]
            if not types:
                return self.any()
        alts = [self.typed(schema, t, where) for t in types]
        return alts[0] if len(alts) == 1 else self.add(Node(UNION, targets=alts))

    def types(self, schema: dict[str, Any], where: str) -> list[str] | None:
        declared = schema.get("type")
        if declared is None:
            return None
        names = [declared] if isinstance(declared, str) else declared
        if not isinstance(names, list) or not names or any(name not in _TYPES for name in names):
            raise UnsupportedSchema(f"{where}/type: expected one of {_TYPES} or a non-empty list of them")
        return list(dict.fromkeys(names))

    def typed(self, schema: dict[str, Any], type_name: str, where: str) -> int:
        if type_name == "object":
            return self.object(schema, where)
        if type_name == "array":
            return self.array(schema, where)
        if type_name in ("boolean", "null"):
            return self.literal([b"true", b"false"] if type_name == "boolean" else [b"null"])
        kind = {"string": STRING, "number": NUMBER, "integer": INTEGER}[type_name]
        return self.add(Node(kind))

    def object(self, schema: dict[str, Any], where: str) -> int:
        properties = schema.get("properties")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
            raise UnsupportedSchema(f"{where}/required: expected a list of property names")
        if properties is None:
            if required:
                raise UnsupportedSchema(f"{where}: 'required' without 'properties' is not supported")
            extra = schema.get("additionalProperties", schema.get("unevaluatedProperties", True))
            if extra is False:
                return self.add(Node(OBJECT))
            value = self.schema(extra, f"{where}/additionalProperties")
            return self.add(Node(OBJECT, keys=[self.add(Node(STRING))], values=[value], required=[False],
                                  repeat=True))
        if not isinstance(properties, dict):
            raise UnsupportedSchema(f"{where}/properties: expected an object")
        missing = [name for name in required if name not in properties]
        if missing:
            raise UnsupportedSchema(f"{where}/required: {missing[0]!r} is not in 'properties'")
        return self.add(Node(
            OBJECT,
            keys=[self.literal([_canonical(name, where)]) for name in properties],
            values=[self.schema(sub, f"{where}/properties/{name}") for name, sub in properties.items()],
            required=[name in required for name in properties]))

    def array(self, schema: dict[str, Any], where: str) -> int:
        items = schema.get("items", True)
        if isinstance(items, list):
            raise UnsupportedSchema(f"{where}/items: a list of schemas (tuple validation) is not supported")
        min_items, max_items = schema.get("minItems", 0), schema.get("maxItems")
        for name, bound in (("minItems", min_items), ("maxItems", max_items)):
            if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool) or bound < 0):
                raise UnsupportedSchema(f"{where}/{name}: expected a non-negative integer")
        if max_items is not None and min_items > max_items:
            raise UnsupportedSchema(f"{where}: minItems exceeds maxItems")
        return self.add(Node(ARRAY, items=self.schema(items, f"{where}/items"), min_items=min_items,
                              max_items=max_items))

    def combinator(self, keyword: str, value: Any, where: str) -> int:
        if keyword == "$ref":
            return self.ref(value, where)
        if not isinstance(value, list) or (keyword != "allOf" and not value):
            raise UnsupportedSchema(f"{where}: expected a non-empty list of schemas")
        if keyword == "allOf":
            if len(value) > 1:
                raise UnsupportedSchema(f"{where}: allOf of more than one schema is not supported")
            return self.schema(value[0], f"{where}/0") if value else self.any()
        return self.add(Node(UNION, targets=[self.schema(sub, f"{where}/{i}") for i, sub in enumerate(value)]))

    def ref(self, pointer: Any, where: str) -> int:
        if not isinstance(pointer, str) or not (pointer == "#" or pointer.startswith("#/")):
            raise UnsupportedSchema(f"{where}: only references inside the schema ('#/...') are supported")
        if pointer in self.refs:
            return self.refs[pointer]
        self.refs[pointer] = placeholder = self.add(Node(UNION))   # before the target: it may refer back
        target: Any = self.document
        for part in pointer[2:].split("/") if pointer != "#" else []:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise UnsupportedSchema(f"{where}: {pointer!r} does not resolve")
        self.nodes[placeholder].targets = [self.schema(target, pointer)]
        return placeholder

    def values(self, schema: dict[str, Any], types: list[str] | None, where: str) -> list[bytes]:
        """The canonical texts of the enum / const values (of the declared types)."""
        enum = schema.get("enum", [schema.get("const")])
        if not isinstance(enum, list):
            raise UnsupportedSchema(f"{where}/enum: expected a list")
        texts = [_canonical(value, where) for value in enum if types is None or any(_is(value, t) for t in types)]
        if "const" in schema:
            texts = [text for text in texts if text == _canonical(schema["const"], where)]
        if not texts:
            raise UnsupportedSchema(f"{where}: no value satisfies enum, const and type together")
        return texts

    def literal(self, texts: list[bytes]) -> int:
        """A node that accepts exactly these byte strings (a trie)."""
        root = len(self.trie_next)
        self.trie_next.append({})
        self.trie_end.append(False)
        for text in texts:
            position = root
            for byte in text:
                following = self.trie_next[position].get(byte)
                if following is None:
                    following = self.trie_next[position][byte] = len(self.trie_next)
                    self.trie_next.append({})
                    self.trie_end.append(False)
                position = following
            self.trie_end[position] = True
        return self.add(Node(LITERAL, trie=root))

    def any(self) -> int:
        """The node of any JSON value (one per grammar)."""
        if self.any_node is None:
            self.any_node = union = self.add(Node(UNION))
            string = self.add(Node(STRING))
            mapping = self.add(Node(OBJECT, keys=[string], values=[union], required=[False], repeat=True))
            self.nodes[union].targets = [string, self.add(Node(NUMBER)),
                                         self.literal([b"true", b"false", b"null"]), mapping,
                                         self.add(Node(ARRAY, items=union))]
        return self.any_node

    def finish(self) -> None:
        """Fill min_depth (a least fixed point: unreachable = no finite document), then prune what is
        unreachable: optional properties, array items, union alternatives."""
        nodes = self.nodes
        changed = True
        while changed:
            changed = False
            for node in nodes:
                depth = self._depth(node)
                if depth < node.min_depth:
                    node.min_depth, changed = depth, True
        for i, node in enumerate(nodes):
            if node.kind == OBJECT:
                live = tuple(j for j, value in enumerate(node.values) if nodes[value].min_depth < UNREACHABLE)
                if node.repeat:
                    node.cands, node.can_close = (live, live), (True, True)
                else:
                    node.cands = tuple(_candidates(node.required, live, start) for start in range(len(node.keys) + 1))
                    node.can_close = tuple(not any(node.required[start:]) for start in range(len(node.keys) + 1))
            elif node.kind == ARRAY and nodes[node.items].min_depth >= UNREACHABLE:
                node.max_items = 0
            node.alts = tuple(self._concrete(i, set()))

    def _depth(self, node: Node) -> int:
        if node.kind == UNION:
            return min((self.nodes[t].min_depth for t in node.targets), default=UNREACHABLE)
        if node.kind == OBJECT:
            needed = [self.nodes[v].min_depth for v, r in zip(node.values, node.required, strict=True) if r]
            return min(UNREACHABLE, 1 + max(needed, default=0))
        if node.kind == ARRAY:
            return 1 if node.min_items == 0 else min(UNREACHABLE, 1 + self.nodes[node.items].min_depth)
        return 0

    def _concrete(self, i: int, seen: set[int]) -> list[int]:
        node = self.nodes[i]
        if node.kind != UNION:
            return [i] if node.min_depth < UNREACHABLE else []
        found: list[int] = []
        for target in node.targets:
            if target not in seen:
                seen.add(target)
                found += [alt for alt in self._concrete(target, seen) if alt not in found]
        return found


def _candidates(required: list[bool], live: tuple[int, ...], start: int) -> tuple[int, ...]:
    """The live properties that may come next from index `start`: up to and including the first required one."""
    found = []
    for j in live:
        if j >= start:
            found.append(j)
            if required[j]:
                break
    return tuple(found)


def _canonical(value: Any, where: str) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except ValueError as error:
        raise UnsupportedSchema(f"{where}: {value!r} has no JSON spelling") from error


def _is(value: Any, type_name: str) -> bool:
    """Whether a JSON value is of a JSON-schema type (1.0 is an integer; true is not a number)."""
    if isinstance(value, bool):
        return type_name == "boolean"
    if isinstance(value, int | float):
        return type_name == "number" or (type_name == "integer" and (isinstance(value, int) or value.is_integer()))
    return type_name == {str: "string", type(None): "null", list: "array", dict: "object"}.get(type(value))
