"""BlockIO over a cache in parts (a group's ranks' caches, backends/executor/group_kv.py): a block's bytes are each
part's share of it, in order, as one cache holding the parts' layers one after another would give them."""
from __future__ import annotations

import numpy as np
import torch

from backends.kv_connectors.tiers.block_io import BlockIO


def test_a_block_of_a_cache_in_parts_is_its_parts_in_order() -> None:
    torch.manual_seed(0)
    first, second = torch.randn(2, 2, 5, 4, 1, 8), torch.randn(3, 2, 5, 4, 1, 8)   # two ranks: 2 and 3 layers
    whole = torch.cat([first, second])                                              # one cache of all 5
    parts, one = BlockIO(first, second), BlockIO(whole)
    assert parts.block_nbytes == one.block_nbytes == 5 * 2 * 4 * 8 * 4
    for block in range(5):
        out, want = parts.buffer(), one.buffer()
        parts.read(block, out)
        one.read(block, want)
        assert np.array_equal(out, want)
    data = np.random.default_rng(1).integers(0, 256, parts.block_nbytes, dtype=np.uint8)
    parts.write(3, data)
    one.write(3, data)
    written = torch.cat([first, second]).view(torch.uint8)   # bytes: random ones include NaNs
    assert torch.equal(written, whole.view(torch.uint8))      # block 3 written alike, the others untouched
    assert torch.equal(written[:, :, 3].reshape(-1), torch.from_numpy(data))
