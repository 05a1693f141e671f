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

from collections.abc import Sequence

import numpy as np

from service.engine.tree import forced_split_bias, log_sigmoid


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(log_sigmoid(x))


def flatten_pairs(targets: Sequence[Sequence[int]], num_labels: int) -> tuple[np.ndarray, np.ndarray]:
    """(doc index, label) for every positive pair (duplicates within a document dropped)."""
    docs: list[int] = []
    labels: list[int] = []
    for i, t in enumerate(targets):
        for y in sorted(set(int(v) for v in t)):
            if not 0 <= y < num_labels:
                raise ValueError(f"targets[{i}] holds label {y}, outside 0..{num_labels - 1}")
            docs.append(i)
            labels.append(y)
    return np.asarray(docs, dtype=np.int64), np.asarray(labels, dtype=np.int64)


def fit_pca(x: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and whitened projection [dim, D] (z = P (x - m) has unit variance per component)."""
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=0)
    cov = np.cov(x - mean, rowvar=False) if len(x) > 1 else np.eye(x.shape[1])
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


class _LevelData:
    """The positive pairs of one tree level, sorted by node, for the vectorised Newton step.

    Every node's gradient and Hessian is a segment sum over its pairs (np.add.reduceat on the
    node-sorted pairs); the pairs' upper-triangular feature products stay fixed while the
    level is fitted, only the curvature weights change.
    """

    def __init__(self, zp: np.ndarray, node: np.ndarray, n_nodes: int) -> None:
        self.order = np.argsort(node, kind="stable")
        self.node = node[self.order]
        self.zp = zp[self.order].astype(np.float32)
        self.n_nodes = n_nodes
        self.x1 = np.concatenate([self.zp, np.ones((len(zp), 1), np.float32)], axis=1)
        rows, cols = np.triu_indices(self.x1.shape[1])
        self.products = self.x1[:, rows] * self.x1[:, cols]
        self.starts = np.r_[0, np.flatnonzero(np.diff(self.node)) + 1] if len(node) else np.zeros(0, np.int64)
        self.present = self.node[self.starts]

    def scores(self, w: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Node logit of every pair, in the node-sorted order."""
        return (self.zp * w[self.node]).sum(1, dtype=np.float64) + b[self.node]

    def segment_sum(self, values: np.ndarray) -> np.ndarray:
        out = np.zeros((self.n_nodes, values.shape[1]))
        if len(self.starts):
            out[self.present] = np.add.reduceat(values, self.starts, axis=0)
        return out


