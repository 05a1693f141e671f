"""Per-document labels imputed from group labels: EAGLE (Shen, Yu, Sanghavi, Dhillon, ICML 2020).

Algorithm 1 (GROUP_ROBUST_LABEL_REPR): a label's vector starts at the normalised sum of the
members of the groups that carry it; then T times, in each of those groups the member closest
to the vector is picked, and the vector moves towards the normalised sum of the picks with step
lambda and is renormalised. Members that do not have the label pull less and less: the vector
settles on what the label's true members share.
Algorithm 2: each (group, label) pair goes to the group's member closest to the label's vector.

Features are rows of a matrix fixed before training: sparse TF-IDF (the first round) or the
trained encoder's embeddings (a second round). Everything is vectorised over the (group,
label) pairs: scores of every pair's members in one pass (sparse lookups or chunked dense
products), picks by one sort, updates by one sparse product.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

Features = sp.csr_matrix | np.ndarray
# Algorithm 2 as in the paper ("closest"), or beyond it ("expected"): see EagleImputer.impute.
ASSIGNMENTS = ("closest", "expected")
_DENSE_CHUNK = 1 << 16


class EagleImputer:
    """fit(features [N, F], members [G, N], group_labels [G, L]) -> label_vectors_ [L, F];
    impute() -> per-document label ids (Algorithm 2).

    iterations (T) and step (lambda): Algorithm 1's. seed: the start of a label whose initial
    sum is zero (its groups' members cancel out, as in the paper's +x / -x example): then a
    member of one of its groups drawn with this seed.
    """

    def __init__(self, iterations: int = 10, step: float = 0.5, seed: int = 0, assignment: str = "expected") -> None:
        if iterations < 0:
            raise ValueError(f"iterations must be >= 0, got {iterations}")
        if not 0.0 < step <= 1.0:
            raise ValueError(f"step must be in (0, 1], got {step}")
        if assignment not in ASSIGNMENTS:
            raise ValueError(f"assignment must be one of {ASSIGNMENTS}, got {assignment!r}")
        self.iterations = int(iterations)
        self.step = float(step)
        self.seed = int(seed)
        self.assignment = assignment

    def fit(self, features: Features, members: sp.csr_matrix, group_labels: sp.csr_matrix) -> EagleImputer:
        x = _normalize(features)
        members, group_labels = sp.csr_matrix(members), sp.csr_matrix(group_labels)
        self.pair_group_, self.pair_label_ = _pairs(group_labels)
        self.pair_members_ = _pair_members(members, self.pair_group_)
        v = _normalize(_as_features(sp.csr_matrix(group_labels.T) @ members @ x, x))
        v = self._seed_empty(v, x, members, group_labels)
        for _ in range(self.iterations):
            picks, _ = self._closest(x, v)
            u = _normalize(_as_features(_label_by_doc(self.pair_label_, picks, v.shape[0], x.shape[0]) @ x, x))
            v = _normalize(_as_features((1.0 - self.step) * v + self.step * u, x))
        self.label_vectors_ = v
        self._features, self._members = x, members
        return self

    def impute(self) -> list[list[int]]:
        """Each document's labels: every (group, label) pair given to the group's closest member
        ("closest", the paper's Algorithm 2), or to as many of its closest members as a group
        holding the label is expected to have ("expected")."""
        counts = self._expected_counts() if self.assignment == "expected" else None
        picks, labels = self._closest(self._features, self.label_vectors_, counts)
        n = self._features.shape[0]
        assigned = sp.csr_matrix((np.ones(len(picks), np.float32), (picks, labels)),
                                 shape=(n, self.label_vectors_.shape[0]))
        assigned.sum_duplicates()
        return [assigned.indices[assigned.indptr[i] : assigned.indptr[i + 1]].tolist() for i in range(n)]

    def _closest(self, x: Features, v: Features, counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per pair, the member of its group with the largest inner product with its label's vector
        (the first such member on ties), or its `counts[pair]` closest: (documents, their labels)."""
        starts, docs = self.pair_members_
        pair_of = np.repeat(np.arange(len(self.pair_label_)), np.diff(starts))
        scores = _row_dots(x, docs, v, self.pair_label_[pair_of])
        order = np.lexsort((np.arange(len(docs)), -scores, pair_of))
        rank = np.arange(len(order)) - starts[pair_of[order]]  # 0 = the pair's closest member
        keep = rank < (1 if counts is None else counts[pair_of[order]])
        return docs[order[keep]], self.pair_label_[pair_of[order[keep]]]

    def _expected_counts(self) -> np.ndarray:
        """Per pair, how many members of a group of its size hold its label, given that one does:
        E[n | n >= 1] = s p / (1 - (1 - p)^s), with p the label's per-document rate estimated from
        the share f of groups carrying it (f = 1 - (1 - p)^s at the mean group size). Group-level
        statistics only: the setting has no per-document labels to tune on."""
        group_sizes = np.diff(self._members.indptr).astype(np.float64)
        share = np.bincount(self.pair_label_, minlength=self.label_vectors_.shape[0]) / len(group_sizes)
        p = 1.0 - (1.0 - np.minimum(share, 1.0 - 1e-9)) ** (1.0 / group_sizes.mean())
        sizes, p_pair = group_sizes[self.pair_group_], p[self.pair_label_]
        expected = sizes * p_pair / (1.0 - (1.0 - p_pair) ** sizes)
        return np.clip(np.rint(expected), 1, sizes).astype(np.int64)

    def _seed_empty(self, v: Features, x: Features, members: sp.csr_matrix, group_labels: sp.csr_matrix) -> Features:
        norms = _row_norms(v)
        empty = np.flatnonzero((norms < 1e-12) & (np.diff(sp.csc_matrix(group_labels).indptr) > 0))
        if not len(empty):
            return v
        rng = np.random.default_rng(self.seed)
        starts, docs = self.pair_members_
        chosen = []
        for label in empty:  # rare (members that cancel out exactly): a loop is fine
            pairs = np.flatnonzero(self.pair_label_ == label)
            pair = pairs[rng.integers(len(pairs))]
            chosen.append(docs[starts[pair] + rng.integers(starts[pair + 1] - starts[pair])])
        fix = _label_by_doc(empty, np.asarray(chosen), v.shape[0], x.shape[0]) @ x
        keep = np.ones(v.shape[0], np.float32)
        keep[empty] = 0.0
        return _normalize(_as_features(sp.diags(keep) @ v + fix, x))


def _pairs(group_labels: sp.csr_matrix) -> tuple[np.ndarray, np.ndarray]:
    """(group, label) of every nonzero of the group x label matrix, grouped by group."""
    coo = group_labels.tocoo()
    order = np.lexsort((coo.col, coo.row))
    return coo.row[order].astype(np.int64), coo.col[order].astype(np.int64)


def _pair_members(members: sp.csr_matrix, pair_group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR-like (starts [P + 1], docs) of each pair's group members."""
    sizes = np.diff(members.indptr)[pair_group]
    starts = np.r_[0, np.cumsum(sizes)]
    offsets = np.arange(int(starts[-1])) - np.repeat(starts[:-1], sizes)
    docs = members.indices[np.repeat(members.indptr[pair_group], sizes) + offsets].astype(np.int64)
    return starts, docs


def _label_by_doc(labels: np.ndarray, docs: np.ndarray, num_labels: int, num_docs: int) -> sp.csr_matrix:
    return sp.csr_matrix((np.ones(len(docs), np.float32), (labels, docs)), shape=(num_labels, num_docs))


def _row_dots(x: Features, docs: np.ndarray, v: Features, labels: np.ndarray) -> np.ndarray:
    """<x[docs[i]], v[labels[i]]> for every i."""
    if isinstance(x, np.ndarray):
        out = np.empty(len(docs), np.float32)
        for s in range(0, len(docs), _DENSE_CHUNK):
            e = s + _DENSE_CHUNK
            out[s:e] = np.einsum("ij,ij->i", x[docs[s:e]], v[labels[s:e]])
        return out
    # Sparse: look each of x's nonzeros up in v by the key row * F + column (v's keys are sorted).
    rows = x[docs]
    width = x.shape[1]
    keys = np.repeat(labels, np.diff(rows.indptr)) * width + rows.indices
    v = sp.csr_matrix(v)
    v.sort_indices()
    v_keys = np.repeat(np.arange(v.shape[0], dtype=np.int64), np.diff(v.indptr)) * width + v.indices
    at = np.minimum(np.searchsorted(v_keys, keys), max(0, len(v_keys) - 1))
    hit = v_keys[at] == keys if len(v_keys) else np.zeros(len(keys), bool)
    products = np.where(hit, v.data[at] if len(v_keys) else 0.0, 0.0) * rows.data
    entry_row = np.repeat(np.arange(len(docs)), np.diff(rows.indptr))
    return np.bincount(entry_row, weights=products, minlength=len(docs)).astype(np.float32)


def _as_features(m: Features, like: Features) -> Features:
    if isinstance(like, np.ndarray):
        return np.asarray(m.todense() if sp.issparse(m) else m, dtype=np.float32)
    return sp.csr_matrix(m, dtype=np.float32)


def _row_norms(m: Features) -> np.ndarray:
    if isinstance(m, np.ndarray):
        return np.linalg.norm(m, axis=1)
    return np.sqrt(np.asarray(m.multiply(m).sum(axis=1)).ravel())


def _normalize(m: Features) -> Features:
    """Rows scaled to unit norm (zero rows stay zero)."""
    norms = _row_norms(m)
    scale = np.where(norms > 0, 1.0 / np.maximum(norms, 1e-30), 0.0).astype(np.float32)
    if isinstance(m, np.ndarray):
        return (m * scale[:, None]).astype(np.float32)
    return sp.csr_matrix(sp.diags(scale) @ m, dtype=np.float32)
