"""The auxiliary model p_n(y|x) of adversarial negative sampling (Bamler & Mandt, ICLR 2020).

A balanced probabilistic binary tree over the labels, each internal node a logistic split
sigmoid(w . z + b) on a PCA projection z of the document embedding. The tree layout (heap
order, padding leaves, forced splits) is the one read by service.engine.tree.TreeScorer,
which also computes log p_n at inference; this module fits the nodes and samples from p_n.

Fitting is top-down, one level at a time, all nodes of a level vectorised together:
  1. initial split of a node's labels at the median of their projection onto the dominant
     eigenvector of the covariance (over the node's labels) of the per-label summed features;
  2. alternate Newton steps on each node's L2-regularised log-likelihood (strength lambda_n)
     with the balanced re-assignment of labels: label y gains
        Delta_y = sum_{x tagged y} [log sigmoid(s(x)) - log sigmoid(-s(x))] = sum_{x tagged y} s(x)
     by going left, so the ceil(n/2) labels of largest Delta_y go left and the rest right;
     repeat until no label moves (or max_rounds).
Balance: a node over 2^h leaves holding n labels, 2^(h-1) <= n <= 2^h, gives ceil(n/2) and
floor(n/2) to its children, so padding leaves only appear as the right sibling of a real leaf
at the bottom level, and every real label is reachable.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp
from threadpoolctl import threadpool_limits

from service.engine.tree import NODE_LEXICAL, forced_split_bias, log_sigmoid, sample_leaves
from service.engine.tree_lexical import NodeLexical, QueryTokens, Tokens

# A level's Newton step solves its nodes' Hessians this many at a time, and its scores take the
# rows' node weights this many rows at a time: whole, the deepest level of a 10^6-label tree held
# [2^19 nodes, 17^2] float64 Hessians several times over (a buffer, np.take's copy, solve's
# copy) and a [5 * 10^6 rows, 16] float64 gather: the p_n fit peaked at 13.7 GB, 5.5 GB above the
# stages around it (bench/RESULTS.md, issue 24). In blocks, the same values.
_NODES_AT_ONCE = 1 << 15
_ROWS_AT_ONCE = 1 << 18


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(log_sigmoid(x))


def flatten_pairs(targets: Sequence[Sequence[int]], num_labels: int) -> tuple[np.ndarray, np.ndarray]:
    """(doc index, label) for every positive pair, by document then label (duplicates within a
    document dropped)."""
    lengths = np.fromiter((len(t) for t in targets), dtype=np.int64, count=len(targets))
    labels = np.fromiter(itertools.chain.from_iterable(targets), dtype=np.int64, count=int(lengths.sum()))
    docs = np.repeat(np.arange(len(targets), dtype=np.int64), lengths)
    bad = np.flatnonzero((labels < 0) | (labels >= num_labels))
    if len(bad):
        i = bad[0]
        raise ValueError(f"targets[{docs[i]}] holds label {labels[i]}, outside 0..{num_labels - 1}")
    keys = np.unique(docs * num_labels + labels)
    return keys // num_labels, keys % num_labels


def pair_weights(targets: Sequence[Sequence[int]], weights: Sequence[Sequence[float]], num_labels: int
                 ) -> np.ndarray:
    """float64 per flatten_pairs pair: its target's weight (a duplicate's largest)."""
    pair_doc, pair_label = flatten_pairs(targets, num_labels)
    lengths = np.fromiter((len(t) for t in targets), dtype=np.int64, count=len(targets))
    if any(len(w) != n for w, n in zip(weights, lengths, strict=True)):
        raise ValueError("target weights must have one weight per target")
    keys = (np.repeat(np.arange(len(targets), dtype=np.int64), lengths) * num_labels
            + np.fromiter(itertools.chain.from_iterable(targets), dtype=np.int64, count=int(lengths.sum())))
    out = np.zeros(len(pair_doc))
    np.maximum.at(out, np.searchsorted(pair_doc * num_labels + pair_label, keys),
                  np.fromiter(itertools.chain.from_iterable(weights), dtype=np.float64, count=len(keys)))
    return out


def sample_targets(targets: Sequence[Sequence[int]], weights: Sequence[Sequence[float]] | None,
                   seed: int) -> Sequence[Sequence[int]]:
    """Each target kept with probability its weight (one seeded draw; weight 1: always): hard
    labels drawn from soft ones, for the fits that take whole positives."""
    if weights is None:
        return targets
    rng = np.random.default_rng(seed)
    out = []
    for ts, ws in zip(targets, weights, strict=True):
        draws = rng.random(len(ts))
        out.append([t for t, w, draw in zip(ts, ws, draws, strict=True) if draw < w])
    return out


def fit_pca(x: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and whitened projection [dim, D] (z = P (x - m) has unit variance per component)."""
    x = np.asarray(x, dtype=np.float32)
    mean = x.mean(axis=0, dtype=np.float64)
    # float32 products (4x faster than np.cov in float64 on 40k x 256; relative error ~1e-6,
    # far below what moves a projection), eigen-decomposition in float64.
    centred = x - mean.astype(np.float32)
    cov = (centred.T @ centred).astype(np.float64) / (len(x) - 1) if len(x) > 1 else np.eye(x.shape[1])
    eigval, eigvec = np.linalg.eigh(np.atleast_2d(cov))
    order = np.argsort(eigval)[::-1][:dim]
    # Whitening makes lambda_n act the same on every direction; floor keeps dead directions finite.
    scale = 1.0 / np.sqrt(np.maximum(eigval[order], 1e-6))
    components = (eigvec[:, order] * scale).T
    if components.shape[0] < dim:  # D < pca_dim: pad with zero rows so shapes stay fixed
        components = np.vstack([components, np.zeros((dim - components.shape[0], x.shape[1]))])
    # Fix the sign of each component so the fit is deterministic across LAPACK builds.
    signs = np.sign(components[np.arange(dim), np.abs(components).argmax(axis=1)])
    components *= np.where(signs == 0, 1.0, signs)[:, None]
    return mean.astype(np.float32), components.astype(np.float32)


