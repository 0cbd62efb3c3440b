"""Parsing of /v1/embeddings bodies (backends/server/embeddings.py), table-driven: the input shapes OpenAI
accepts, the bounds, and the field each refusal names. The worker tests run the same refusals over HTTP."""
from __future__ import annotations

from typing import Any

import pytest

from backends.server.embeddings import EncodingFormat, parse_embedding_request
from backends.server.errors import APIError
from backends.server.protocol import MAX_SEQUENCES

NAMES = ("smollm2", "alias")
VOCAB = 100
HIDDEN = 8


def parse(body: Any) -> Any:
    return parse_embedding_request(body, NAMES, VOCAB, HIDDEN)


@pytest.mark.parametrize(("given", "inputs"), [
    ("a text", ("a text",)),
    (["one", "two"], ("one", "two")),
    ([1, 2, 3], ((1, 2, 3),)),                                   # token ids: one input
    ([5] * (MAX_SEQUENCES + 1), ((5,) * (MAX_SEQUENCES + 1),)),   # however long (the context bounds it)
    ([[1], [2, 3]], ((1,), (2, 3))),
    (["x"] * MAX_SEQUENCES, ("x",) * MAX_SEQUENCES),
])
def test_input_shapes(given: Any, inputs: tuple[Any, ...]) -> None:
    req = parse({"input": given})
    assert (req.inputs, req.model, req.encoding_format) == (inputs, "smollm2", EncodingFormat.FLOAT)


def test_optional_fields() -> None:
    req = parse({"input": "x", "model": "alias", "encoding_format": "base64", "dimensions": HIDDEN, "user": "u",
                 "unknown": [1]})
    assert (req.model, req.encoding_format) == ("alias", EncodingFormat.BASE64)


@pytest.mark.parametrize(("body", "param", "code"), [
    ({}, "input", "missing_required_parameter"),
    ({"input": ""}, "input", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": [[1], []]}, "input", "invalid_value"),
    ({"input": [1, VOCAB]}, "input", "invalid_value"),
    ({"input": [1, 1.0]}, "input", "invalid_value"),
    ({"input": [False]}, "input", "invalid_value"),
    ({"input": ["x", ["y"]]}, "input", "invalid_value"),
    ({"input": ["x"] * (MAX_SEQUENCES + 1)}, "input", "invalid_value"),
    ({"input": "x", "dimensions": HIDDEN - 1}, "dimensions", "unsupported_parameter"),
    ({"input": "x", "dimensions": 1.5}, "dimensions", "invalid_value"),
    ({"input": "x", "encoding_format": "float16"}, "encoding_format", "invalid_value"),
    ({"input": "x", "encoding_format": {}}, "encoding_format", "invalid_value"),
    ({"input": "x", "model": "other"}, "model", "model_not_found"),
    ({"input": "x", "user": ["u"]}, "user", "invalid_value"),
    ("not an object", None, None),
])
def test_refusals_name_the_field(body: Any, param: str | None, code: str | None) -> None:
    with pytest.raises(APIError) as caught:
        parse(body)
    assert (caught.value.param, caught.value.code) == (param, code)
