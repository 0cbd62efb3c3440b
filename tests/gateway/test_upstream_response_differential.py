"""The lean upstream client's response parsing (gateway/upstream/http_client.py, connection.py) against aiohttp's
client parser (llhttp, lenient as aiohttp's client runs it): Content-Length, chunked and read-to-close bodies,
trailing bytes, 1xx answers, however the bytes are cut into reads. Whatever the lean client passes on is what
aiohttp reads there (status, headers, body bytes), a whole body only where aiohttp reads the same whole body,
and a connection goes back to the pool only where aiohttp would keep it. It may give up where aiohttp would not
(the leg fails over); a well-formed answer it must read whole.

Cases: every vector of the corpus (tests/support/http_vectors.py, RESPONSE_CORPUS) in one read and a byte per
read; then MAX_EXAMPLES = 500 generated and mutated answers (derandomized, no example database).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.support.http_vectors import OK, RESPONSE_CORPUS, reads, responses
from tests.support.upstream_differential import assert_agrees, lean

MAX_EXAMPLES = 500


def test_the_reference_is_aiohttps_c_parser() -> None:
    from aiohttp import _http_parser, http_parser

    assert http_parser.HttpResponseParser is _http_parser.HttpResponseParser


@pytest.mark.parametrize("name", sorted(RESPONSE_CORPUS))
async def test_each_framing_vector_is_read_as_aiohttp_reads_it_or_refused(name: str) -> None:
    data, eof = RESPONSE_CORPUS[name]
    assert_agrees(data, eof, await lean([data], eof))
    if len(data) < 4_000:
        assert_agrees(data, eof, await lean([data[i:i + 1] for i in range(len(data))], eof))


@pytest.mark.parametrize("name", ["content_length", "chunked", "chunked_extensions_and_trailers", "close_delimited"])
async def test_well_formed_answers_are_read_whole_and_pooled_when_kept(name: str) -> None:
    """The agreement is not vacuous: well-formed answers are read whole, and a kept connection is pooled."""
    data, eof = RESPONSE_CORPUS[name]
    got = await lean([data], eof)
    assert got.complete and got.error is None and got.status == 200, got
    assert got.body in (b"hello", b"hello world") and got.reusable is (not eof), got


async def test_bytes_after_the_body_keep_the_connection_out_of_the_pool() -> None:
    got = await lean([OK + b"Content-Length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\n\r\n"], eof=False)
    assert got.complete and got.body == b"hello" and not got.reusable, got


@settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
async def test_generated_answers_are_read_as_aiohttp_reads_them_or_refused(data: st.DataObject) -> None:
    answer, eof = data.draw(responses())
    assert_agrees(answer, eof, await lean(data.draw(reads(answer)), eof))