def _segment_matrix(indptr: np.ndarray, columns: np.ndarray, data: np.ndarray, num_columns: int) -> sp.csr_matrix:
    """Sparse [segments, num_columns] matrix whose product with a [num_columns, m] array sums
    the rows of each segment, weighted by data. A CSR product is one pass over the rows with no
    temporary, which is many times faster than np.add.reduceat once segments are small and many.
    """
    return sp.csr_matrix((data, columns, indptr), shape=(len(indptr) - 1, num_columns))


class _LevelData:
    """The positive pairs under one level's fitted nodes, as one row per distinct (node, document).

    The pairs of one document under one node share the node logit s, so the node's
    log-likelihood only needs each (node, doc) row with its count of pairs and how many of
    them go left: 2x fewer rows than pairs on debian-deps (5x at the root). Rows are sorted by
    node, so every node's gradient and Hessian is a segment sum over its rows (a sparse product,
    see _segment_matrix); the rows' upper-triangular feature products stay fixed while the level
    is fitted, only the curvature weights change. Only the fitted nodes (two labels or more)
    appear: a one-label node's split is forced and its weights are discarded.
    """

    def __init__(
        self,
        z: np.ndarray,
        pair_doc: np.ndarray,
        pair_node: np.ndarray,
        fitted: np.ndarray,
        n_nodes: int,
        products_buffer: np.ndarray,
    ) -> None:
        num_docs, k = z.shape
        keys, self.row_of_pair, count = np.unique(
            pair_node * num_docs + pair_doc, return_inverse=True, return_counts=True
        )
        self.node = keys // num_docs
        self.count = count.astype(np.float64)
        self.num_rows = len(keys)
        self.fitted = fitted
        self.indptr = np.searchsorted(self.node, np.r_[fitted, n_nodes])
        # Each Newton step's Hessians [a block of fitted nodes, (k+1)^2], allocated once per level.
        self.hessian_buffer = np.empty((min(len(fitted), _NODES_AT_ONCE), (k + 1) ** 2))
        self.x1 = np.empty((self.num_rows, k + 1), np.float32)
        self.x1[:, :k] = z[keys - self.node * num_docs]
        self.x1[:, k] = 1.0
        # Upper triangle of every row's outer product, in np.triu_indices order, into a buffer
        # reused across levels (fresh pages cost more than the arithmetic). Built transposed in
        # blocks that stay in cache: products of contiguous feature rows, 2x faster than strided.
        self.products = products_buffer[: self.num_rows]
        block = np.empty((self.products.shape[1], 2048), np.float32)
        for start in range(0, self.num_rows, 2048):
            xt = np.ascontiguousarray(self.x1[start : start + 2048].T)
            out = block[:, : xt.shape[1]]
            col = 0
            for r in range(k + 1):
                np.multiply(xt[r], xt[r:], out=out[col : col + k + 1 - r])
                col += k + 1 - r
            self.products[start : start + xt.shape[1]] = out.T

    def scores(self, w: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Node logit of every row."""
        out = np.empty(self.num_rows)
        for start in range(0, self.num_rows, _ROWS_AT_ONCE):
            rows = slice(start, start + _ROWS_AT_ONCE)
            node = self.node[rows]
            z = self.x1[rows, :-1].astype(np.float64)  # in blocks: no [rows, k] float64 copy kept
            out[rows] = np.einsum("ij,ij->i", z, w[node]) + b[node]
        return out

    def fitted_sum(self, values: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """[fitted nodes, m] float32: per node, the sum over its rows of weights * values
        (values [rows, m] float32)."""
        seg = _segment_matrix(self.indptr, np.arange(self.num_rows), weights.astype(np.float32), self.num_rows)
        return np.asarray(seg @ values)


def _symmetric_index(k: int) -> np.ndarray:
    """[k * k] column of each (i, j) entry in the np.triu_indices(k) packing of a symmetric matrix."""
    rows, cols = np.triu_indices(k)
    index = np.empty((k, k), dtype=np.int64)
    index[rows, cols] = index[cols, rows] = np.arange(len(rows))
    return index.ravel()


def _group_rows(group: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(indptr, member indices sorted by group) of the items of each group, for _segment_matrix."""
    order = np.argsort(group, kind="stable")
    return np.searchsorted(group[order], np.arange(num_groups + 1)), order


def _rank_within(group: np.ndarray, key: np.ndarray, tiebreak_order: np.ndarray) -> np.ndarray:
    """Rank of each item within its group by descending key, ties in tiebreak_order's order
    (items sorted by ascending tiebreak). Two stable argsorts: faster than a 3-key lexsort."""
    order = tiebreak_order[np.argsort(-key[tiebreak_order], kind="stable")]
    order = order[np.argsort(group[order], kind="stable")]
    sorted_group = group[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_group)) + 1]
    counts = np.diff(np.r_[starts, len(order)])
    rank_sorted = np.arange(len(order)) - np.repeat(starts, counts)
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = rank_sorted
    return rank


