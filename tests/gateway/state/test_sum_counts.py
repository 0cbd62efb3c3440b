"""gateway/state/base.py's sum_counts: the peers' in-flight counts that share_inflight returns, summed per
endpoint position by position, with what another version might have written skipped, not fatal."""
from __future__ import annotations

import pytest

from gateway.state.base import sum_counts


@pytest.mark.parametrize(("replicas", "expected"), [
    ([], {}),
    ([{"a": [1, 2, 3]}, {"a": [10, 20, 30], "b": [0, 5, 0]}], {"a": [11, 22, 33], "b": [0, 5, 0]}),
    ([{"a": [1, 2]}, {"a": [1, 2, 3]}], {"a": [2, 4, 3]}),            # a longer entry widens the sum
    ([None, "x", [1, 2], {"a": [1, 2, 3]}], {"a": [1, 2, 3]}),      # not a mapping: skipped
    ([{"a": "123", "b": [1, "2", 3], "c": [True, 1, 1], "d": [4, 5, 6]}], {"d": [4, 5, 6]}),  # bad values: skipped
])
def test_sums_per_endpoint_and_skips_what_is_not_counts(replicas: list[object], expected: dict[str, list[int]]) -> None:
    assert sum_counts(replicas) == expected
