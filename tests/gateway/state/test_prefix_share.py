"""The approximate prefix index shared between gateway processes (gateway/routing/prefix_share.py): two sharers over
one store, memory and a real Redis, stand for two processes."""
from __future__ import annotations

import logging

import pytest

from cache.prefix_index import PrefixIndex
from gateway.routing.prefix_share import PrefixSharer, decode, encode
from gateway.state import StateStore

A, B = "http://a:1", "http://b:2"


def approximate_index() -> PrefixIndex:
    index = PrefixIndex()
    for endpoint in (A, B):
        index.track_routed(endpoint, 1000)
    return index


def test_decisions_survive_encoding_whole() -> None:
    decisions = [(A, [0, 1, 2**64 - 1]), (B, []), (A, [12345678901234567890])]
    assert decode(encode(decisions)) == [(A, (0, 1, 2**64 - 1)), (B, ()), (A, (12345678901234567890,))]
    for bad in ("[[1, 2]]", "[[\"a\", \"not base64!\"]]", "{}", "[[\"a\"]]"):
        with pytest.raises((ValueError, TypeError)):
            decode(bad)


async def test_each_process_applies_its_peers_decisions_and_not_its_own(store: StateStore) -> None:
    index_1, index_2 = approximate_index(), approximate_index()
    applied: list[int] = []
    sharer_1 = PrefixSharer(index_1, store, interval_s=0.25, on_applied=applied.append)
    sharer_2 = PrefixSharer(index_2, store, interval_s=0.25)
    index_1.record_routed(A, [11, 12, 13])
    sharer_1.note(A, [11, 12, 13])
    index_1.record_routed(B, [21, 22])
    sharer_1.note(B, [21, 22])
    await sharer_1.share_once()
    assert index_2.matched_blocks([11, 12, 13, 14]) == {}          # not yet read
    await sharer_2.share_once()
    assert index_2.matched_blocks([11, 12, 13, 14]) == {A: 3}
    assert index_2.matched_blocks([21, 22]) == {B: 2}
    index_2.record_routed(A, [31])
    sharer_2.note(A, [31])
    await sharer_2.share_once()
    await sharer_1.share_once()
    assert applied == [1]                                            # one peer decision; its own two skipped
    assert index_1.matched_blocks([31]) == {A: 1}
    late = approximate_index()                                       # a process that starts now reads back
    await PrefixSharer(late, store, interval_s=0.25).share_once()    # the recent log: a warm index
    assert late.matched_blocks([11, 12, 13]) == {A: 3} and late.matched_blocks([31]) == {A: 1}


async def test_a_malformed_batch_is_skipped_with_a_warning(store: StateStore, caplog) -> None:
    index = approximate_index()
    await store.publish_routed("someone", "not json", max_entries=100)
    await store.publish_routed("someone", encode([(A, [5, 6])]), max_entries=100)
    with caplog.at_level(logging.WARNING, logger="gateway.routing.prefix_share"):
        await PrefixSharer(index, store, interval_s=0.25).share_once()
    assert "malformed" in caplog.text
    assert index.matched_blocks([5, 6]) == {A: 2}                   # the good batch after it still applies
