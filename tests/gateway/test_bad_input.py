"""Bad input gets an OpenAI-style error with the right status, and nothing reaches an upstream."""
from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import orjson
import pytest

from tests.gateway.conftest import gateway_config
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_proc import GatewayProcess

MAX_BODY = 4096


def post(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeUpstream, GatewayProcess]]:
    fake = FakeUpstream("a")
    config = gateway_config({"p": [fake.url]}, max_body_bytes=MAX_BODY)
    gateway = GatewayProcess(config, tmp_path_factory.mktemp("bad_input"))
    try:
        yield fake, gateway
    finally:
        gateway.stop()
        fake.stop()


def _json(value: object) -> bytes:
    return orjson.dumps(value)


MESSAGES = [{"role": "user", "content": "hi"}]

CASES = [
    # (name, path, body bytes, status, param)
    ("empty body", "/v1/chat/completions", b"", 400, None),
    ("malformed json", "/v1/chat/completions", b'{"model": "m", "messages": [', 400, None),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("missing model", "/v1/chat/completions", _json({"messages": MESSAGES}), 400, "model"),
    ("model not a string", "/v1/chat/completions", _json({"model": 7, "messages": MESSAGES}), 400, "model"),
    ("unknown model", "/v1/chat/completions", _json({"model": "nope", "messages": MESSAGES}), 404, "model"),
    ("missing messages", "/v1/chat/completions", _json({"model": "m"}), 400, "messages"),
    ("empty messages", "/v1/chat/completions", _json({"model": "m", "messages": []}), 400, "messages"),
    ("messages not a list", "/v1/chat/completions", _json({"model": "m", "messages": "hi"}), 400, "messages"),
    ("message without role", "/v1/chat/completions", _json({"model": "m", "messages": [{"content": "x"}]}),
     400, "messages[0]"),
    ("content wrong type", "/v1/chat/completions",
     _json({"model": "m", "messages": [{"role": "user", "content": 5}]}), 400, "messages[0].content"),
    ("stream not bool", "/v1/chat/completions", _json({"model": "m", "messages": MESSAGES, "stream": "yes"}),
     400, "stream"),
    ("max_tokens string", "/v1/chat/completions",
     _json({"model": "m", "messages": MESSAGES, "max_tokens": "10"}), 400, "max_tokens"),
    ("max_tokens zero", "/v1/chat/completions", _json({"model": "m", "messages": MESSAGES, "max_tokens": 0}),
     400, "max_tokens"),
    ("temperature string", "/v1/chat/completions",
     _json({"model": "m", "messages": MESSAGES, "temperature": "hot"}), 400, "temperature"),
    ("missing prompt", "/v1/completions", _json({"model": "m"}), 400, "prompt"),
    ("prompt wrong type", "/v1/completions", _json({"model": "m", "prompt": {"a": 1}}), 400, "prompt"),
    # A full block (16 ids) is hashed as uint32s for the prefix index: these were 500s (OverflowError).
    ("token id above uint32", "/v1/completions", _json({"model": "m", "prompt": [2**32] * 16}), 400, "prompt"),
    ("negative token id in a batch", "/v1/completions", _json({"model": "m", "prompt": [[-1] * 16]}), 400, "prompt"),
    ("oversized body", "/v1/chat/completions",
     _json({"model": "m", "messages": [{"role": "user", "content": "x" * (2 * MAX_BODY)}]}), 413, None),
]


@pytest.mark.parametrize(("name", "path", "data", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_before_any_upstream(stack, name: str, path: str, data: bytes, status: int,
                                                   param: str | None) -> None:
    fake, gateway = stack
    before = fake.stats()["num_requests"]
    got_status, headers, body = post(gateway.url + path, data)
    assert got_status == status, body
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert headers.get("x-request-id")
    assert fake.stats()["num_requests"] == before
    assert gateway.alive


def test_good_request_after_bad_ones_still_works(stack) -> None:
    _fake, gateway = stack
    status, _, body = post(gateway.url + "/v1/completions", _json({"model": "m", "prompt": "hi"}))
    assert status == 200 and orjson.loads(body)["choices"][0]["text"]


def test_unknown_route_is_an_openai_error(stack) -> None:
    _, gateway = stack
    status, _, body = post(gateway.url + "/v1/nothing", b"{}")
    assert status == 404 and orjson.loads(body)["error"]["type"] == "invalid_request_error"


def test_models_lists_the_configured_names(stack) -> None:
    _, gateway = stack
    with urllib.request.urlopen(gateway.url + "/v1/models", timeout=5) as response:
        assert [m["id"] for m in orjson.loads(response.read())["data"]] == ["m"]
