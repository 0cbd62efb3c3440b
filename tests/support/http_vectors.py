"""HTTP/1.1 requests and responses for the differential tests of the hand-written parsers: a corpus of known
request-smuggling and response-framing vectors (each one a test case), and hypothesis strategies that build heads
and bodies from HTTP's parts, mutate them, pipeline them and cut them into reads."""
from __future__ import annotations

import itertools

from hypothesis import strategies as st

from tests.support.lean_differential import LEAN_PATHS

CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
BODY = b'{"model":"m"}'
NEXT = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}"   # a pipelined request


def _chat(*lines: bytes, body: bytes = BODY, then: bytes = NEXT) -> bytes:
    return CHAT + b"".join(line + b"\r\n" for line in lines) + b"\r\n" + body + then


# name -> the bytes of one connection. Every vector is followed by a request that a parser reading the first
# one's framing differently would take from the wrong offset.
REQUEST_CORPUS: dict[str, bytes] = {
    "plain": _chat(b"Content-Length: 13"),
    "duplicate_content_length": _chat(b"Content-Length: 13", b"Content-Length: 13"),
    "duplicate_content_length_differing": _chat(b"Content-Length: 13", b"Content-Length: 0"),
    "content_length_list": _chat(b"Content-Length: 13, 13"),
    "content_length_plus": _chat(b"Content-Length: +13"),
    "content_length_minus": _chat(b"Content-Length: -13"),
    "content_length_leading_zeros": _chat(b"Content-Length: 0013"),
    "content_length_hex": _chat(b"Content-Length: 0xd"),
    "content_length_underscore": _chat(b"Content-Length: 1_3"),
    "content_length_unicode_digit": _chat(b"Content-Length: 1\xd9\xa3"),
    "content_length_huge": _chat(b"Content-Length: 99999999999999999999999"),
    "content_length_and_chunked": _chat(b"Content-Length: 13", b"Transfer-Encoding: chunked",
                                        body=b"0\r\n\r\n" + BODY),
    "chunked_then_content_length": _chat(b"Transfer-Encoding: chunked", b"Content-Length: 5",
                                         body=b"0\r\n\r\n"),
    "transfer_encoding_obfuscated": _chat(b"Content-Length: 13", b"Transfer-Encoding: xchunked"),
    "transfer_encoding_tab": _chat(b"Content-Length: 13", b"Transfer-Encoding:\tchunked"),
    "space_before_colon": _chat(b"Content-Length : 13"),
    "tab_before_colon": _chat(b"Content-Length\t: 13"),
    "obs_fold": _chat(b"X-A: a", b" b", b"Content-Length: 13"),
    "obs_fold_content_length": _chat(b"Content-Length: 1", b" 3"),
    "bare_lf_in_head": CHAT.replace(b"gw\r\n", b"gw\n") + b"Content-Length: 13\r\n\r\n" + BODY + NEXT,
    "bare_lf_ends_head": CHAT + b"Content-Length: 13\n\n" + BODY + NEXT,
    "bare_cr_in_value": _chat(b"X-A: a\rb", b"Content-Length: 13"),
    "nul_in_value": _chat(b"X-A: a\x00b", b"Content-Length: 13"),
    "nul_in_name": _chat(b"X-\x00A: b", b"Content-Length: 13"),
    "non_ascii_value": _chat(b"X-A: caf\xc3\xa9", b"Content-Length: 13"),
    "non_ascii_name": _chat(b"X-\xe9: a", b"Content-Length: 13"),
    "control_in_path": b"POST /v1/chat/completions\x01 HTTP/1.1\r\nHost: gw\r\nContent-Length: 13\r\n\r\n" + BODY,
    "huge_header_value": _chat(b"X-A: " + b"a" * 100_000, b"Content-Length: 13"),
    "many_headers": _chat(*[b"X-%d: v" % i for i in range(200)], b"Content-Length: 13"),
    "missing_host": b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 13\r\n\r\n" + BODY + NEXT,
    "duplicate_host": _chat(b"Host: other", b"Content-Length: 13"),
    "duplicate_content_type": _chat(b"Content-Type: a/b", b"Content-Type: c/d", b"Content-Length: 13"),
    "connection_close_in_second_field": _chat(b"Content-Length: 13", b"Connection: keep-alive",
                                              b"Connection: close"),
    "connection_close_listed": _chat(b"Content-Length: 13", b"Connection: keep-alive, close"),
    "connection_upgrade": _chat(b"Content-Length: 13", b"Connection: Upgrade", b"Upgrade: websocket"),
    "expect_continue": _chat(b"Content-Length: 13", b"Expect: 100-continue"),
    "http_1_0": CHAT.replace(b"HTTP/1.1", b"HTTP/1.0") + b"Content-Length: 13\r\n\r\n" + BODY + NEXT,
    "http_1_2": CHAT.replace(b"HTTP/1.1", b"HTTP/1.2") + b"Content-Length: 13\r\n\r\n" + BODY + NEXT,
    "lowercase_method": CHAT.replace(b"POST", b"post") + b"Content-Length: 13\r\n\r\n" + BODY + NEXT,
    "absolute_form": CHAT.replace(b"/v1", b"http://gw/v1", 1) + b"Content-Length: 13\r\n\r\n" + BODY + NEXT,
    "double_space_request_line": CHAT.replace(b"POST ", b"POST  ") + b"Content-Length: 13\r\n\r\n" + BODY,
    "leading_crlf": b"\r\n" + _chat(b"Content-Length: 13"),
    "pipelined_get_metrics": _chat(b"Content-Length: 13", then=b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n"),
    "pipelined_body_too_short": _chat(b"Content-Length: 20", then=b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n"),
    "pipelined_three": _chat(b"Content-Length: 13", then=NEXT + NEXT),
    "body_holds_a_request": _chat(b"Content-Length: %d" % len(NEXT), body=NEXT, then=b""),
    "trailing_whitespace_in_value": _chat(b"Content-Length: 13 \t", b"X-A: b \t"),
    "empty_header_value": _chat(b"X-A:", b"Content-Length: 13"),
    "empty_header_name": _chat(b": a", b"Content-Length: 13"),
}

# --- generated requests ------------------------------------------------------------------------------------------

_TOKEN = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_NAMES = [b"Content-Length", b"Transfer-Encoding", b"Connection", b"Host", b"Expect", b"Upgrade",
          b"Content-Type", b"User-Agent", b"X-Any"]
_VALUES = [b"13", b"0", b"2", b"02", b"chunked", b"close", b"keep-alive", b"Close", b"keep-alive, close", b"upgrade",
           b"100-continue", b"websocket", b"", b"a\tb", b"99999999999999999999"]
_BAD_VALUES = [b"+2", b"-1", b" 2", b"1 3", b"a\x00b", b"\xff", b"a\rb", b"a\nb"]
_SEPARATORS = [b":", b": ", b":\t", b": \t "]
_BAD_SEPARATORS = [b" :", b"\t:", b"::", b""]
_BAD_LINE_ENDS = [b"\n", b"\r", b"\r\r\n", b"\r\n ", b"\r\n\t"]   # the last two fold the line into the next
printable = st.characters(min_codepoint=0x20, max_codepoint=0x7e)
methods = st.sampled_from([b"POST"] * 12 + [b"GET", b"post", b"PUT", b"POST ", b"PRI", b""])
targets = st.sampled_from([p.encode() for p in LEAN_PATHS] * 3 + [
    b"/metrics", b"/v1/chat/completions?x=1", b"/v1/chat/completions/", b"*", b"http://gw/v1/chat/completions",
    b"/v1/chat%2Fcompletions", b""])
versions = st.sampled_from([b"HTTP/1.1"] * 12 + [b"HTTP/1.0", b"HTTP/1.2", b"HTTP/2.0", b"http/1.1", b"HTTP/1.1 "])
good_names = st.one_of(st.sampled_from(_NAMES), st.text(_TOKEN, min_size=1, max_size=12).map(str.encode))
good_values = st.one_of(st.sampled_from(_VALUES), st.text(printable, max_size=20).map(str.encode))


@st.composite
def header_lines(draw: st.DrawFn, wild: bool) -> bytes:
    """One header field line: well formed, or in a `wild` head sometimes not (a name, separator, value or end)."""
    def part(good: st.SearchStrategy[bytes], bad: st.SearchStrategy[bytes]) -> bytes:
        return draw(bad) if wild and draw(st.integers(0, 3)) == 0 else draw(good)

    name = part(good_names, st.binary(min_size=1, max_size=6))
    separator = part(st.sampled_from(_SEPARATORS), st.sampled_from(_BAD_SEPARATORS))
    value = part(good_values, st.one_of(st.sampled_from(_BAD_VALUES), st.binary(max_size=12)))
    return name + separator + value + part(st.just(b"\r\n"), st.sampled_from(_BAD_LINE_ENDS))


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """One request: request line, Host, fields and a Content-Length that fits the body; one head in three is
    `wild`: any of those may be missing, wrong or malformed."""
    wild = draw(st.integers(0, 2)) == 0
    body = draw(st.binary(max_size=40))
    if wild:
        lines = [draw(methods) + b" " + draw(targets) + b" " + draw(versions)
                 + draw(st.sampled_from([b"\r\n"] * 4 + _BAD_LINE_ENDS))]
    else:
        lines = [b"POST " + draw(st.sampled_from(LEAN_PATHS)).encode() + b" HTTP/1.1\r\n"]
    if not wild or draw(st.integers(0, 3)):
        lines.append(b"Host: gw\r\n")
    fields = draw(st.lists(header_lines(wild), max_size=4))
    if not wild or draw(st.integers(0, 3)):
        length = len(body) + (draw(st.sampled_from([0] * 3 + [-1, 1, -len(body)])) if wild else 0)
        fields.insert(draw(st.integers(0, len(fields))), b"Content-Length: %d\r\n" % max(length, 0))
    end = draw(st.sampled_from([b"\r\n"] * 4 + [b"\n", b""])) if wild else b"\r\n"
    return b"".join(lines + fields) + end + body


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` with a few bytes replaced, inserted or deleted (the byte values HTTP's grammar cares about)."""
    special = st.sampled_from(b"\r\n\t :\x00\x7f\x80\xff,;\"0aA")
    for _ in range(draw(st.integers(0, 3))):
        if not data:
            break
        at, byte = draw(st.integers(0, len(data) - 1)), bytes([draw(special)])
        op = draw(st.sampled_from(["replace", "insert", "delete"]))
        data = data[:at] + (b"" if op == "delete" else byte) + data[at + (op != "insert"):]
    return data


@st.composite
def connections(draw: st.DrawFn) -> bytes:
    """A connection's bytes: one to three pipelined requests, or a corpus vector, possibly mutated."""
    if draw(st.integers(0, 4)) == 0:
        data = REQUEST_CORPUS[draw(st.sampled_from(sorted(REQUEST_CORPUS)))][:2_000]
    else:
        data = b"".join(draw(st.lists(requests(), min_size=1, max_size=3)))
    return draw(mutated(data)) if draw(st.integers(0, 3)) == 0 else data


@st.composite
def reads(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """`data` cut into the reads it arrives in."""
    cuts = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=6))))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]
