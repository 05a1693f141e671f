"""Prediction over a loaded bundle: tokenise, encode, shortlist, score, top k."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from service.engine.bundle import Bundle
from service.engine.scorers import combine_scores, top_k


class Prediction(NamedTuple):
    id: int
    uid: str
    title: str
    score: float


_SCORE_ROWS = 64  # queries whose candidate rows are gathered at once
_NO_LABEL = np.iinfo(np.int64).max  # sorts after every label id


class Predictor:
    """Log-time top-k over a bundle (DESIGN.md, "Log-time prediction").

    S = topK_w(HNSW over [w_l, b_l] with query [q, 1]) U topK_mu(HNSW over mu_l) U H U T,
    H = the k_head labels of largest bias b_l (query-independent: the label prior's head),
    T = the first k_tok labels of each query token's row of the bundle's token shortlist
    (the labels that token co-occurred with most in training: a lookup, no search);
    score_l = alpha f(w_l.q + b_l) + (1 - alpha) g(mu_l.q) + lambda lex_l for l in S, lex the token
    shortlist's lexical score (lambda = the bundle's lexical_weight, 0 without shares).

    All methods are safe to call from several threads at once. `ef_search` given here is
    set on the bundle's shared indices (it is a property of the search, not of a call).
    """

    def __init__(
        self,
        bundle: Bundle,
        *,
        threads: int = 1,
        ef_search: int | None = None,
        shortlist_w: int | None = None,
        shortlist_mu: int | None = None,
        shortlist_head: int | None = None,
        shortlist_tok: int | None = None,
        lexical_weight: float | None = None,
    ) -> None:
        self.bundle = bundle
        scoring = bundle.manifest.scoring
        self.alpha = scoring.alpha
        self.f = scoring.calibration.classifier.to_calibration()
        self.g = scoring.calibration.centroid.to_calibration()
        self.shortlist_w = int(shortlist_w if shortlist_w is not None else scoring.shortlist.k_w)
        self.shortlist_mu = int(shortlist_mu if shortlist_mu is not None else scoring.shortlist.k_mu)
        self.shortlist_head = int(shortlist_head if shortlist_head is not None else scoring.shortlist.k_head)
        self.shortlist_tok = int(shortlist_tok if shortlist_tok is not None else scoring.shortlist.k_tok)
        if min(self.shortlist_w, self.shortlist_mu, self.shortlist_head, self.shortlist_tok) < 0:
            raise ValueError("shortlist sizes must be >= 0")
        if self.shortlist_w + self.shortlist_mu + self.shortlist_tok == 0:
            raise ValueError("shortlist_w, shortlist_mu and shortlist_tok are all 0: nothing to score")
        table = bundle.token_shortlist
        if self.shortlist_tok and (table is None or self.shortlist_tok > table.width):
            have = 0 if table is None else table.width
            raise ValueError(
                f"shortlist_tok={self.shortlist_tok} but bundle {bundle.version} holds {have} labels per token"
            )
        if lexical_weight is None:
            # The lexical score reads the first shortlist_tok labels of each row: none without them.
            lexical_weight = scoring.lexical_weight if self.shortlist_tok else 0.0
        self.lexical_weight = float(lexical_weight)
        if not (self.lexical_weight >= 0.0 and np.isfinite(self.lexical_weight)):
            raise ValueError(f"lexical_weight must be finite and >= 0, got {lexical_weight}")
        if self.lexical_weight and (table is None or table.shares is None or not self.shortlist_tok):
            raise ValueError("lexical_weight > 0 needs a token shortlist with shares and shortlist_tok >= 1")
        self._table = table if self.shortlist_tok else None
        need = max(self.shortlist_w, self.shortlist_mu)
        if ef_search is not None or need > bundle.index_w.ef_search:
            ef = max(ef_search or 0, need)
            bundle.index_w.set_ef(ef)
            bundle.index_mu.set_ef(ef)
        self.encoder = bundle.encoder(threads)
        # Plain ndarray views of the memory maps: same pages, without np.memmap's per-index overhead.
        self._w = np.asarray(bundle.classifiers)
        self._b = np.asarray(bundle.classifier_bias)
        self._mu = np.asarray(bundle.centroids)
        self._head = np.argsort(-self._b, kind="stable")[: self.shortlist_head].astype(np.int64)

    @property
    def version(self) -> str:
        return self.bundle.version

    @property
    def num_labels(self) -> int:
        return self.bundle.manifest.num_labels

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode(texts)[2]

    def _encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Padded token ids [B, T], their weights [B, T] and unit embeddings [B, D]."""
        ids, weights = self.bundle.tokenizer.encode_batch(list(texts))
        return ids, weights, self.encoder.run(ids, weights)

    def _candidates(self, tokens: np.ndarray, q: np.ndarray) -> np.ndarray:
        """[B, C] distinct label ids per row, sorted, -1 padded at the end; C = the longest row."""
        parts = []
        if self.shortlist_w:
            ones = np.ones((len(q), 1), dtype=np.float32)
            parts.append(self.bundle.index_w.search(np.hstack([q, ones]), self.shortlist_w))
        if self.shortlist_mu:
            parts.append(self.bundle.index_mu.search(q, self.shortlist_mu))
        if len(self._head):
            parts.append(np.repeat(self._head[None, :], len(q), axis=0))
        if self._table is not None:
            # Row 0 (padding) is all -1, so padded token slots add nothing.
            parts.append(self._table.candidates(tokens, self.shortlist_tok))
        cands = np.sort(np.hstack(parts), axis=1)
        # Repeats and empty slots move to the end and the columns no row needs are cut: the
        # token rows are mostly padding, and every column left costs two row gathers to score.
        drop = cands < 0
        drop[:, 1:] |= cands[:, 1:] == cands[:, :-1]
        if len(cands) == 1:  # one row: keep what is left, already in order
            return cands[:, ~drop[0]] if not drop[0].all() else np.full((1, 1), -1, dtype=np.int64)
        cands[drop] = _NO_LABEL
        cands.sort(axis=1)
        cands = cands[:, : max(1, int(cands.shape[1] - drop.sum(axis=1).min()))]
        cands[cands == _NO_LABEL] = -1
        return cands

    def shortlist(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The union shortlist S of each text (sorted label ids)."""
        tokens, _, q = self._encode(texts)
        return [row[row >= 0] for row in self._candidates(tokens, q)]

    def _check_alpha(self, alpha: float | None) -> float:
        a = self.alpha if alpha is None else float(alpha)
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        return a

    def lexical_scores(self, tokens: np.ndarray, token_weights: np.ndarray, cands: np.ndarray) -> np.ndarray | None:
        """The lexical score of candidate ids [B, C], or None when lexical_weight is 0."""
        if not self.lexical_weight:
            return None
        return self._table.scores(tokens, token_weights, cands, self.shortlist_tok)

    def score_candidates(
        self, q: np.ndarray, cands: np.ndarray, alpha: float, lexical: np.ndarray | None = None
    ) -> np.ndarray:
        """Combined scores [B, C] of candidate ids [B, C]; -1 entries score -inf."""
        safe = np.maximum(cands, 0)
        if len(q) <= _SCORE_ROWS:
            logits, sims = self._dots(safe, q)
        else:
            # The gathered rows are [rows, C, D] floats: in slices, so a batch of 1000 queries
            # needs ~2 x 9 MB at a time instead of 2 x 135 MB (the serving process's peak RSS).
            logits = np.empty(cands.shape, dtype=np.float32)
            sims = np.empty(cands.shape, dtype=np.float32)
            for start in range(0, len(q), _SCORE_ROWS):
                part = slice(start, start + _SCORE_ROWS)
                logits[part], sims[part] = self._dots(safe[part], q[part])
        logits += self._b[safe]
        scores = combine_scores(logits, sims, alpha, self.f, self.g, lexical, self.lexical_weight)
        scores = scores.astype(np.float32, copy=False)
        scores[cands < 0] = -np.inf
        return scores

    def _dots(self, rows: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """w_l.q and mu_l.q [B, C] for label ids rows [B, C] (no -1) and queries q [B, D]."""
        col = q[:, :, None]
        return (np.matmul(self._w.take(rows, axis=0), col)[:, :, 0],
                np.matmul(self._mu.take(rows, axis=0), col)[:, :, 0])

    def predict_ids(
        self, texts: Sequence[str], k: int = 10, alpha: float | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k label ids int64 [B, k] (-1 where fewer were found) and scores float32 [B, k]."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        a = self._check_alpha(alpha)
        tokens, weights, q = self._encode(texts)
        cands = self._candidates(tokens, q)
        scores = self.score_candidates(q, cands, a, self.lexical_scores(tokens, weights, cands))
        idx, best = top_k(scores, k)
        ids = cands[np.arange(len(cands))[:, None], idx]
        return _pad(ids, best, k)

    def predict_exact_ids(
        self, texts: Sequence[str], k: int = 10, alpha: float | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The same scores over all L labels (brute force): the baseline the shortlist approximates."""
        a = self._check_alpha(alpha)
        tokens, weights, q = self._encode(texts)
        logits = q @ self._w.T + self._b
        sims = q @ self._mu.T
        lexical = None
        if self.lexical_weight:
            lexical = self._table.dense_scores(tokens, weights, self.num_labels, self.shortlist_tok)
        scores = combine_scores(logits, sims, a, self.f, self.g, lexical, self.lexical_weight).astype(np.float32)
        ids, best = top_k(scores, k)
        return _pad(ids, best, k)

    def predict_tree_ids(
        self, texts: Sequence[str], k: int = 10, beam: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        tree = self.bundle.tree
        if tree is None:
            raise LookupError(f"bundle {self.version} has no tree scorer")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if beam is not None and beam < 1:
            raise ValueError(f"beam must be >= 1, got {beam}")
        ids, scores = tree.search(self.encode(texts), k, beam)
        return _pad(np.array(ids, dtype=np.int64), np.array(scores, dtype=np.float32), k)

    def predict(self, texts: Sequence[str], k: int = 10, alpha: float | None = None) -> list[list[Prediction]]:
        return self._named(*self.predict_ids(texts, k, alpha))

    def predict_tree(self, texts: Sequence[str], k: int = 10, beam: int | None = None) -> list[list[Prediction]]:
        return self._named(*self.predict_tree_ids(texts, k, beam))

    def _named(self, ids: np.ndarray, scores: np.ndarray) -> list[list[Prediction]]:
        labels = self.bundle.labels
        return [
            [
                Prediction(int(i), labels.uids[i], labels.titles[i], float(s))
                for i, s in zip(row_ids, row_scores, strict=True)
                if i >= 0
            ]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]


def _pad(ids: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad to width k with id -1; turn -inf (duplicates, empty slots) into -1 as well.

    Changes ids and scores in place: callers pass arrays they have just made.
    """
    ids = ids.astype(np.int64, copy=False)
    scores = scores.astype(np.float32, copy=False)
    invalid = ~np.isfinite(scores)
    if invalid.any():
        ids[invalid] = -1
        scores[invalid] = 0.0
    if ids.shape[1] < k:
        pad = k - ids.shape[1]
        ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
        scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=0.0)
    return ids, scores