class LabelTree:
    """Balanced probabilistic binary label tree p_n(y|x), sklearn-style.

    Hyper-parameters: pca_dim (k), lambda_n (L2 strength of each node's logistic fit),
    newton_steps per round, max_rounds of Newton + re-assignment per level, seed.
    After fit(): pca_mean_, pca_components_, node_weights_, node_bias_, leaf_labels_;
    node_lexical_ (None until set_node_lexical: training/tree_node_lexical.py fits it).
    """

    def __init__(
        self,
        pca_dim: int = 16,
        lambda_n: float = 1.0,
        newton_steps: int = 1,
        max_rounds: int = 3,
        seed: int = 0,
    ) -> None:
        self.pca_dim = pca_dim
        self.lambda_n = lambda_n
        self.newton_steps = newton_steps
        self.max_rounds = max_rounds
        self.seed = seed

    # --- fitting ---------------------------------------------------------------------
    def fit(self, embeddings: np.ndarray, targets: Sequence[Sequence[int]], num_labels: int) -> LabelTree:
        x = np.asarray(embeddings, dtype=np.float32)
        if x.ndim != 2 or len(x) != len(targets):
            raise ValueError(f"embeddings must be [N, D] with N = len(targets) = {len(targets)}, got {x.shape}")
        if num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {num_labels}")
        if self.pca_dim < 1 or self.lambda_n <= 0:
            raise ValueError("pca_dim must be >= 1 and lambda_n > 0")
        pair_doc, pair_label = flatten_pairs(targets, num_labels)
        # One BLAS thread: the fit's BLAS work is small (PCA), and threaded OpenBLAS busy-waits
        # when the cores are shared: the PCA took 0.05 s alone, 0.2 s next to one busy process
        # and up to 1.8 s next to two on the 2-core machine, against 0.06-0.09 s single-threaded.
        with threadpool_limits(limits=1, user_api="blas"):
            self.pca_mean_, self.pca_components_ = fit_pca(x, self.pca_dim)
            z = (x - self.pca_mean_) @ self.pca_components_.T
            self._fit_nodes(z.astype(np.float32), pair_doc, pair_label, num_labels)
        return self

    def _fit_nodes(self, z: np.ndarray, pair_doc: np.ndarray, pair_label: np.ndarray, num_labels: int) -> None:
        k = z.shape[1]
        depth = max(1, int(np.ceil(np.log2(num_labels))))
        num_leaves = 1 << depth
        weights = np.zeros((num_leaves - 1, k))
        bias = np.zeros(num_leaves - 1)
        # Per-label summed features: what the initial split projects.
        indptr, pairs_by_label = _group_rows(pair_label, num_labels)
        label_sum = np.asarray(
            _segment_matrix(indptr, pair_doc[pairs_by_label], np.ones(len(pair_label)), len(z)) @ z.astype(np.float64)
        )
        products_buffer = np.empty((len(pair_doc), (k + 1) * (k + 2) // 2), np.float32)
        rng = np.random.default_rng(self.seed)
        # Random tie-break so labels without documents spread evenly instead of by id.
        tiebreak_order = np.argsort(rng.permutation(num_labels))
        position = np.zeros(num_labels, dtype=np.int64)  # node of each label at the current level
        self.rounds_per_level_: list[int] = []
        for level in range(depth):
            first = (1 << level) - 1
            local = position - first  # node index within the level
            n_nodes = 1 << level
            counts = np.bincount(local, minlength=n_nodes)
            n_left = (counts + 1) // 2
            learn = counts >= 2  # one label: the split is forced (its sibling is padding)
            w, b = self._initial_split(label_sum, local, learn)
            projection = (label_sum * w[local]).sum(1)
            go_left = _rank_within(local, projection, tiebreak_order) < n_left[local]
            # Only nodes with two labels or more are fitted: a one-label node sends it left.
            fitted = np.flatnonzero(learn)
            pair_node = local[pair_label]
            fit_doc, fit_label = pair_doc, pair_label
            if len(fitted) < n_nodes:
                keep = learn[pair_node]
                fit_doc, fit_label, pair_node = pair_doc[keep], pair_label[keep], pair_node[keep]
            data = _LevelData(z, fit_doc, pair_node, fitted, n_nodes, products_buffer)
            rounds = 0
            scores = data.scores(w, b)
            for rounds in range(1, self.max_rounds + 1):  # noqa: B007 (reported below)
                for _ in range(self.newton_steps):
                    w, b = self._newton(w, b, scores, data, go_left[fit_label])
                    scores = data.scores(w, b)
                # Delta_y of labels under one-label nodes stays 0: their rank is 0 whatever it is.
                delta = np.bincount(fit_label, weights=scores[data.row_of_pair], minlength=num_labels)
                new_left = _rank_within(local, delta, tiebreak_order) < n_left[local]
                moved = int((new_left != go_left).sum())
                go_left = new_left
                if moved == 0:
                    break
            else:
                for step in range(self.newton_steps):
                    w, b = self._newton(w, b, scores, data, go_left[fit_label])
                    if step + 1 < self.newton_steps:
                        scores = data.scores(w, b)
            self.rounds_per_level_.append(rounds)
            w[~learn] = 0.0
            b[~learn] = 0.0
            weights[first : first + n_nodes] = w
            bias[first : first + n_nodes] = b
            position = 2 * position + np.where(go_left, 1, 2)
            del data, scores  # before the next level's rows are built: one level's at a time
        leaf_labels = np.full(num_leaves, -1, dtype=np.int64)
        leaf_labels[position - (num_leaves - 1)] = np.arange(num_labels)
        self.node_weights_ = weights.astype(np.float32)
        self.node_bias_ = bias.astype(np.float32)
        self.leaf_labels_ = leaf_labels
        self._finish()

    def _initial_split(
        self, label_sum: np.ndarray, local: np.ndarray, learn: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Dominant eigenvector of each node's covariance of per-label summed features (zero
        where the node has one label: its split is forced)."""
        k = label_sum.shape[1]
        fitted = np.flatnonzero(learn)
        w = np.zeros((len(learn), k))
        if not len(fitted):
            return w, np.zeros(len(learn))
        is_fitted = learn[local]
        indptr, members = _group_rows(np.searchsorted(fitted, local[is_fitted]), len(fitted))
        members = np.flatnonzero(is_fitted)[members]
        counts = np.diff(indptr)
        mean = np.asarray(_segment_matrix(indptr, members, np.ones(len(members)), len(local)) @ label_sum)
        mean /= counts[:, None]
        # The balanced split keeps the label counts of one level within 1 of each other, so the
        # nodes' centred label sums A pad into one [nodes, size, k] array at little cost.
        size = int(counts.max())
        node = np.repeat(np.arange(len(counts)), counts)
        centred = np.zeros((len(counts), size, k))
        centred[node, np.arange(len(members)) - indptr[node]] = label_sum[members] - mean[node]
        if size >= k:
            u = np.linalg.eigh(centred.transpose(0, 2, 1) @ centred)[1][:, :, -1]  # covariance * n
        else:
            # Fewer labels than dimensions (deep levels): the dominant eigenvector of A^T A is
            # A^T v for the dominant eigenvector v of the small Gram matrix A A^T: eigh on
            # [size, size] instead of [k, k] (2x2 at the last level), the same direction.
            v = np.linalg.eigh(centred @ centred.transpose(0, 2, 1))[1][:, :, -1]
            u = np.einsum("nsk,ns->nk", centred, v)
            norm = np.linalg.norm(u, axis=1)
            # All the node's labels alike (zero covariance): eigh's answer for a zero matrix.
            u[norm == 0, k - 1] = 1.0
            u /= np.where(norm == 0, 1.0, norm)[:, None]
        # Orient so the larger-magnitude end is deterministic.
        sign = np.sign(u[np.arange(len(u)), np.abs(u).argmax(1)])
        u *= np.where(sign == 0, 1.0, sign)[:, None]
        w[fitted] = u
        # Start the node logit centred on its labels' mean projection.
        return w, np.zeros(len(learn))

    def _newton(
        self, w: np.ndarray, b: np.ndarray, scores: np.ndarray, level: _LevelData, pair_left: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """One Newton step on every fitted node of the level at once (L2 strength lambda_n on w and
        b), from the rows' current scores = level.scores(w, b)."""
        k = w.shape[1]
        p = _sigmoid(scores)
        n_left = np.bincount(level.row_of_pair, weights=pair_left, minlength=level.num_rows)
        resid = level.count * p - n_left  # d(-log-lik)/ds summed over the row's pairs (target 1 = left)
        curv = level.count * np.maximum(p * (1.0 - p), 1e-10)
        theta = np.concatenate([w, b[:, None]], axis=1)
        fitted = level.fitted
        grad = level.fitted_sum(level.x1, resid) + self.lambda_n * theta[fitted]
        products = level.fitted_sum(level.products, curv)  # upper triangles, [fitted nodes, m]
        square = _symmetric_index(k + 1)
        for start in range(0, len(fitted), _NODES_AT_ONCE):
            block = slice(start, start + _NODES_AT_ONCE)
            hess = level.hessian_buffer[: len(fitted[block])]
            hess[...] = np.take(products[block], square, axis=1)
            hess[:, :: k + 2] += self.lambda_n  # the diagonal
            step = np.linalg.solve(hess.reshape(-1, k + 1, k + 1), grad[block, :, None])[:, :, 0]
            theta[fitted[block]] -= step
        return theta[:, :k], theta[:, k]

    def _finish(self) -> None:
        num_leaves = len(self.leaf_labels_)
        self.depth_ = num_leaves.bit_length() - 1
        self.bias_eff_ = self.node_bias_.astype(np.float64) + forced_split_bias(self.leaf_labels_)
        # Path of every label: heap nodes from the root and the direction taken (+1 left, -1 right).
        num_labels = int((self.leaf_labels_ >= 0).sum())
        heap = np.empty(num_labels, dtype=np.int64)
        real = np.flatnonzero(self.leaf_labels_ >= 0)
        heap[self.leaf_labels_[real]] = real + num_leaves - 1
        nodes = np.empty((num_labels, self.depth_), dtype=np.int64)
        signs = np.empty((num_labels, self.depth_))
        cur = heap
        for d in range(self.depth_ - 1, -1, -1):
            parent = (cur - 1) // 2
            nodes[:, d] = parent
            signs[:, d] = np.where(cur == 2 * parent + 1, 1.0, -1.0)
            cur = parent
        self.path_nodes_, self.path_signs_ = nodes, signs
        self.node_lexical_: NodeLexical | None = None

    def set_node_lexical(self, table: np.ndarray) -> None:
        """p_n's lexical node term (service.engine.tree_lexical.NodeLexical) from its table."""
        self.node_lexical_ = NodeLexical(table)

    def _query(self, tokens: Tokens | None) -> QueryTokens | None:
        """The documents' tokens as the lexical node term reads them (None without the term)."""
        if self.node_lexical_ is None:
            return None
        return self.node_lexical_.prepare(_without_padding(_tokens_needed(tokens)))

    def _node_scores(self, nodes: np.ndarray, z: np.ndarray, query: QueryTokens | None) -> np.ndarray:
        """Node logits [B, n] of nodes [B, n] for projected inputs z [B, k] (float64) and, with
        the lexical node term, their tokens (_query)."""
        s = np.einsum("bnk,bk->bn", self.node_weights_[nodes].astype(np.float64), z) + self.bias_eff_[nodes]
        if query is not None:
            assert self.node_lexical_ is not None
            s += self.node_lexical_.scores(nodes, query)
        return s

    # --- using the fitted tree -------------------------------------------------------
    def project(self, embeddings: np.ndarray) -> np.ndarray:
        return (np.asarray(embeddings, dtype=np.float32) - self.pca_mean_) @ self.pca_components_.T

    def log_prob(self, z: np.ndarray, labels: np.ndarray, tokens: Tokens | None = None,
                 block_bytes: int = 1 << 26) -> np.ndarray:
        """log p_n(labels[b, j] | x_b) for projected inputs z [B, k] and labels [B, J] (and x_b's
        tokens [B, T] with the lexical node term).

        In blocks of rows: the gathered node weights are [B, J, depth, k] float64, 13 GB for the
        5 * 10^6 positive pairs of a 10^6-label training if taken at once (it was what stopped one)."""
        labels = np.asarray(labels)
        width = 0 if tokens is None else tokens[0].shape[1]
        row_bytes = max(1, labels.shape[1] * self.depth_ * (self.node_weights_.shape[1] + 4 + 2 * width) * 8)
        step = max(1, block_bytes // row_bytes)
        out = np.empty(labels.shape, np.float64)
        for begin in range(0, len(labels), step):
            rows = slice(begin, begin + step)
            zb = np.asarray(z[rows], dtype=np.float64)
            nodes = self.path_nodes_[labels[rows]]  # [b, J, depth]
            query = self._query(None if tokens is None else (tokens[0][rows], tokens[1][rows]))
            s = self._node_scores(nodes.reshape(len(zb), -1), zb, query).reshape(nodes.shape)
            out[rows] = log_sigmoid(self.path_signs_[labels[rows]] * s).sum(-1)
        return out

    def sample(self, z: np.ndarray, num_samples: int, rng: np.random.Generator,
               tokens: Tokens | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Ancestral sampling y ~ p_n(.|x): (labels [B, S], log p_n [B, S]); O(k log L) each
        (tokens: x's [B, T], with the lexical node term)."""
        # One uniform a sample at each level, in the order the numpy sampler before the compiled
        # one drew them (level by level); that sampler's per-level arrays were a third of an
        # adversarial xi fit (bench/RESULTS.md, "xi's negatives drawn from p_n in compiled code").
        draws = rng.random((self.depth_, len(z), num_samples))
        query = None if self.node_lexical_ is None else _without_padding(_tokens_needed(tokens))
        nodes, logp = sample_leaves(self.node_weights_, self.bias_eff_, self.node_lexical_, self.depth_,
                                    z, query, draws)
        return self.leaf_labels_[nodes - (len(self.leaf_labels_) - 1)], logp

    def arrays(self) -> dict[str, np.ndarray]:
        """The tree part of the TreeScorer arrays."""
        lexical = {} if self.node_lexical_ is None else {NODE_LEXICAL: self.node_lexical_.table}
        return {
            **lexical,
            "pca_mean": self.pca_mean_,
            "pca_components": self.pca_components_,
            "node_weights": self.node_weights_,
            "node_bias": self.node_bias_,
            "leaf_labels": self.leaf_labels_,
        }


def _tokens_needed(tokens: Tokens | None) -> Tokens:
    if tokens is None:
        raise ValueError("this tree's node logits read the documents' tokens: pass tokens=(ids, weights)")
    return tokens


def _without_padding(tokens: Tokens) -> Tokens:
    """The token columns some row uses (weight != 0): documents padded to the longest one's
    length (37 tokens on debian-deps, 6.6 on average) need not pay for it."""
    ids, weights = np.asarray(tokens[0]), np.asarray(tokens[1])
    used = np.flatnonzero((weights != 0).any(axis=0))
    if len(used) == weights.shape[1]:
        return ids, weights
    return ids[:, used], weights[:, used]
