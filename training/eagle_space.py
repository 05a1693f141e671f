"""The feature space EAGLE compares documents and label vectors in (training/eagle.py): unit rows,
centred or not, dense (embeddings) or sparse (TF-IDF); label vectors in their span, with every
product a sparse one plus rank-one corrections for centred sparse rows, computed in chunks."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from training.distinct_keys import distinct

Features = sp.csr_matrix | np.ndarray
DENSE_CHUNK = 1 << 16
# The (pair, member) scores, or for sparse features their (pair, member, token) products, computed at
# once: memory is bounded by this chunk (plus one pair or one document beyond it), not by groups x
# their labels x their members (audit 5 B11: groups of 500 took 6-7 GB).
SCORE_CHUNK = 1 << 22
# A run of (doc, label) entries is scored by one product of its distinct documents and labels when
# the entries fill at least this share of it and it has at most `chunk` cells (sparse_row_dots): a
# group's members with each of its labels fill all of it, runs of small groups ~1 / (their number).
BLOCK_FILL = 0.25
# A run filling at least BLOCK_FILL / SPLIT_SPAN of its product (a few large groups, each filling
# its own) is halved until its parts fill theirs; runs of small groups fill far less: looked up.
SPLIT_SPAN = 64
# ...down to parts of this many entries: a product of a few small groups costs more than their lookups
# (few labels, as in small data, made parts of one group of 4 pass the test above).
SPLIT_MIN = 1 << 14


@dataclass
class CenteredVectors:
    """Rows S_l - c_l m: sparse S [L, F], c [L], the documents' mean m [F]."""

    sparse: sp.csr_matrix
    coef: np.ndarray
    mean: np.ndarray

    def __post_init__(self) -> None:
        # sorted once here (pool and mix make a new matrix), not by each of sparse_row_dots' calls
        self.sparse.sort_indices()

    @functools.cached_property
    def sparse_dot_mean(self) -> np.ndarray:
        """[L]: S_l . m, read by every score of a label (once a vector, not once a chunk of scores)."""
        return np.asarray(self.sparse @ self.mean).ravel()

    @property
    def shape(self) -> tuple[int, int]:
        return self.sparse.shape

    def toarray(self) -> np.ndarray:
        return self.sparse.toarray() - self.coef[:, None] * self.mean[None, :]


Vectors = np.ndarray | CenteredVectors


class Space:
    """The feature rows the imputer compares (unit norm, centred or not) and label vectors in their
    span: pool (a weighted sum of rows per label), mix, normalize, norms, dots."""

    num_rows: int

    def pool(self, weights: sp.csr_matrix) -> Vectors: ...
    def mix(self, a: float | np.ndarray, v: Vectors, b: float, u: Vectors) -> Vectors: ...
    def norms(self, v: Vectors) -> np.ndarray: ...
    def dots(self, docs: np.ndarray, v: Vectors, labels: np.ndarray) -> np.ndarray: ...
    def all_dots(self, docs: np.ndarray, v: Vectors) -> np.ndarray: ...
    def row_dots(self, a: np.ndarray, b: np.ndarray) -> np.ndarray: ...

    def normalize(self, v: Vectors) -> Vectors:
        """Rows scaled to unit norm (zero rows stay zero)."""
        norms = self.norms(v)
        return self.mix(np.where(norms > 1e-12, 1.0 / np.maximum(norms, 1e-30), 0.0), v, 0.0, v)


def space_of(features: Features, num_docs: int, center: bool, chunk: int = SCORE_CHUNK) -> Space:
    if isinstance(features, np.ndarray):
        return DenseSpace(features, num_docs, center)
    return SparseSpace(sp.csr_matrix(features, dtype=np.float32), num_docs, center, chunk)


