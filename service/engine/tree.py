"""The tree-based bias-corrected scorer (Bamler & Mandt, ICLR 2020), inference only (numpy; the
beam search in service/engine/_tree_native.cpp).

The auxiliary model p_n(y|x) is a perfect binary tree in heap order over the labels:
internal node i (0 = root) has children 2i+1 (left) and 2i+2 (right); leaf j sits at heap
index (num_leaves - 1 + j) and carries label leaf_labels[j] (-1 = padding, p_n = 0).
Each internal node splits on the PCA projection z = P (q - m) of the query embedding q:

    p(left | node, x) = sigmoid(w_node . z + b_node)

log p_n(y|x) is the sum of the log-sigmoids along y's root-to-leaf path. The classifier
xi_y(x) = v_y . q + c_y was trained against negatives drawn from p_n, so it estimates
log p(y|x) - log p_n(y|x) (up to a constant); the bias-corrected score is

    score_y(x) = xi_y(x) + log p_n(y|x)

and search() finds its top k by a beam search on the path log-probabilities followed by
rescoring the beam's leaves with the full score: O(beam * (k_pca log L + D)) per query.

Arrays (tree.npz in a bundle; produced by training.tree_train.AdversarialTree):
  pca_mean [D] f32, pca_components [k, D] f32,
  node_weights [num_leaves - 1, k] f32, node_bias [num_leaves - 1] f32,
  leaf_labels [num_leaves] int64 (each real label exactly once, -1 padding),
  classifier_weights [L, D] f32, classifier_bias [L] f32, default_beam [] int64;
  optional, all four or none (xi's lexical term, training/tree_lexical.py:
  xi_y(x) += sum_t x_t U[t, y] + hit_y(x) h_y over the query's tokens t with TF-IDF weights
  x_t, U a [V, L] matrix as CSR rows by token id, hit_y(x) = some token's row holds y):
  lexical_indptr [V + 1] int64, lexical_labels [nnz] int32 (ascending within a row),
  lexical_weights [nnz] f32, lexical_bias [L] f32 (h);
  optional, p_n's lexical node term (service.engine.tree_lexical.NodeLexical): every internal
  node's logit gains sum_t x_t v[slot(n, t)]: node_lexical [2^bits] f16 (v).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from service.engine.tree_lexical import LexicalRows, NodeLexical, Tokens
from service.engine.tree_native import ancestral_sample, beam_search
from service.engine.vectors import as_float32

REQUIRED_ARRAYS = (
    "pca_mean",
    "pca_components",
    "node_weights",
    "node_bias",
    "leaf_labels",
    "classifier_weights",
    "classifier_bias",
)
LEXICAL_ARRAYS = ("lexical_indptr", "lexical_labels", "lexical_weights", "lexical_bias")
DEFAULT_BEAM = 128
# The widest beam a tree search runs, by a bundle's default or a request (the service's
# SHORTLIST_MAX_BEAM may be at most this): each beam step scores beam x branching nodes.
MAX_BEAM = 4096
NODE_LEXICAL = "node_lexical"
# log_pn's node-term values (one per query, node and token) computed at once.
_LOG_PN_BLOCK = 1 << 24
# What the beam search reads a float16 node-lexical table through: every float16 bit pattern as
# numpy converts it to float32 (256 KiB, so the table stays float16 in memory, as stored).
_HALF_VALUES = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
_NO_BYTES = np.zeros(0, dtype=np.uint8)


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    """log sigmoid(x), stable for large |x| and exact at +-inf (0 and -inf)."""
    return -np.logaddexp(0.0, -x)


def _subtree_has_label(leaf_labels: np.ndarray, retired: np.ndarray | None = None) -> np.ndarray:
    """Bool per heap node (internal and leaf): does its subtree hold a real label (one not
    `retired`, bool per label id, where given)?"""
    num_leaves = len(leaf_labels)
    has = np.zeros(2 * num_leaves - 1, dtype=bool)
    has[num_leaves - 1 :] = leaf_labels >= 0
    if retired is not None:
        has[num_leaves - 1 :] &= ~retired[np.maximum(leaf_labels, 0)]
    # A level at a time, deepest first: the children of level d's nodes are level d + 1 in order.
    for level in range(num_leaves.bit_length() - 2, -1, -1):
        first = (1 << level) - 1
        children = has[2 * first + 1 : 2 * first + 1 + (2 << level)]
        has[first : first + (1 << level)] = children[0::2] | children[1::2]
    return has


def forced_split_bias(leaf_labels: np.ndarray) -> np.ndarray:
    """Per internal node: +inf where only the left subtree holds labels, -inf where only the
    right does, 0 elsewhere. Added to the node's logit so padding gets p_n = 0 exactly."""
    num_leaves = len(leaf_labels)
    has = _subtree_has_label(leaf_labels)
    internal = np.arange(num_leaves - 1)
    left, right = has[2 * internal + 1], has[2 * internal + 2]
    force = np.zeros(num_leaves - 1, dtype=np.float64)
    force[left & ~right] = np.inf
    force[~left & right] = -np.inf
    return force


