"""The lean HTTP/1.1 server's parser (gateway/server/lean_http.py) against aiohttp's llhttp-based one: for every
connection's bytes, however they are cut into reads, the lean server either hands the connection over to aiohttp
where aiohttp's next request starts, or sees exactly what aiohttp sees (method, path, headers, body bounds,
keep-alive, and so the next pipelined request). A parser that disagrees about where a request ends is how
requests are smuggled; a disagreement fails.

Cases: every vector of the corpus (tests/support/http_vectors.py, REQUEST_CORPUS) at this module's small limits
and at the gateway's defaults, each in one read and a byte per read; then MAX_EXAMPLES = 600 generated and mutated
connections (derandomized, no example database: the same cases on every run).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.support.http_vectors import REQUEST_CORPUS, connections, reads
from tests.support.lean_differential import Limits, assert_agrees, lean, reference

MAX_EXAMPLES = 600
GATEWAY_LIMITS = Limits(max_head_bytes=8190, max_headers=100)    # LimitsConfig's defaults


def test_the_reference_is_aiohttps_c_parser() -> None:
    from aiohttp import _http_parser, http_parser

    assert http_parser.HttpRequestParser is _http_parser.HttpRequestParser


@pytest.mark.parametrize("limits", [Limits(), GATEWAY_LIMITS], ids=["small-limits", "gateway-limits"])
@pytest.mark.parametrize("name", sorted(REQUEST_CORPUS))
async def test_each_smuggling_vector_is_seen_as_aiohttp_sees_it_or_handed_over(name: str, limits: Limits) -> None:
    data = REQUEST_CORPUS[name]
    assert_agrees(data, await lean([data], limits), limits)
    if len(data) < 4_000:
        assert_agrees(data, await lean([data[i:i + 1] for i in range(len(data))], limits), limits)


async def test_pipelined_requests_are_each_served_with_their_own_head() -> None:
    """The agreement above is not vacuous: the plain vector's two requests are served, each as aiohttp sees it."""
    data = REQUEST_CORPUS["plain"]
    got, expected = await lean([data], Limits()), reference(data, Limits())
    assert len(got.requests) == len(expected.requests) == 2 and got.handed_over is None
    assert [r.path for r in got.requests] == ["/v1/chat/completions", "/v1/completions"]


@settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
async def test_generated_connections_are_seen_as_aiohttp_sees_them_or_handed_over(data: st.DataObject) -> None:
    wire = data.draw(connections())
    chunks = data.draw(reads(wire))
    assert_agrees(wire, await lean(chunks, Limits()), Limits())
