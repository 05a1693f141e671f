"""p_n's lexical node term (service.engine.tree_lexical.NodeLexical), fitted after the tree's
dense splits (training/tree.py), which stay as fitted:

    minimise  sum over positive pairs (x, y) and the nodes n on y's path (d = +1 left, -1 right)
              softplus(-d (s_n(x) + sum_t x_t v[slot(n, t)])) + l2 v[slot(n, t)]^2 per token t of x

by Adagrad over mini-batches of documents: p_n's own likelihood, the objective the dense splits
were fitted on. A document's pairs share the nodes near the root, so each (document, node) is
one row weighted by how many of its pairs go left and right. The step is compiled
(service/engine/_tree_native.cpp, node_lexical_step, beside the search that reads the same
slots): in numpy its gathers, sorts and bincounts took ~0.3 s an epoch of debian-tags' 20,000
documents, compiled ~0.07 s (bench/RESULTS.md, "p_n's lexical node term fitted in compiled code").
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from service.engine.tree_lexical import MAX_NODE_LEXICAL_BITS, NodeLexical, Tokens
from service.engine.tree_native import node_lexical_step
from training.divergence import check_fitted
from training.progress import Progress
from training.tree import LabelTree

log = logging.getLogger("shortlist.training")


@dataclass
class FitArrays:
    """What the compiled step reads, laid out once per fit (C-contiguous, its dtypes)."""

    doc_start: np.ndarray
    pair_label: np.ndarray
    path_nodes: np.ndarray
    path_signs: np.ndarray
    node_weights: np.ndarray
    bias: np.ndarray
    z: np.ndarray
    word_start: np.ndarray
    word_offsets: np.ndarray
    word_weights: np.ndarray
    node_counts: np.ndarray  # the step's scratch [nodes, 2], zero between steps (made once: 32 MB at 10^6 labels)

    @classmethod
    def of(cls, tree: LabelTree, lexical: NodeLexical, z: np.ndarray, tokens: Tokens, pair_doc: np.ndarray,
           pair_label: np.ndarray) -> FitArrays:
        ids, weights = np.asarray(tokens[0]), np.asarray(tokens[1], dtype=np.float32)
        doc, col = np.nonzero(weights)

        def c(a: np.ndarray, dtype: type) -> np.ndarray:
            return np.ascontiguousarray(a, dtype=dtype)

        return cls(c(np.searchsorted(pair_doc, np.arange(len(z) + 1)), np.int64), c(pair_label, np.int64),
                   c(tree.path_nodes_, np.int64), c(tree.path_signs_, np.float64),
                   c(tree.node_weights_, np.float32), c(tree.bias_eff_, np.float64), c(z, np.float32),
                   c(np.searchsorted(doc, np.arange(len(weights) + 1)), np.int64),
                   c(lexical.token_offsets(ids[doc, col]), np.int64), c(weights[doc, col], np.float64),
                   np.zeros((len(tree.bias_eff_), 2)))

    def step(self, docs: np.ndarray, state: np.ndarray, lr: float, l2: float) -> float:
        """One Adagrad step on the documents `docs`, state (new_state) updated in place; returns
        their summed loss."""
        return node_lexical_step(np.ascontiguousarray(docs, dtype=np.int64), self.doc_start, self.pair_label,
                                 self.path_nodes, self.path_signs, self.node_weights, self.bias, self.z,
                                 self.word_start, self.word_offsets, self.word_weights, state, self.node_counts,
                                 self.z.shape[1], self.path_nodes.shape[1], lr, l2)


def new_state(bits: int) -> np.ndarray:
    """The fit's state, one row a slot: [2^bits, 4] float32 of the value (column 0, the table),
    Adagrad's sum of squares (1) and the batch's gradient as a float64 (2-3), zero between steps:
    a slot's reads and writes in one cache line (the compiled step says why)."""
    return np.zeros((1 << bits, 4), dtype=np.float32)


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
        state = new_state(self.bits)
        arrays = FitArrays.of(tree, NodeLexical(state[:, 0]), z, tokens, pair_doc, pair_label)
        with_pairs = np.flatnonzero(np.diff(arrays.doc_start) > 0)
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
                total += arrays.step(order[begin : begin + self.batch_docs], state, self.lr, self.l2)
                self.steps_ += 1
                if not math.isfinite(total):
                    break  # diverged: the check below names the setting
            self.losses_.append(total / max(1, len(pair_doc)))
            log.info("tree node lexical: epoch %d, loss %.4f a pair, %.1fs", epoch + 1, self.losses_[-1],
                     time.perf_counter() - t0)
            if self.steps_ >= self.max_steps or not math.isfinite(total):
                break
        check_fitted("tree node lexical", "lower tree.node_lexical_lr or raise tree.node_lexical_l2",
                     {"its table": state[:, 0], "its loss": self.losses_}, "float16")
        self.table_ = state[:, 0].astype(np.float16)
        return self
