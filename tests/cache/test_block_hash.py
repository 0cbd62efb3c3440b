import random

import pytest
from hypothesis import given, strategies as st

from cache.block_hash import ROOT_HASH, block_hashes, hash_block_tokens


def test_only_full_blocks_are_hashed():
    assert block_hashes(list(range(15)), 16) == []
    assert len(block_hashes(list(range(16)), 16)) == 1
    assert len(block_hashes(list(range(47)), 16)) == 2


def test_chain_depends_on_whole_prefix():
    a = list(range(32))
    b = [999, *a[1:]]  # differs only in the first block
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[0] != hb[0] and ha[1] != hb[1]  # second block's tokens equal, but parent differs


def test_chained_definition():
    tokens = [random.Random(0).randrange(50000) for _ in range(48)]
    expected, parent = [], ROOT_HASH
    for i in range(3):
        parent = hash_block_tokens(parent, tokens[16 * i:16 * (i + 1)])
        expected.append(parent)
    assert block_hashes(tokens, 16) == expected


@given(st.lists(st.integers(0, 2**31 - 1), min_size=16, max_size=80))
def test_prefix_property(tokens):
    full = block_hashes(tokens, 16)
    for cut in range(0, len(tokens) + 1, 16):
        assert block_hashes(tokens[:cut], 16) == full[: cut // 16]


def test_bad_block_size():
    with pytest.raises(ValueError):
        block_hashes([1, 2, 3], 0)