def _rank_within(group: np.ndarray, key: np.ndarray, tiebreak: np.ndarray) -> np.ndarray:
    """Rank of each item within its group by descending key (ties by ascending tiebreak)."""
    order = np.lexsort((tiebreak, -key, group))
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
    After fit(): pca_mean_, pca_components_, node_weights_, node_bias_, leaf_labels_.
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
        self.pca_mean_, self.pca_components_ = fit_pca(x, self.pca_dim)
        z = (x - self.pca_mean_) @ self.pca_components_.T
        self._fit_nodes(z.astype(np.float64), pair_doc, pair_label, num_labels)
        return self

    def _fit_nodes(self, z: np.ndarray, pair_doc: np.ndarray, pair_label: np.ndarray, num_labels: int) -> None:
        k = z.shape[1]
        depth = max(1, int(np.ceil(np.log2(num_labels))))
        num_leaves = 1 << depth
        weights = np.zeros((num_leaves - 1, k))
        bias = np.zeros(num_leaves - 1)
        # Per-label summed features: what the initial split projects.
        label_sum = np.zeros((num_labels, k))
        np.add.at(label_sum, pair_label, z[pair_doc])
        rng = np.random.default_rng(self.seed)
        # Random tie-break so labels without documents spread evenly instead of by id.
        tiebreak = rng.permutation(num_labels)
        position = np.zeros(num_labels, dtype=np.int64)  # node of each label at the current level
        self.rounds_per_level_: list[int] = []
        for level in range(depth):
            first = (1 << level) - 1
            local = position - first  # node index within the level
            n_nodes = 1 << level
            counts = np.bincount(local, minlength=n_nodes)
            n_left = (counts + 1) // 2
            learn = counts >= 2  # one label: the split is forced (its sibling is padding)
            w, b = self._initial_split(label_sum, local, n_nodes, counts)
            projection = (label_sum * w[local]).sum(1)
            go_left = _rank_within(local, projection, tiebreak) < n_left[local]
            data = _LevelData(z[pair_doc], local[pair_label], n_nodes)
            rounds = 0
            for rounds in range(1, self.max_rounds + 1):  # noqa: B007 (reported below)
                for _ in range(self.newton_steps):
                    w, b = self._newton(w, b, data, go_left[pair_label[data.order]])
                delta = np.bincount(pair_label[data.order], weights=data.scores(w, b), minlength=num_labels)
                new_left = _rank_within(local, delta, tiebreak) < n_left[local]
                moved = int((new_left != go_left).sum())
                go_left = new_left
                if moved == 0:
                    break
            else:
                for _ in range(self.newton_steps):
                    w, b = self._newton(w, b, data, go_left[pair_label[data.order]])
            self.rounds_per_level_.append(rounds)
            w[~learn] = 0.0
            b[~learn] = 0.0
            weights[first : first + n_nodes] = w
            bias[first : first + n_nodes] = b
            position = 2 * position + np.where(go_left, 1, 2)
        leaf_labels = np.full(num_leaves, -1, dtype=np.int64)
        leaf_labels[position - (num_leaves - 1)] = np.arange(num_labels)
        self.node_weights_ = weights.astype(np.float32)
        self.node_bias_ = bias.astype(np.float32)
        self.leaf_labels_ = leaf_labels
        self._finish()

    def _initial_split(
        self, label_sum: np.ndarray, local: np.ndarray, n_nodes: int, counts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Dominant eigenvector of each node's covariance of per-label summed features."""
        k = label_sum.shape[1]
        n = np.maximum(counts, 1)[:, None]
        mean = np.zeros((n_nodes, k))
        np.add.at(mean, local, label_sum)
        mean /= n
        second = np.zeros((n_nodes, k, k))
        np.add.at(second, local, label_sum[:, :, None] * label_sum[:, None, :])
        cov = second / n[:, :, None] - mean[:, :, None] * mean[:, None, :]
        _, vecs = np.linalg.eigh(cov)
        u = vecs[:, :, -1]
        # Orient so the larger-magnitude end is deterministic.
        sign = np.sign(u[np.arange(n_nodes), np.abs(u).argmax(1)])
        u *= np.where(sign == 0, 1.0, sign)[:, None]
        # Start the node logit centred on its labels' mean projection.
        return u, np.zeros(n_nodes)

    def _newton(
        self, w: np.ndarray, b: np.ndarray, level: _LevelData, left: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """One Newton step on every node of the level at once (L2 strength lambda_n on w and b)."""
        k = w.shape[1]
        s = level.scores(w, b)
        p = _sigmoid(s)
        resid = p - left  # d(-log-lik)/ds with target 1 = left
        curv = np.maximum(p * (1.0 - p), 1e-10)
        theta = np.concatenate([w, b[:, None]], axis=1)
        grad = level.segment_sum(level.x1 * resid[:, None].astype(np.float32)) + self.lambda_n * theta
        upper = level.segment_sum(level.products * curv[:, None].astype(np.float32))
        n_nodes = len(w)
        hess = np.empty((n_nodes, k + 1, k + 1))
        rows, cols = np.triu_indices(k + 1)
        hess[:, rows, cols] = upper
        hess[:, cols, rows] = upper
        hess += self.lambda_n * np.eye(k + 1)
        theta = theta - np.linalg.solve(hess, grad[:, :, None])[:, :, 0]
        return theta[:, :k], theta[:, k]

    def _finish(self) -> None:
        num_leaves = len(self.leaf_labels_)
        self.depth_ = num_leaves.bit_length() - 1
        self._bias_eff = self.node_bias_.astype(np.float64) + forced_split_bias(self.leaf_labels_)
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

    # --- using the fitted tree -------------------------------------------------------
    def project(self, embeddings: np.ndarray) -> np.ndarray:
        return (np.asarray(embeddings, dtype=np.float32) - self.pca_mean_) @ self.pca_components_.T

    def log_prob(self, z: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """log p_n(labels[b, j] | x_b) for projected inputs z [B, k] and labels [B, J]."""
        z = np.asarray(z, dtype=np.float64)
        nodes = self.path_nodes_[labels]  # [B, J, depth]
        s = np.einsum("bjdk,bk->bjd", self.node_weights_[nodes].astype(np.float64), z) + self._bias_eff[nodes]
        return log_sigmoid(self.path_signs_[labels] * s).sum(-1)

    def sample(self, z: np.ndarray, num_samples: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Ancestral sampling y ~ p_n(.|x): (labels [B, S], log p_n [B, S]); O(k log L) each."""
        z = np.asarray(z, dtype=np.float64)
        batch = len(z)
        zr = np.repeat(z, num_samples, axis=0)
        nodes = np.zeros(batch * num_samples, dtype=np.int64)
        logp = np.zeros(batch * num_samples)
        for _ in range(self.depth_):
            s = (self.node_weights_[nodes] * zr).sum(1) + self._bias_eff[nodes]
            lp_left = log_sigmoid(s)
            left = np.log(rng.random(len(nodes))) < lp_left
            logp += np.where(left, lp_left, log_sigmoid(-s))
            nodes = 2 * nodes + np.where(left, 1, 2)
        labels = self.leaf_labels_[nodes - (len(self.leaf_labels_) - 1)]
        return labels.reshape(batch, num_samples), logp.reshape(batch, num_samples)

    def arrays(self) -> dict[str, np.ndarray]:
        """The tree part of the TreeScorer arrays."""
        return {
            "pca_mean": self.pca_mean_,
            "pca_components": self.pca_components_,
            "node_weights": self.node_weights_,
            "node_bias": self.node_bias_,
            "leaf_labels": self.leaf_labels_,
        }