def _native_table(node_lexical: NodeLexical | None) -> tuple[np.ndarray, int]:
    """The node-lexical table as the compiled search and sampler read it: (array, kind) with kind
    2 for float16 (its bits, read through _HALF_VALUES), 4 for float32, 0 for no table."""
    if node_lexical is None:
        return _NO_BYTES, 0
    table = node_lexical.table
    if table.dtype == np.float16:
        return np.ascontiguousarray(table).view(np.uint16), 2
    return np.ascontiguousarray(table, dtype=np.float32), 4


def _native_tokens(node_lexical: NodeLexical | None, tokens: Tokens | None, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Queries' tokens as the compiled loops read them: each token's first slot [rows, T] int64
    and its weight float32 (none without a node-lexical table)."""
    if node_lexical is None or tokens is None:
        return np.zeros((rows, 0), np.int64), np.zeros((rows, 0), np.float32)
    return (np.ascontiguousarray(node_lexical.token_offsets(tokens[0]), dtype=np.int64),
            np.ascontiguousarray(tokens[1], dtype=np.float32))


def sample_leaves(node_weights: np.ndarray, node_bias: np.ndarray, node_lexical: NodeLexical | None, depth: int,
                  z: np.ndarray, tokens: Tokens | None, draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ancestral samples of p_n's leaves, training's negatives (training/tree.py LabelTree.sample),
    compiled beside the search: heap nodes and path log-probs [B, S] for projected inputs z
    [B, k] and, with the node-lexical table, their tokens ([B, T] ids and weights); one uniform
    draw a level and sample, draws [depth, B, S]: left where log(draw) < log sigmoid(s_n(x))."""
    z = np.ascontiguousarray(z, dtype=np.float64)
    log_draws = np.log(np.asarray(draws, dtype=np.float64))  # one vectorised log, not one a decision in the loop
    batch, samples = draws.shape[1:]
    if node_lexical is not None and tokens is None:
        raise ValueError("this tree's node logits read the documents' tokens: pass tokens=(ids, weights)")
    offsets, weights = _native_tokens(node_lexical, tokens, batch)
    table, table_kind = _native_table(node_lexical)
    nodes, logp = np.empty((batch, samples), np.int64), np.empty((batch, samples))
    ancestral_sample(z, np.ascontiguousarray(node_weights, dtype=np.float32),
                     np.ascontiguousarray(node_bias, dtype=np.float64), table, _HALF_VALUES, offsets, weights,
                     log_draws, nodes, logp, batch, z.shape[1], offsets.shape[1], depth, samples, table_kind)
    return nodes, logp


class TreeScorer:
    """Beam search over the probabilistic label tree with bias-corrected rescoring."""

    def __init__(
        self,
        pca_mean: np.ndarray,
        pca_components: np.ndarray,
        node_weights: np.ndarray,
        node_bias: np.ndarray,
        leaf_labels: np.ndarray,
        classifier_weights: np.ndarray,
        classifier_bias: np.ndarray,
        default_beam: int = DEFAULT_BEAM,
        lexical: Mapping[str, np.ndarray] | None = None,
        classifier_scales: np.ndarray | None = None,
        node_lexical: np.ndarray | None = None,
    ) -> None:
        self.pca_mean = np.asarray(pca_mean, dtype=np.float32)
        self.pca_components = np.asarray(pca_components, dtype=np.float32)
        self.node_weights = np.ascontiguousarray(node_weights, dtype=np.float32)
        self.node_bias = np.asarray(node_bias, dtype=np.float32)
        self.leaf_labels = np.asarray(leaf_labels, dtype=np.int64)
        # float16 or int8 (a bundle's vector_dtype; int8 with its row scales) stays as stored: a
        # float32 copy of [L, D] at 10^6 labels is a gigabyte; search() scores the beam's rows in float32.
        weights = np.asarray(classifier_weights)
        self.classifier_weights = (weights if weights.dtype in (np.float16, np.int8)
                                   else weights.astype(np.float32, copy=False))
        self.classifier_scales = None if classifier_scales is None else np.asarray(classifier_scales)
        self.classifier_bias = np.asarray(classifier_bias, dtype=np.float32)
        self.default_beam = int(default_beam)
        self._check_structure()
        self.lexical = None
        if lexical is not None:
            self.lexical = LexicalRows(np.ascontiguousarray(lexical["lexical_indptr"], dtype=np.int64),
                                       np.ascontiguousarray(lexical["lexical_labels"], dtype=np.int32),
                                       np.ascontiguousarray(lexical["lexical_weights"], dtype=np.float32),
                                       np.ascontiguousarray(lexical["lexical_bias"], dtype=np.float32),
                                       int(self.classifier_weights.shape[0]))
            for name in ("weights", "bias"):
                if not np.isfinite(getattr(self.lexical, name)).all():
                    raise ValueError(f"tree array lexical_{name}: contains NaN or infinite values")
        self.node_lexical = None if node_lexical is None else NodeLexical(node_lexical)
        self.num_leaves = len(self.leaf_labels)
        self.depth = int(self.num_leaves).bit_length() - 1
        self.num_labels = int(self.classifier_weights.shape[0])
        # Padding-only subtrees get a logit of -inf; folded into the bias once, here.
        self._node_bias_eff = self.node_bias.astype(np.float64) + forced_split_bias(self.leaf_labels)
        # Node scores are s = w . P (q - m) + b = (w P) . q + (b - w P m): fold the PCA
        # projection in per node only where it pays, i.e. keep z = P (q - m) (k << D).
        self._pca_offset = self.pca_components @ self.pca_mean
        self._native_table = _native_table(self.node_lexical)

    def live_nodes(self, retired: np.ndarray | None) -> np.ndarray | None:
        """What search(live=...) takes for a bundle's retired labels (bool per label id, of at
        least this tree's labels; labels added since training are not in the tree): bool per
        heap node, does its subtree hold a label not retired; None when none of the tree's labels
        is retired (nothing to skip). Made once per label state, not per query."""
        if retired is None or not retired[: self.num_labels].any():
            return None
        return _subtree_has_label(self.leaf_labels, np.asarray(retired[: self.num_labels], dtype=bool))

    # --- construction and validation -------------------------------------------------
    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> TreeScorer:
        missing = [name for name in REQUIRED_ARRAYS if name not in arrays]
        if missing:
            raise ValueError(f"tree arrays: missing {', '.join(missing)}")
        given = [name for name in LEXICAL_ARRAYS if name in arrays]
        if given and len(given) < len(LEXICAL_ARRAYS):
            missing = [name for name in LEXICAL_ARRAYS if name not in arrays]
            raise ValueError(f"tree arrays: {given[0]} without {', '.join(missing)}")
        beam = arrays.get("default_beam")
        kwargs = {name: np.asarray(arrays[name]) for name in REQUIRED_ARRAYS}
        scales, node_lexical = arrays.get("classifier_scales"), arrays.get(NODE_LEXICAL)
        return cls(**kwargs, default_beam=int(np.asarray(beam)) if beam is not None else DEFAULT_BEAM,
                   lexical={name: arrays[name] for name in LEXICAL_ARRAYS} if given else None,
                   classifier_scales=None if scales is None else np.asarray(scales),
                   node_lexical=None if node_lexical is None else np.asarray(node_lexical))

    def to_arrays(self) -> dict[str, np.ndarray]:
        lexical = {}
        if self.lexical is not None:
            lexical = {"lexical_indptr": self.lexical.indptr, "lexical_labels": self.lexical.labels,
                       "lexical_weights": self.lexical.weights, "lexical_bias": self.lexical.bias}
        scales = {} if self.classifier_scales is None else {"classifier_scales": self.classifier_scales}
        nodes = {} if self.node_lexical is None else {NODE_LEXICAL: self.node_lexical.table}
        return {
            **lexical,
            **scales,
            **nodes,
            "pca_mean": self.pca_mean,
            "pca_components": self.pca_components,
            "node_weights": self.node_weights,
            "node_bias": self.node_bias,
            "leaf_labels": self.leaf_labels,
            "classifier_weights": self.classifier_weights,
            "classifier_bias": self.classifier_bias,
            "default_beam": np.asarray(self.default_beam, dtype=np.int64),
        }

    def _check_structure(self) -> None:
        """Shapes that must agree with each other (independent of the bundle's L and D)."""
        if self.pca_mean.ndim != 1:
            raise ValueError(f"tree array pca_mean: expected [D], got shape {self.pca_mean.shape}")
        dim = self.pca_mean.shape[0]
        if self.pca_components.ndim != 2 or self.pca_components.shape[1] != dim:
            raise ValueError(
                f"tree array pca_components: expected [k, {dim}], got shape {self.pca_components.shape}"
            )
        k = self.pca_components.shape[0]
        n_leaves = self.leaf_labels.shape[0] if self.leaf_labels.ndim == 1 else -1
        if n_leaves < 2 or n_leaves & (n_leaves - 1):
            raise ValueError(
                f"tree array leaf_labels: expected a power-of-two length >= 2, got shape {self.leaf_labels.shape}"
            )
        if self.node_weights.shape != (n_leaves - 1, k):
            raise ValueError(
                f"tree array node_weights: expected [{n_leaves - 1}, {k}], got shape {self.node_weights.shape}"
            )
        if self.node_bias.shape != (n_leaves - 1,):
            raise ValueError(f"tree array node_bias: expected [{n_leaves - 1}], got shape {self.node_bias.shape}")
        if self.classifier_weights.ndim != 2 or self.classifier_weights.shape[1] != dim:
            raise ValueError(
                f"tree array classifier_weights: expected [L, {dim}], got shape {self.classifier_weights.shape}"
            )
        num_labels = self.classifier_weights.shape[0]
        if self.classifier_bias.shape != (num_labels,):
            raise ValueError(
                f"tree array classifier_bias: expected [{num_labels}], got shape {self.classifier_bias.shape}"
            )
        self._check_scales(num_labels)
        real = self.leaf_labels[self.leaf_labels >= 0]
        if (self.leaf_labels < -1).any() or len(real) != num_labels or not np.array_equal(
            np.sort(real), np.arange(num_labels)
        ):
            raise ValueError(f"tree array leaf_labels: must hold each label 0..{num_labels - 1} once, -1 for padding")
        for name in ("pca_mean", "pca_components", "node_weights", "node_bias", "classifier_weights",
                     "classifier_bias"):
            if not np.isfinite(getattr(self, name)).all():
                raise ValueError(f"tree array {name}: contains NaN or infinite values")
        if not 1 <= self.default_beam <= MAX_BEAM:
            raise ValueError(f"tree array default_beam: must be in [1, {MAX_BEAM}], got {self.default_beam}")

    def _check_scales(self, num_labels: int) -> None:
        """int8 classifier weights come with their row scales, float32 [L], finite and >= 0; others without."""
        scales, int8 = self.classifier_scales, self.classifier_weights.dtype == np.int8
        if int8 != (scales is not None):
            raise ValueError("tree array classifier_scales: " + ("missing for int8 classifier_weights" if int8 else
                             f"given for {self.classifier_weights.dtype} classifier_weights (scales go with int8)"))
        if scales is None:
            return
        if scales.dtype != np.float32 or scales.shape != (num_labels,):
            raise ValueError(f"tree array classifier_scales: expected float32 [{num_labels}], got {scales.dtype} "
                             f"{scales.shape}")
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise ValueError("tree array classifier_scales: must be finite and >= 0")

    def validate(self, num_labels: int, dim: int, vocab_size: int | None = None) -> None:
        """Check the arrays against the bundle's label count, embedding dimension and vocabulary."""
        if self.lexical is not None and vocab_size is not None and self.lexical.vocab_size != vocab_size:
            raise ValueError(f"tree array lexical_indptr: rows for {self.lexical.vocab_size} token ids, "
                             f"bundle has vocab_size={vocab_size}")
        if self.pca_mean.shape[0] != dim:
            raise ValueError(f"tree array pca_mean: dimension {self.pca_mean.shape[0]}, bundle has D={dim}")
        if self.classifier_weights.shape != (num_labels, dim):
            raise ValueError(
                f"tree array classifier_weights: shape {self.classifier_weights.shape}, "
                f"bundle has L={num_labels}, D={dim}"
            )

    # --- scoring ---------------------------------------------------------------------
    def _project(self, q: np.ndarray) -> np.ndarray:
        q = np.asarray(q, dtype=np.float32)
        if q.ndim != 2 or q.shape[1] != self.pca_mean.shape[0]:
            raise ValueError(f"queries must be [B, {self.pca_mean.shape[0]}], got shape {q.shape}")
        return q @ self.pca_components.T - self._pca_offset

    def log_pn(self, q: np.ndarray, tokens: Tokens | None = None) -> np.ndarray:
        """log p_n(y|x) for every label: [B, L] (exact, all nodes; tests and measurement only)."""
        z = self._project(q).astype(np.float64)
        logits = z @ self.node_weights.T.astype(np.float64) + self._node_bias_eff  # [B, nodes]
        if self.node_lexical is not None:
            ids, weights = self._tokens(tokens, len(z))
            nodes = np.arange(self.num_leaves - 1)
            # In blocks of rows: [rows, nodes, T] values at once were 9.7 GB for 1,000 debian-deps queries.
            step = max(1, _LOG_PN_BLOCK // (len(nodes) * ids.shape[1]))
            for begin in range(0, len(z), step):
                query = self.node_lexical.prepare((ids[begin : begin + step], weights[begin : begin + step]))
                logits[begin : begin + step] += self.node_lexical.scores(nodes, query)
        logp = np.zeros((len(z), 1))
        for level in range(self.depth):
            first = (1 << level) - 1
            s = logits[:, first : first + (1 << level)]
            # Children of the level's nodes interleave left, right in heap order.
            logp = np.stack([logp + log_sigmoid(s), logp + log_sigmoid(-s)], axis=2).reshape(len(z), -1)
        out = np.full((len(z), self.num_labels), -np.inf)
        real = self.leaf_labels >= 0
        out[:, self.leaf_labels[real]] = logp[:, real]
        return out

    def classifier_scores(self, q: np.ndarray, tokens: Tokens | None = None) -> np.ndarray:
        """xi_y(x) for every label: [B, L] (measurement only)."""
        q = np.asarray(q, dtype=np.float32)
        xi = q @ self.classifier_weights.T.astype(np.float32)
        if self.classifier_scales is not None:
            xi *= self.classifier_scales
        xi += self.classifier_bias
        if self.lexical is not None:
            xi = xi + self.lexical.dense(self._tokens(tokens, len(q)))
        return xi

    def exact_scores(self, q: np.ndarray, tokens: Tokens | None = None) -> np.ndarray:
        """xi_y(x) + log p_n(y|x) for every label: [B, L] (tests and recall measurement only)."""
        return self.classifier_scores(q, tokens) + self.log_pn(q, tokens)

    def _tokens(self, tokens: Tokens | None, rows: int) -> Tokens:
        if tokens is None:
            raise ValueError("this tree reads the query's tokens: pass tokens=(ids, weights)")
        ids, x = np.asarray(tokens[0], dtype=np.int64), np.asarray(tokens[1], dtype=np.float32)
        if ids.ndim != 2 or ids.shape != x.shape or len(ids) != rows:
            raise ValueError(f"tokens must be two [{rows}, T] arrays, got shapes {ids.shape} and {x.shape}")
        return ids, x

    def candidate_scores(self, q: np.ndarray, labels: np.ndarray, tokens: Tokens | None = None) -> np.ndarray:
        """xi_y(x) of candidate labels [B, C] (>= 0): [B, C]."""
        rows = as_float32(self.classifier_weights.take(labels, axis=0))  # float16 or int8 as stored
        xi = (rows @ q[:, :, None])[:, :, 0]  # a batched product (einsum took 2.5x as long for 512 rows)
        if self.classifier_scales is not None:
            xi *= self.classifier_scales.take(labels)
        xi += self.classifier_bias.take(labels)
        if self.lexical is not None:
            xi = xi + self.lexical.scores(self._tokens(tokens, len(q)), labels)
        return xi

    def beam_leaves(self, q: np.ndarray, beam: int, tokens: Tokens | None = None,
                    live: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Beam search on path log-probs: (label ids [B, <=beam] (-1 = none), log p_n [B, <=beam]).
        Each level keeps the `beam` children of highest path log-prob among the kept nodes'
        children (service/engine/_tree_native.cpp; unordered within the beam).
        live: live_nodes' mask; a node outside it is never entered (its path log-prob -inf, as
        padding's), so the beam holds live labels wherever the tree has them. Live labels keep
        their own log p_n: retiring a label does not rescale its siblings' (xi was trained against
        this p_n)."""
        z = np.ascontiguousarray(self._project(q), dtype=np.float64)
        batch, width = len(z), min(int(beam), self.num_leaves)
        offsets, weights = _native_tokens(self.node_lexical, None if self.node_lexical is None
                                          else self._tokens(tokens, batch), batch)
        live_bytes = _NO_BYTES if live is None else np.ascontiguousarray(live, dtype=bool).view(np.uint8)
        nodes = np.empty((batch, width), dtype=np.int64)
        logp = np.empty((batch, width))
        table, table_kind = self._native_table
        beam_search(z, self.node_weights, self._node_bias_eff, table, _HALF_VALUES, offsets, weights, live_bytes, nodes,
                    logp, batch, z.shape[1], offsets.shape[1], self.depth, width, table_kind)
        labels = self.leaf_labels[nodes - (self.num_leaves - 1)]
        # Padding leaves (p_n = 0) and leaves reached only through them are not candidates.
        labels = np.where(np.isfinite(logp), labels, -1)
        return labels, logp

    def search(self, q: np.ndarray, k: int, beam: int | None = None, tokens: Tokens | None = None,
               live: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top k of xi_y(x) + log p_n(y|x) among the beam's leaves: (ids int64 [B, k] (-1 pad),
        scores float32 [B, k]), best first. tokens: the queries' token ids and weights, needed
        when xi or p_n has a lexical term; `live`: live_nodes(retired), whose retired labels are
        never returned nor take a place in the beam (beam_leaves)."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        beam = self.default_beam if beam is None else int(beam)
        if beam < 1:
            raise ValueError(f"beam must be >= 1, got {beam}")
        q = np.asarray(q, dtype=np.float32)
        labels, logp = self.beam_leaves(q, max(beam, k), tokens, live)
        xi = self.candidate_scores(q, np.maximum(labels, 0), tokens)
        scores = np.where(labels >= 0, xi + logp, -np.inf)
        kk = min(k, scores.shape[1])
        order = np.argsort(-scores, axis=1, kind="stable")[:, :kk]
        rows = np.arange(len(q))[:, None]
        top_ids, top_scores = labels[rows, order], scores[rows, order]
        ids = np.full((len(q), k), -1, dtype=np.int64)
        out = np.full((len(q), k), -np.inf, dtype=np.float32)
        valid = np.isfinite(top_scores)
        ids[:, :kk] = np.where(valid, top_ids, -1)
        out[:, :kk] = np.where(valid, top_scores, -np.inf)
        return ids, out
