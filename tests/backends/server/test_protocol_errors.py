"""A real worker answers what aiohttp's HTTP parser refuses (a malformed or oversized request head) with an
OpenAI-style JSON error, as every other bad input, and goes on serving."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.raw_http import raw_post
from tests.support.worker_proc import worker_process

BODY = {"model": "smollm2", "prompt": "Hello", "max_tokens": 1}
BAD_HEADS = [   # (what is wrong, extra head lines)
    ("a header line over aiohttp's 8,190-byte limit", ["x-big: " + "v" * 9000]),
    ("a control character in a value", ["x-note: a\x01b"]),
    ("a header line without a colon", ["no colon here"]),
]


@pytest.fixture(scope="module")
def worker_url() -> Iterator[str]:
    with worker_process(["--max-num-seqs", "2"]) as url:
        yield url


@pytest.mark.parametrize(("name", "extra_lines"), BAD_HEADS)
def test_protocol_errors_get_openai_errors(worker_url: str, name: str, extra_lines: list[str]) -> None:
    reply = raw_post(worker_url, "/v1/completions", BODY, extra_lines)
    assert (reply.status, reply.content_type) == (400, "application/json"), (name, reply)
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == "invalid_request_error"
    good = raw_post(worker_url, "/v1/completions", BODY, [])
    assert good.status == 200 and good.json()["usage"]["completion_tokens"] == 1
