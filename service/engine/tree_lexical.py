"""The tree route's two lexical terms (service.engine.tree.TreeScorer), read from the query's
tokens (padded ids and TF-IDF weights x_t, service.engine.tokenizer.encode_batch):

- xi's, LexicalRows (training/tree_lexical.py): xi_y(x) += sum_t x_t U[t, y] + hit_y(x) h_y,
  U sparse, a row of labels per token.
- p_n's, NodeLexical (training/tree_node_lexical.py): every internal node's logit gains
  sum_t x_t v[slot(n, t)], v one hashed table of 2^bits values shared by all (node, token)
  pairs. The dense split on a 16-dimensional projection alone leaves the beam holding ~57% of
  debian-deps' true labels; the words of the query say much of which branch a label is on.
"""

from __future__ import annotations

import numpy as np

from service.engine.tree_native import lexical_scores

# Fibonacci hashing's multiplier (2^64 / golden ratio, odd): the top bits of id * it spread
# consecutive ids evenly over the table.
_HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
# A table of more than 2^32 values would be 8 GiB or more: no bundle needs one.
MAX_NODE_LEXICAL_BITS = 32
Tokens = tuple[np.ndarray, np.ndarray]
# NodeLexical.prepare's: the tokens' slot offsets [B, 1, T] and weights [B, T, 1].
QueryTokens = tuple[np.ndarray, np.ndarray]


class LexicalRows:
    """xi's lexical term: U [V, L] as CSR rows by token id and h [L]; the term of candidate
    labels for a query's tokens, by binary search of (token, label) keys (no dense [L] row per
    query)."""

    def __init__(self, indptr: np.ndarray, labels: np.ndarray, weights: np.ndarray, bias: np.ndarray,
                 num_labels: int) -> None:
        self.indptr, self.labels, self.weights, self.bias = indptr, labels, weights, bias
        if bias.shape != (num_labels,):
            raise ValueError(f"tree array lexical_bias: expected [{num_labels}], got shape {bias.shape}")
        if indptr.ndim != 1 or len(indptr) < 2 or indptr[0] != 0 or (np.diff(indptr) < 0).any():
            raise ValueError("tree array lexical_indptr: expected [V + 1] non-decreasing offsets from 0")
        nnz = int(indptr[-1])
        if labels.shape != (nnz,) or weights.shape != (nnz,):
            raise ValueError(f"tree arrays lexical_labels, lexical_weights: expected [{nnz}] (lexical_indptr's "
                             f"last offset), got {labels.shape} and {weights.shape}")
        if nnz and (labels.min() < 0 or labels.max() >= num_labels):
            raise ValueError(f"tree array lexical_labels: label ids must be in [0, {num_labels})")
        self.num_labels = num_labels
        self.vocab_size = len(indptr) - 1
        token = np.repeat(np.arange(self.vocab_size, dtype=np.int64), np.diff(indptr))
        if (np.diff(token * num_labels + labels) <= 0).any():
            raise ValueError("tree array lexical_labels: labels must be strictly ascending within each token's row")

    def scores(self, tokens: Tokens, labels: np.ndarray) -> np.ndarray:
        """[B, C] sum_t x_t U[t, labels[b, c]] + h for labels on some query token's row, else 0
        (labels >= 0; token ids past the vocabulary count 0). Only the labels on the query's token
        rows (T x width of them) have a term: service/engine/_tree_native.cpp sums them into a
        small hash table per query and looks the candidates up there."""
        ids = np.ascontiguousarray(tokens[0], dtype=np.int64)
        x = np.ascontiguousarray(tokens[1], dtype=np.float32)
        labels = np.ascontiguousarray(labels, dtype=np.int64)
        out = np.empty(labels.shape)
        lexical_scores(self.indptr, self.labels, self.weights, self.bias, ids, x, labels, out, len(ids), ids.shape[1],
                       labels.shape[1])
        return out

    def dense(self, tokens: Tokens) -> np.ndarray:
        """[B, L] the term for every label (measurement only)."""
        ids, x = tokens
        out = np.zeros((len(ids), self.num_labels))
        hit = np.zeros((len(ids), self.num_labels), dtype=bool)
        for row in range(len(ids)):
            for t, weight in zip(ids[row], x[row], strict=True):
                if 0 < t < self.vocab_size:
                    lo, hi = self.indptr[t], self.indptr[t + 1]
                    out[row, self.labels[lo:hi]] += weight * self.weights[lo:hi]
                    hit[row, self.labels[lo:hi]] = True
        return out + np.where(hit, self.bias, 0.0)


class NodeLexical:
    """p_n's lexical node term: s_n(x) += sum_t x_t v[slot(n, t)], slot(n, t) = (offset(t) + n)
    mod 2^bits with offset(t) a multiplicative hash of the token id. A token's slots for
    consecutive nodes are adjacent: the levels a beam scores whole read one run of the table per
    token, not a cache miss per node. Padding (weight 0) adds nothing."""

    def __init__(self, table: np.ndarray) -> None:
        table = np.asarray(table)
        size = table.shape[0] if table.ndim == 1 else 0
        if size < 2 or size & (size - 1) or size > 1 << MAX_NODE_LEXICAL_BITS:
            raise ValueError(f"tree array node_lexical: expected a power-of-two length in [2, 2^"
                             f"{MAX_NODE_LEXICAL_BITS}], got shape {table.shape}")
        if not np.isfinite(table).all():
            raise ValueError("tree array node_lexical: contains NaN or infinite values")
        self.table = table
        self.bits = size.bit_length() - 1
        self._shift = np.uint64(64 - self.bits)
        self._mask = size - 1

    def token_offsets(self, ids: np.ndarray) -> np.ndarray:
        """Where each token id's run of slots starts (same shape as ids)."""
        return ((np.asarray(ids).astype(np.uint64) * _HASH_MULTIPLIER) >> self._shift).astype(np.intp)

    def slots(self, nodes: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Elementwise (broadcast) table slot of heap node `nodes` for tokens at `offsets`."""
        out = np.add(nodes, offsets)
        return np.bitwise_and(out, self._mask, out=out)

    def prepare(self, tokens: Tokens) -> QueryTokens:
        """Queries' tokens ([B, T] ids and weights) as scores() reads them: computed once a search."""
        ids, weights = tokens
        return self.token_offsets(ids)[:, None, :], np.asarray(weights, dtype=np.float32)[:, :, None]

    def scores(self, nodes: np.ndarray, query: QueryTokens) -> np.ndarray:
        """The term of nodes [n] (every query) or [B, n] for prepared queries: [B, n] float32."""
        offsets, weights = query
        values = self.table[self.slots(nodes[..., :, None], offsets)]
        # A product, not (values * weights).sum(-1): numpy reduces a short last axis slowly (15 vs 5 us).
        return np.matmul(values.astype(np.float32), weights)[..., 0]
