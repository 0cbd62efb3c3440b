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


# --- responses ---------------------------------------------------------------------------------------------------

OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
CHUNKED = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"

# name -> (the bytes of an upstream's answer, whether the upstream then closes the connection)
RESPONSE_CORPUS: dict[str, tuple[bytes, bool]] = {
    "content_length": (OK + b"Content-Length: 5\r\n\r\nhello", False),
    "content_length_trailing_bytes": (OK + b"Content-Length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\n\r\n", False),
    "content_length_short_then_close": (OK + b"Content-Length: 9\r\n\r\nhello", True),
    "content_length_duplicate": (OK + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello", True),
    "content_length_differing": (OK + b"Content-Length: 5\r\nContent-Length: 3\r\n\r\nhello", True),
    "content_length_signed": (OK + b"Content-Length: +5\r\n\r\nhello", True),
    "content_length_negative": (OK + b"Content-Length: -1\r\n\r\nhello", True),
    "content_length_list": (OK + b"Content-Length: 5, 5\r\n\r\nhello", True),
    "content_length_huge": (OK + b"Content-Length: 99999999999999999999\r\n\r\nhello", True),
    "chunked": (OK + b"Transfer-Encoding: chunked\r\n\r\n" + CHUNKED, False),
    "chunked_trailing_bytes": (OK + b"Transfer-Encoding: chunked\r\n\r\n" + CHUNKED + b"extra", False),
    "chunked_extensions_and_trailers": (OK + b"Transfer-Encoding: chunked\r\n\r\n5;a=b\r\nhello\r\n0\r\nT: 1\r\n\r\n",
                                        False),
    "chunked_and_content_length": (OK + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n" + CHUNKED, False),
    "chunked_not_last": (OK + b"Transfer-Encoding: chunked, gzip\r\n\r\n" + CHUNKED, True),
    "chunked_uppercase": (OK + b"Transfer-Encoding: CHUNKED\r\n\r\n" + CHUNKED, False),
    "chunked_size_signed": (OK + b"Transfer-Encoding: chunked\r\n\r\n+5\r\nhello\r\n0\r\n\r\n", True),
    "chunked_size_underscore": (OK + b"Transfer-Encoding: chunked\r\n\r\n1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n",
                                True),
    "chunked_size_0x": (OK + b"Transfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n", True),
    "chunked_size_spaces": (OK + b"Transfer-Encoding: chunked\r\n\r\n 5 \r\nhello\r\n0\r\n\r\n", True),
    "chunked_bare_lf": (OK + b"Transfer-Encoding: chunked\r\n\r\n5\nhello\n0\n\n", True),
    "chunked_cut_then_close": (OK + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhel", True),
    "close_delimited": (OK + b"\r\nhello world", True),
    "close_delimited_http_1_0": (b"HTTP/1.0 200 OK\r\n\r\nhello", True),
    "http_1_0_keep_alive": (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 5\r\n\r\nhello", False),
    "connection_close_in_second_field": (OK + b"Connection: keep-alive\r\nConnection: close\r\nContent-Length: 5"
                                         b"\r\n\r\nhello", False),
    "no_content_with_body": (b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello", False),
    "not_modified": (b"HTTP/1.1 304 Not Modified\r\n\r\n", False),
    "continue_then_answer": (b"HTTP/1.1 100 Continue\r\n\r\n" + OK + b"Content-Length: 5\r\n\r\nhello", False),
    "early_hints_then_answer": (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK + b"Content-Length: 2\r\n\r\nhi",
                                False),
    "switching_protocols": (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\nhello", True),
    "bare_lf_head": (b"HTTP/1.1 200 OK\nContent-Length: 5\n\nhello", True),
    "obs_fold": (OK + b"X-A: a\r\n b\r\nContent-Length: 5\r\n\r\nhello", False),
    "space_before_colon": (OK + b"Content-Length : 5\r\n\r\nhello", True),
    "nul_in_value": (OK + b"X-A: a\x00b\r\nContent-Length: 5\r\n\r\nhello", False),
    "non_ascii_value": (OK + b"X-A: caf\xc3\xa9\r\nContent-Length: 5\r\n\r\nhello", False),
    "no_colon": (OK + b"garbage\r\nContent-Length: 5\r\n\r\nhello", False),
    "status_two_digits": (b"HTTP/1.1 20 OK\r\nContent-Length: 5\r\n\r\nhello", True),
    "status_four_digits": (b"HTTP/1.1 2000 OK\r\nContent-Length: 5\r\n\r\nhello", True),
    "status_no_reason": (b"HTTP/1.1 200\r\nContent-Length: 5\r\n\r\nhello", False),
    "http_2_status_line": (b"HTTP/2 200 OK\r\nContent-Length: 5\r\n\r\nhello", True),
    "huge_header": (OK + b"X-A: " + b"a" * 100_000 + b"\r\nContent-Length: 5\r\n\r\nhello", True),
}

_RESPONSE_NAMES = [b"Content-Length", b"Transfer-Encoding", b"Connection", b"Content-Type", b"X-A"]
_RESPONSE_VALUES = [b"5", b"0", b"chunked", b"close", b"keep-alive", b"gzip, chunked", b"text/event-stream"]
_STATUS_LINES = [b"HTTP/1.1 200 OK"] * 8 + [b"HTTP/1.0 200 OK", b"HTTP/1.1 204 No Content", b"HTTP/1.1 304 Not",
                                             b"HTTP/1.1 429 Slow down", b"HTTP/1.1 200", b"HTTP/1.1 2000 OK"]


@st.composite
def chunked_bodies(draw: st.DrawFn, wild: bool) -> bytes:
    """Chunks of any data, with extensions, then the last chunk and trailers; in a `wild` body odd sizes too."""
    sizes = st.sampled_from([b"+5", b"0x5", b" 5", b"5 ", b"-5", b"FFFFFFFFFFFFFFFFFF", b""]) if wild else st.nothing()
    parts = []
    for data in draw(st.lists(st.binary(min_size=1, max_size=12), max_size=4)):
        size = draw(st.one_of(st.just(b"%x" % len(data)), sizes)) + draw(st.sampled_from([b"", b";x", b";a=\"b\""]))
        parts.append(size + b"\r\n" + data + b"\r\n")
    return b"".join(parts) + b"0\r\n" + draw(st.sampled_from([b"", b"T: 1\r\n"])) + b"\r\n"


@st.composite
def responses(draw: st.DrawFn) -> tuple[bytes, bool]:
    """An upstream's answer (1xx first, sometimes) and whether it then closes; one in three is `wild`."""
    wild = draw(st.integers(0, 2)) == 0
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    body = draw(chunked_bodies(wild)) if framing == "chunked" else draw(st.binary(max_size=30))
    lines = [draw(st.sampled_from(_STATUS_LINES)) if wild else b"HTTP/1.1 200 OK"]
    if framing == "length":
        lines.append(b"Content-Length: %d" % len(body))
    elif framing == "chunked":
        lines.append(b"Transfer-Encoding: chunked")
    if wild:
        lines += draw(st.lists(st.builds(lambda n, v: n + b": " + v, st.sampled_from(_RESPONSE_NAMES),
                                         st.sampled_from(_RESPONSE_VALUES)), max_size=3))
    answer = b"\r\n".join([lines[0], *draw(st.permutations(lines[1:]))]) + b"\r\n\r\n" + body
    if wild and draw(st.booleans()):
        answer = b"HTTP/1.1 100 Continue\r\n\r\n" + answer
    if draw(st.integers(0, 3)) == 0:
        answer += draw(st.sampled_from([b"trailing", b"HTTP/1.1 200 OK\r\n\r\n", b"\r\n"]))
    answer = draw(mutated(answer)) if wild and draw(st.booleans()) else answer
    return answer, framing == "close" or draw(st.booleans())

