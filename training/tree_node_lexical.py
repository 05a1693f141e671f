"""p_n's lexical node term (service.engine.tree_lexical.NodeLexical), fitted after the tree's
dense splits (training/tree.py), which stay as fitted:

    minimise  sum over positive pairs (x, y) and the nodes n on y's path (d = +1 left, -1 right)
              softplus(-d (s_n(x) + sum_t x_t v[slot(n, t)])) + l2 v[slot(n, t)]^2 per token t of x

by Adagrad over mini-batches of documents: p_n's own likelihood, the objective the dense splits
were fitted on. A document's pairs share the nodes near the root, so each (document, node) is
one row weighted by how many of its pairs go left and right. numpy only: the gradient is a
weighted count per slot, which np.bincount takes in one pass.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from service.engine.tree_lexical import MAX_NODE_LEXICAL_BITS, NodeLexical, Tokens
from training.distinct_keys import distinct
from training.divergence import check_fitted
from training.progress import Progress
from training.tree import LabelTree

log = logging.getLogger("shortlist.training")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


@dataclass
class _DocWords:
    """The documents' words without their padding: document d's are start[d]:start[d + 1] of
    offsets (where each word's run of table slots starts) and weights (float64)."""

    start: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray

    @classmethod
    def of(cls, work: NodeLexical, tokens: Tokens) -> _DocWords:
        ids, weights = np.asarray(tokens[0]), np.asarray(tokens[1], dtype=np.float32)
        doc, col = np.nonzero(weights)
        start = np.searchsorted(doc, np.arange(len(weights) + 1))
        return cls(start, work.token_offsets(ids[doc, col]), weights[doc, col].astype(np.float64))

    def of_rows(self, row_doc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For rows of documents row_doc: each word's row and its index here, row by row (the
        order np.nonzero gives over the rows' padded [R, T] weights)."""
        lengths = self.start[row_doc + 1] - self.start[row_doc]
        rows = np.repeat(np.arange(len(row_doc)), lengths)
        at = np.repeat(self.start[row_doc] - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
        return rows, at


class NodeLexicalFit:
    """Fits the table v of p_n's lexical node term on a fitted LabelTree, sklearn-style.

    Hyper-parameters: bits (the table holds 2^bits values), epochs (at most max_steps
    mini-batches of batch_docs documents), lr (Adagrad), l2, seed. After fit(): table_
    (float16 [2^bits], as served), losses_ (per epoch, per positive pair), steps_.
    """

    def __init__(self, bits: int = 22, epochs: int = 12, lr: float = 0.1, l2: float = 1e-4,
                 batch_docs: int = 400, max_steps: int = 4000, seed: int = 0, progress: bool = False) -> None:
        self.bits, self.epochs, self.lr, self.l2 = bits, epochs, lr, l2
        self.batch_docs, self.max_steps, self.seed, self.progress = batch_docs, max_steps, seed, progress

    def validate(self) -> None:
        if not 1 <= self.bits <= MAX_NODE_LEXICAL_BITS:
            raise ValueError(f"node lexical bits must be in [1, {MAX_NODE_LEXICAL_BITS}], got {self.bits}")
        if self.epochs < 0 or self.lr <= 0 or self.l2 < 0 or self.batch_docs < 1 or self.max_steps < 0:
            raise ValueError("node lexical: epochs >= 0, lr > 0, l2 >= 0, batch_docs >= 1, max_steps >= 0 required")

    def fit(self, tree: LabelTree, z: np.ndarray, tokens: Tokens, pair_doc: np.ndarray,
            pair_label: np.ndarray) -> NodeLexicalFit:
        """z: the documents' projections (tree.project); tokens: their padded ids and weights
        [N, T]; (pair_doc, pair_label): the positive pairs, by document (training.tree.flatten_pairs)."""
        self.validate()
        work = NodeLexical(np.zeros(1 << self.bits, dtype=np.float32))
        words = _DocWords.of(work, tokens)
        sum_sq = np.zeros_like(work.table)
        doc_start = np.searchsorted(pair_doc, np.arange(len(z) + 1))
        with_pairs = np.flatnonzero(np.diff(doc_start) > 0)
        rng = np.random.default_rng(self.seed)
        self.losses_: list[float] = []
        self.steps_ = 0
        t0 = time.perf_counter()
        for epoch in range(self.epochs):
            order = rng.permutation(with_pairs)
            bar = Progress(range(0, len(order), self.batch_docs), f"tree node lexical epoch {epoch + 1}/{self.epochs}",
                           enabled=self.progress)
            total = 0.0
            for begin in bar:
                if self.steps_ >= self.max_steps:
                    break
                docs = order[begin : begin + self.batch_docs]
                # a diverging step overflows float32: the loss check below ends the fit, and
                # check_fitted names the setting, so numpy's own warning would only be noise
                with np.errstate(over="ignore", invalid="ignore"):
                    total += self._step(tree, work, sum_sq, z, words, doc_start, docs, pair_label)
                self.steps_ += 1
                if not math.isfinite(total):
                    break  # diverged: the check below names the setting
            self.losses_.append(total / max(1, len(pair_doc)))
            log.info("tree node lexical: epoch %d, loss %.4f a pair, %.1fs", epoch + 1, self.losses_[-1],
                     time.perf_counter() - t0)
            if self.steps_ >= self.max_steps or not math.isfinite(total):
                break
        check_fitted("tree node lexical", "lower tree.node_lexical_lr or raise tree.node_lexical_l2",
                     {"its table": work.table, "its loss": self.losses_}, "float16")
        self.table_ = work.table.astype(np.float16)
        return self

    def _step(self, tree: LabelTree, work: NodeLexical, sum_sq: np.ndarray, z: np.ndarray, words: _DocWords,
              doc_start: np.ndarray, docs: np.ndarray, pair_label: np.ndarray) -> float:
        """One Adagrad step on the documents `docs`; returns their summed loss."""
        lengths = doc_start[docs + 1] - doc_start[docs]
        pairs = np.repeat(doc_start[docs] - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
        # a document's rank in the batch keys its rows: sorted as by its id, in a batch-sized range
        batch_docs = np.sort(docs)
        pair_rank = np.repeat(np.searchsorted(batch_docs, docs), lengths)
        nodes, signs = tree.path_nodes_[pair_label[pairs]], tree.path_signs_[pair_label[pairs]]
        num_nodes = len(tree.node_bias_)
        keys, row = distinct((pair_rank[:, None] * num_nodes + nodes).ravel(), len(docs) * num_nodes)
        left = np.bincount(row, weights=(signs > 0).ravel(), minlength=len(keys))
        right = np.bincount(row, weights=(signs < 0).ravel(), minlength=len(keys))
        row_doc, row_node = batch_docs[keys // num_nodes], keys % num_nodes
        bias = tree.bias_eff_[row_node]
        learned = np.isfinite(bias)  # a forced split (one side padding) has nothing to learn
        row_doc, row_node, left, right, bias = (a[learned] for a in (row_doc, row_node, left, right, bias))
        dense = np.einsum("rk,rk->r", tree.node_weights_[row_node].astype(np.float64), z[row_doc]) + bias
        r, at = words.of_rows(row_doc)
        x = words.weights[at]
        slot = work.slots(row_node[r], words.offsets[at])
        value = work.table[slot].astype(np.float64)
        s = dense + np.bincount(r, weights=value * x, minlength=len(row_doc))
        count = (left + right)[r]
        loss = float((left * _softplus(-s) + right * _softplus(s)).sum() + self.l2 * (count * value**2).sum())
        d_s = right * _sigmoid(s) - left * _sigmoid(-s)
        grad_flat = d_s[r] * x + 2.0 * self.l2 * count * value
        touched, where = distinct(slot, len(work.table))
        grad = np.bincount(where, weights=grad_flat, minlength=len(touched))
        sum_sq[touched] += grad**2
        work.table[touched] -= (self.lr * grad / (np.sqrt(sum_sq[touched]) + 1e-10)).astype(np.float32)
        return loss