class DenseSpace(Space):
    def __init__(self, x: np.ndarray, num_docs: int, center: bool) -> None:
        x = np.asarray(x, dtype=np.float32)
        if center:
            x = x - x[:num_docs].mean(axis=0, keepdims=True)
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        self.x = (x / np.where(norms > 0, norms, 1.0)).astype(np.float32)
        self.num_rows = x.shape[0]

    def pool(self, weights: sp.csr_matrix) -> np.ndarray:
        return np.asarray(weights @ self.x, dtype=np.float32)

    def mix(self, a: float | np.ndarray, v: np.ndarray, b: float, u: np.ndarray) -> np.ndarray:
        return (np.asarray(a, np.float32).reshape(-1, 1) * v + np.float32(b) * u).astype(np.float32)

    def norms(self, v: np.ndarray) -> np.ndarray:
        return np.linalg.norm(v, axis=1)

    def dots(self, docs: np.ndarray, v: np.ndarray, labels: np.ndarray) -> np.ndarray:
        out = np.empty(len(docs), np.float32)
        for s in range(0, len(docs), DENSE_CHUNK):
            e = s + DENSE_CHUNK
            out[s:e] = np.einsum("ij,ij->i", self.x[docs[s:e]], v[labels[s:e]])
        return out

    def all_dots(self, docs: np.ndarray, v: np.ndarray) -> np.ndarray:
        return self.x[docs] @ v.T

    def row_dots(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.x[a] @ self.x[b].T


class SparseSpace(Space):
    """Rows a_i (x_i - m) of unit-norm sparse x_i (m = 0 and a_i = 1 uncentred); dots looks up
    at most `chunk` of the rows' nonzeros at once."""

    def __init__(self, x: sp.csr_matrix, num_docs: int, center: bool, chunk: int = SCORE_CHUNK) -> None:
        self.chunk = chunk
        self.x = sp.csr_matrix(sp.diags(1.0 / np.maximum(row_norms(x), 1e-30)) @ x, dtype=np.float32)
        self.x.sort_indices()
        self.num_rows = x.shape[0]
        self.mean = (np.asarray(self.x[:num_docs].mean(axis=0)).ravel() if center
                     else np.zeros(x.shape[1])).astype(np.float64)
        self.x_mean = np.asarray(self.x @ self.mean).ravel()
        self.mean_sq = float(self.mean @ self.mean)
        # ||x_i - m||^2 = ||x_i||^2 - 2 x_i.m + m.m, rows of zero norm stay zero
        centred = np.sqrt(np.maximum(row_norms(self.x) ** 2 - 2 * self.x_mean + self.mean_sq, 0.0))
        self.scale = np.where(centred > 1e-12, 1.0 / np.maximum(centred, 1e-30), 0.0)

    def pool(self, weights: sp.csr_matrix) -> CenteredVectors:
        w = sp.csr_matrix(weights) @ sp.diags(self.scale)
        return CenteredVectors(sp.csr_matrix(w @ self.x, dtype=np.float32), np.asarray(w.sum(axis=1)).ravel(),
                               self.mean)

    def mix(self, a: float | np.ndarray, v: CenteredVectors, b: float, u: CenteredVectors) -> CenteredVectors:
        a_rows = np.broadcast_to(np.asarray(a, np.float64), v.coef.shape)
        # each row scaled in place of a product with a diagonal matrix (the same values, without
        # the product's passes over the label vectors' nonzeros)
        m = v.sparse
        s = sp.csr_matrix((m.data * np.repeat(a_rows, np.diff(m.indptr)), m.indices.copy(), m.indptr.copy()),
                          shape=m.shape)
        if b != 0.0:
            s = s + b * u.sparse
        return CenteredVectors(sp.csr_matrix(s, dtype=np.float32), a_rows * v.coef + b * u.coef, self.mean)

    def norms(self, v: CenteredVectors) -> np.ndarray:
        s_mean = v.sparse_dot_mean
        sq = row_norms(v.sparse) ** 2 - 2 * v.coef * s_mean + v.coef**2 * self.mean_sq
        return np.sqrt(np.maximum(sq, 0.0))

    def dots(self, docs: np.ndarray, v: CenteredVectors, labels: np.ndarray) -> np.ndarray:
        """a_i <x_i - m, S_l - c_l m> = a_i (x_i.S_l - c_l x_i.m - m.S_l + c_l m.m)."""
        raw = sparse_row_dots(self.x, docs, v.sparse, labels, self.chunk)
        if not self.mean_sq:
            return (self.scale[docs] * raw).astype(np.float32)
        s_mean = v.sparse_dot_mean[labels]
        c = v.coef[labels]
        return (self.scale[docs] * (raw - c * self.x_mean[docs] - s_mean + c * self.mean_sq)).astype(np.float32)

    def all_dots(self, docs: np.ndarray, v: CenteredVectors) -> np.ndarray:
        # v's rows times the documents' transposed (few), not the documents times v transposed:
        # the same sums in the same order, without transposing every label vector each call
        raw = np.ascontiguousarray((v.sparse @ self.x[docs].T).toarray().T, dtype=np.float64)
        s_mean = v.sparse_dot_mean
        raw -= np.outer(self.x_mean[docs], v.coef) + s_mean[None, :] - v.coef[None, :] * self.mean_sq
        return (self.scale[docs, None] * raw).astype(np.float32)

    def row_dots(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """[len(a), len(b)]: a_i a_j <x_i - m, x_j - m>."""
        raw = np.asarray((self.x[a] @ self.x[b].T).todense(), dtype=np.float64)
        raw -= self.x_mean[a][:, None] + self.x_mean[b][None, :] - self.mean_sq
        return (self.scale[a][:, None] * raw * self.scale[b][None, :]).astype(np.float32)


def sparse_row_dots(x: sp.csr_matrix, docs: np.ndarray, v: sp.csr_matrix, labels: np.ndarray,
                     chunk: int = SCORE_CHUNK) -> np.ndarray:
    """<x[docs[i]], v[labels[i]]> for every i, for runs of docs with at most `chunk` nonzeros (a
    longer row alone): one key per (doc, token) for all docs at once was the data times the
    group size times its labels. A run's entries are scored by one sparse product of their
    distinct labels and documents where they fill enough of it, as a large group's members with
    its labels do (a run spanning a few such groups is halved until its parts do), else token by
    token (_looked_up_dots). Both give the same bits: products are exact in float64 and a row's
    are summed in token order (x's and v's rows sorted), so the result depends neither on the
    runs nor on the way."""
    v = sp.csr_matrix(v)
    if not v.has_sorted_indices:
        v = v.sorted_indices()  # a copy: the caller's matrix stays as it was
    out = np.zeros(len(docs), np.float64)
    v_keys = None
    parts = list(runs(np.diff(x.indptr)[docs], chunk))
    while parts:
        lo, hi = parts.pop()
        doc_set, doc_at = distinct(docs[lo:hi], x.shape[0])
        label_set, label_at = distinct(labels[lo:hi], v.shape[0])
        cells = len(doc_set) * len(label_set)
        if cells <= min((hi - lo) / BLOCK_FILL, chunk):
            # [labels, docs]: v's long rows (sums of their groups' members) are read, not transposed
            block = sp.csr_matrix(v[label_set], dtype=np.float64) @ sp.csr_matrix(x[doc_set], dtype=np.float64).T
            out[lo:hi] = block.toarray()[label_at, doc_at]
        elif hi - lo >= 2 * SPLIT_MIN and cells <= (hi - lo) / BLOCK_FILL * SPLIT_SPAN:
            parts += [(lo, (lo + hi) // 2), ((lo + hi) // 2, hi)]
        else:
            if v_keys is None:
                v_keys = np.repeat(np.arange(v.shape[0], dtype=np.int64), np.diff(v.indptr)) * x.shape[1] + v.indices
            out[lo:hi] = _looked_up_dots(x[docs[lo:hi]], labels[lo:hi], v, v_keys)
    return out


def _looked_up_dots(rows: sp.csr_matrix, labels: np.ndarray, v: sp.csr_matrix, v_keys: np.ndarray) -> np.ndarray:
    """<rows[i], v[labels[i]]>: each of the rows' nonzeros looked up in v by the key row * F +
    column (v_keys, sorted)."""
    if not len(v_keys):
        return np.zeros(rows.shape[0], np.float64)
    keys = np.repeat(labels, np.diff(rows.indptr)) * rows.shape[1] + rows.indices
    at = np.minimum(np.searchsorted(v_keys, keys), len(v_keys) - 1)
    products = np.where(v_keys[at] == keys, v.data[at].astype(np.float64), 0.0) * rows.data
    entry_row = np.repeat(np.arange(rows.shape[0]), np.diff(rows.indptr))
    return np.bincount(entry_row, weights=products, minlength=rows.shape[0])


def runs(sizes: np.ndarray, chunk: int) -> Iterator[tuple[int, int]]:
    """Consecutive [lo, hi) of items whose sizes add up to at most chunk (an item larger alone)."""
    ends = np.r_[0, np.cumsum(sizes)]
    lo = 0
    while lo < len(sizes):
        hi = max(lo + 1, int(np.searchsorted(ends, ends[lo] + chunk, side="right")) - 1)
        yield lo, hi
        lo = hi


def row_norms(m: Features) -> np.ndarray:
    if isinstance(m, np.ndarray):
        return np.linalg.norm(m, axis=1)
    return np.sqrt(np.asarray(m.multiply(m).sum(axis=1)).ravel())


def normalize_rows(m: Features) -> Features:
    """Rows scaled to unit norm (zero rows stay zero)."""
    norms = row_norms(m)
    scale = np.where(norms > 0, 1.0 / np.maximum(norms, 1e-30), 0.0).astype(np.float32)
    if isinstance(m, np.ndarray):
        return (m * scale[:, None]).astype(np.float32)
    return sp.csr_matrix(sp.diags(scale) @ m, dtype=np.float32)
