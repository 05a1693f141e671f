"""Distinct integer keys of a mini-batch, by flags when their range is small.

Training's fits (token_shortlist's lexical table, EAGLE's label space) key each step's pairs as
row * width + column and need the distinct keys, where each pair went and which keys are in
another set. np.unique and np.isin sort; a batch may hold ~10^6 pairs over a range not much
larger, where a flag per possible key gives the same arrays in O(range + pairs): 6.5 ms against
116 ms for 10^6 keys in a range of 2 * 10^5, while for 10^4 keys in a range of 4 * 10^6 the sort
is ~5x faster (bench/RESULTS.md, "Training time on small data"). The sorts were half of a small
dataset's training.
"""

from __future__ import annotations

import numpy as np

# Flags are used for ranges up to this many keys (40 MiB of flags and ranks a call at most)...
DENSE_KEYS = 1 << 23
# ...and up to this many times the number of keys (beyond, sorting them is cheaper).
DENSE_SPREAD = 32


def _flagged(bound: int, count: int) -> bool:
    return bound <= DENSE_KEYS and bound <= DENSE_SPREAD * count


def distinct(keys: np.ndarray, bound: int) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(keys, return_inverse=True) for integer keys in [0, bound)."""
    if not _flagged(bound, len(keys)):
        return np.unique(keys, return_inverse=True)
    present = np.zeros(bound, dtype=bool)
    present[keys] = True
    uniq = np.flatnonzero(present)
    rank = np.empty(bound, dtype=np.int32)  # read only where a key is, each written below
    rank[uniq] = np.arange(len(uniq), dtype=np.int32)
    return uniq, rank[keys].astype(np.intp)


def contained(keys: np.ndarray, among: np.ndarray, bound: int) -> np.ndarray:
    """np.isin(keys, among) for integer keys and `among` in [0, bound)."""
    if not _flagged(bound, len(keys) + len(among)):
        return np.isin(keys, among)
    flags = np.zeros(bound, dtype=bool)
    flags[among] = True
    return flags[keys]


def looked_up(keys: np.ndarray, among: np.ndarray, values: np.ndarray, bound: int) -> np.ndarray:
    """float32 per key: the value of the same key in `among` (distinct keys in [0, bound)), 0
    where it has none: contained()'s flags, weighted."""
    values = np.asarray(values, dtype=np.float32)
    if _flagged(bound, len(keys) + len(among)):
        table = np.zeros(bound, dtype=np.float32)
        table[among] = values
        return table[keys]
    if not len(among):
        return np.zeros(len(keys), dtype=np.float32)
    order = np.argsort(among, kind="stable")
    at = order[np.minimum(np.searchsorted(among, keys, sorter=order), len(among) - 1)]
    return np.where(among[at] == keys, values[at], np.float32(0))
