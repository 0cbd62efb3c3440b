"""Clients that keep requests flowing through gateways while a test breaks their shared state store."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tests.faults.client import Reply, chat, new_request_id, post
from tests.support.wait import await_until

OUTAGE_LOG, BACK_LOG = "shared state store unavailable", "shared state store is back"


class Load:
    """`num_clients` clients that send requests one after another until stopped, streamed and whole, half of
    them in a session, client i to gateway i mod len(urls); every request has its own id, every reply is kept."""

    def __init__(self, urls: Sequence[str], key: str, num_clients: int = 4) -> None:
        self._urls = list(urls)
        self._key = key
        self._num_clients = num_clients
        self._stopped = asyncio.Event()
        self.replies: list[tuple[str, bool, Reply]] = []   # request id, streamed, reply

    async def run(self) -> None:
        await asyncio.gather(*(self._client(i) for i in range(self._num_clients)))

    def stop(self) -> None:
        self._stopped.set()

    async def wait_for_more(self, num_more: int, what: str) -> None:
        target = len(self.replies) + num_more
        await await_until(lambda: len(self.replies) >= target, what)

    async def _client(self, index: int) -> None:
        num_sent = 0
        url = self._urls[index % len(self._urls)]
        while not self._stopped.is_set():
            stream = num_sent % 2 == 1
            headers = {"Authorization": f"Bearer {self._key}", "x-request-id": new_request_id()}
            if index % 2:
                headers["x-session-affinity"] = f"load-{index}"
            reply = await post(url, chat("m", stream), headers=headers)
            self.replies.append((headers["x-request-id"], stream, reply))
            num_sent += 1
