"""One HTTP/1.1 request over a raw socket, for heads that clients refuse to send (malformed or oversized)."""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True)
class RawReply:
    status: int
    content_type: str   # without parameters
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


def raw_post(base_url: str, path: str, body: Any, extra_lines: list[str]) -> RawReply:
    """POST `body` as JSON to `path` with `extra_lines` added to the head as given, with `Connection: close`,
    and read the reply to the end of the connection."""
    host, port = base_url.removeprefix("http://").split(":")
    raw = orjson.dumps(body)
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
             f"Content-Length: {len(raw)}", "Connection: close", *extra_lines]
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + raw)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, content = reply.partition(b"\r\n\r\n")
    status_line, *fields = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (f.partition(":") for f in fields)}
    return RawReply(int(status_line.split()[1]), headers.get("content-type", "").split(";")[0], content)
