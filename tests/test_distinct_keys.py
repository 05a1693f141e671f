"""Training's distinct-key helper gives np.unique's and np.isin's arrays on either side of the
range where it flags keys instead of sorting them (the lexical fits' models depend on it), and
the soft targets' values where a key has one."""

from __future__ import annotations

import numpy as np
import pytest

from training.distinct_keys import DENSE_KEYS, DENSE_SPREAD, contained, distinct, looked_up

# (range, keys drawn): flagged up to DENSE_KEYS and DENSE_SPREAD times the keys, sorted past either
CASES = [(1, 10), (1000, 5000), (DENSE_SPREAD * 5000, 5000), (DENSE_SPREAD * 5000 + 1, 5000),
         (DENSE_KEYS, DENSE_KEYS // DENSE_SPREAD), (DENSE_KEYS + 1, DENSE_KEYS // DENSE_SPREAD), (1 << 40, 5000)]


@pytest.mark.parametrize(("bound", "count"), CASES)
def test_distinct_and_contained_match_numpy_at_and_past_the_flagged_range(bound: int, count: int) -> None:
    rng = np.random.default_rng(bound % 1000)
    keys = np.concatenate([rng.integers(0, bound, count), [0, bound - 1, bound - 1]]).astype(np.int64)
    keys = np.concatenate([keys, keys[:100]])  # repeats, as a batch's slots hold them
    uniq, inverse = distinct(keys, bound)
    want_uniq, want_inverse = np.unique(keys, return_inverse=True)
    np.testing.assert_array_equal(uniq, want_uniq)
    np.testing.assert_array_equal(inverse, want_inverse)
    np.testing.assert_array_equal(uniq[inverse], keys)
    among = np.concatenate([keys[::7], rng.integers(0, bound, 300)])
    np.testing.assert_array_equal(contained(uniq, among, bound), np.isin(uniq, among))
    # looked_up: the value of each key's match in a set of distinct keys, 0 where none
    targets = np.unique(among)
    values = rng.random(len(targets)).astype(np.float32) + 0.5
    shuffled = rng.permutation(len(targets))
    want = np.zeros(len(uniq), np.float32)
    at = np.searchsorted(targets, uniq)
    hit = (at < len(targets)) & (targets[np.minimum(at, len(targets) - 1)] == uniq)
    want[hit] = values[at[hit]]
    np.testing.assert_array_equal(looked_up(uniq, targets[shuffled], values[shuffled], bound), want)


def test_no_keys_give_empty_arrays() -> None:
    empty = np.zeros(0, np.int64)
    for bound in (10, DENSE_KEYS + 1):
        uniq, inverse = distinct(empty, bound)
        assert uniq.size == 0 and inverse.size == 0
        assert contained(empty, np.array([3]), bound).size == 0
        assert looked_up(empty, np.array([3]), np.array([0.5]), bound).size == 0
        np.testing.assert_array_equal(looked_up(np.array([3, 4]), empty, np.zeros(0), bound), [0, 0])
