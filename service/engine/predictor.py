"""Prediction over a loaded bundle: tokenise, encode, shortlist, score, top k."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

import numpy as np

from service.engine.bundle import HEAD_MODES, Bundle
from service.engine.scorers import combine_scores, top_k


class Prediction(NamedTuple):
    id: int
    uid: str
    title: str
    score: float


# Per text, label ids never to return (Predictor.predict_ids).
Exclusions = Sequence[Collection[int]]

_SCORE_ROWS = 64  # queries whose candidate rows are gathered at once


class Predictor:
    """Log-time top-k over a bundle (DESIGN.md, "Log-time prediction").

    S = topK_w(HNSW over [w_l, b_l] with query [q, 1]) U topK_mu(HNSW over mu_l) U H U T,
    H = the k_head labels of largest bias b_l (query-independent: the label prior's head),
    in every S (head_mode "always") or only where no query token has a label in the token
    shortlist (head_mode "fallback": the prior answers a text whose words say nothing),
    T = the first k_tok labels of each query token's row of the bundle's token shortlist
    (the labels that token co-occurred with most in training: a lookup, no search);
    score_l = alpha f(w_l.q + b_l) + (1 - alpha) g(mu_l.q) + lambda lex_l for l in S, lex the token
    shortlist's lexical score (lambda = the bundle's lexical_weight, 0 without token weights).

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
        head_mode: str | None = None,
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
        self.head_mode = head_mode if head_mode is not None else scoring.shortlist.head
        if self.head_mode not in HEAD_MODES:
            raise ValueError(f"head_mode must be one of {', '.join(HEAD_MODES)}, got {head_mode!r}")
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
        if self.lexical_weight and (table is None or table.weights is None or not self.shortlist_tok):
            raise ValueError("lexical_weight > 0 needs a token shortlist with weights and shortlist_tok >= 1")
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

    def _shortlist(
        self, tokens: np.ndarray, token_weights: np.ndarray, q: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The union shortlist S of each row as label ids [B, C] (sorted, distinct, -1 padded at
        the end; C = the longest row) and, when lexical_weight > 0, their lexical scores [B, C]."""
        searched = []
        if self.shortlist_w:
            ones = np.ones((len(q), 1), dtype=np.float32)
            searched.append(self.bundle.index_w.search(np.hstack([q, ones]), self.shortlist_w))
        if self.shortlist_mu:
            searched.append(self.bundle.index_mu.search(q, self.shortlist_mu))
        labels = lexical = None
        if self._table is not None:
            # Row 0 (padding) is all -1, so padded token slots add nothing.
            labels, lexical = self._table.entries(
                tokens, self.shortlist_tok, token_weights if self.lexical_weight else None
            )
        head = self._head if len(self._head) else None
        cands, sums = union_shortlist(len(q), searched, head, self.head_mode, labels, lexical, self.num_labels)
        return cands, None if sums is None else self._table.scores(cands, sums)

    def shortlist(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The union shortlist S of each text (sorted label ids)."""
        tokens, weights, q = self._encode(texts)
        return [row[row >= 0] for row in self._shortlist(tokens, weights, q)[0]]

    def _check_alpha(self, alpha: float | None) -> float:
        a = self.alpha if alpha is None else float(alpha)
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        return a

    def score_candidates(
        self, q: np.ndarray, cands: np.ndarray, alpha: float, lexical: np.ndarray | None = None
    ) -> np.ndarray:
        """Combined scores [B, C] of candidate ids [B, C]; -1 entries score -inf."""
        # A single row has -1 slots only when it is empty: skip the masking otherwise.
        padded = len(cands) > 1 or cands[0, 0] < 0
        safe = np.maximum(cands, 0) if padded else cands
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
        if padded:
            scores[cands < 0] = -np.inf
        return scores

    def _dots(self, rows: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """w_l.q and mu_l.q [B, C] for label ids rows [B, C] (no -1) and queries q [B, D]."""
        col = q[:, :, None]
        return (np.matmul(self._w.take(rows, axis=0), col)[:, :, 0],
                np.matmul(self._mu.take(rows, axis=0), col)[:, :, 0])

    def predict_ids(
        self, texts: Sequence[str], k: int = 10, alpha: float | None = None, exclude: Exclusions | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k label ids int64 [B, k] (-1 where fewer were found) and scores float32 [B, k].

        exclude: per text, label ids never to return (the text's own label when texts and labels
        are the same kind of thing, items a user has already); the rest of S is ranked as usual.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        a = self._check_alpha(alpha)
        excluded = self._check_exclude(exclude, len(texts))
        tokens, weights, q = self._encode(texts)
        cands, lexical = self._shortlist(tokens, weights, q)
        scores = self.score_candidates(q, cands, a, lexical)
        if excluded is not None:
            scores[_excluded_mask(cands, excluded)] = -np.inf
        idx, best = top_k(scores, k)
        ids = cands[np.arange(len(cands))[:, None], idx]
        return _pad(ids, best, k)

    def predict_exact_ids(
        self, texts: Sequence[str], k: int = 10, alpha: float | None = None, exclude: Exclusions | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The same scores over all L labels (brute force): the baseline the shortlist approximates."""
        a = self._check_alpha(alpha)
        excluded = self._check_exclude(exclude, len(texts))
        tokens, weights, q = self._encode(texts)
        logits = q @ self._w.T + self._b
        sims = q @ self._mu.T
        lexical = None
        if self.lexical_weight:
            lexical = self._table.dense_scores(tokens, weights, self.num_labels, self.shortlist_tok)
        scores = combine_scores(logits, sims, a, self.f, self.g, lexical, self.lexical_weight).astype(np.float32)
        for row, ids in enumerate(excluded or ()):
            scores[row, ids] = -np.inf
        ids, best = top_k(scores, k)
        return _pad(ids, best, k)

    def predict_tree_ids(
        self, texts: Sequence[str], k: int = 10, beam: int | None = None, exclude: Exclusions | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        tree = self.bundle.tree
        if tree is None:
            raise LookupError(f"bundle {self.version} has no tree scorer")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if beam is not None and beam < 1:
            raise ValueError(f"beam must be >= 1, got {beam}")
        excluded = self._check_exclude(exclude, len(texts))
        if excluded is None:
            ids, scores = tree.search(self.encode(texts), k, beam)
            return _pad(np.array(ids, dtype=np.int64), np.array(scores, dtype=np.float32), k)
        # The best k + |exclusions| leaves hold the best k that are not excluded.
        ids, scores = tree.search(self.encode(texts), k + max(len(x) for x in excluded), beam)
        scores = np.array(scores, dtype=np.float32)
        scores[_excluded_mask(ids, excluded)] = -np.inf
        idx, best = top_k(scores, k)
        return _pad(np.array(ids, dtype=np.int64)[np.arange(len(ids))[:, None], idx], best, k)

    def _check_exclude(self, exclude: Exclusions | None, rows: int) -> list[np.ndarray] | None:
        """exclude as one int64 id array per text; None when nothing is excluded."""
        if exclude is None:
            return None
        if len(exclude) != rows:
            raise ValueError(f"exclude has {len(exclude)} rows for {rows} texts")
        out = []
        for row, ids in enumerate(exclude):
            arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
            if arr.size == 0:
                out.append(np.zeros(0, dtype=np.int64))
                continue
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise ValueError(f"exclude[{row}]: expected a list of integer label ids")
            if arr.min() < 0 or arr.max() >= self.num_labels:
                raise ValueError(f"exclude[{row}]: label ids must be in [0, {self.num_labels})")
            out.append(arr.astype(np.int64, copy=False))
        return out if any(len(ids) for ids in out) else None

    def predict(
        self, texts: Sequence[str], k: int = 10, alpha: float | None = None, exclude: Exclusions | None = None
    ) -> list[list[Prediction]]:
        return self._named(*self.predict_ids(texts, k, alpha, exclude))

    def predict_tree(
        self, texts: Sequence[str], k: int = 10, beam: int | None = None, exclude: Exclusions | None = None
    ) -> list[list[Prediction]]:
        return self._named(*self.predict_tree_ids(texts, k, beam, exclude))

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


def _excluded_mask(ids: np.ndarray, excluded: list[np.ndarray]) -> np.ndarray:
    """True where a row of label ids [B, C] holds one of that row's excluded ids."""
    mask = np.zeros(ids.shape, dtype=bool)
    for row, drop in enumerate(excluded):
        if len(drop):
            mask[row] = np.isin(ids[row], drop)
    return mask


def union_shortlist(
    rows: int,
    searched: list[np.ndarray],
    head: np.ndarray | None,
    head_mode: str,
    token_labels: np.ndarray | None,
    token_terms: np.ndarray | None,
    num_labels: int,
) -> tuple[np.ndarray, np.ndarray | None]:
    """S of each of `rows` queries: the searched ids [rows, k] U the head ids [H] (in every row,
    or with head_mode "fallback" only in rows whose token labels are all -1) U the token
    shortlist's labels [rows, T * k], merged by merge_shortlists with the token terms summed."""
    parts = list(searched)
    if head is not None:
        head = head[None, :]
        if token_labels is not None and head_mode == "fallback":
            unmatched = token_labels.max(axis=1) < 0  # no query token has a label in its row
            if rows == 1:
                head = head if unmatched[0] else None
            else:
                head = np.where(unmatched[:, None], head, -1) if unmatched.any() else None
        if head is not None:
            parts.append(head if len(head) == rows else np.repeat(head, rows, axis=0))
    terms = None
    if token_labels is not None:
        if token_terms is not None:
            # The other sources' slots carry no lexical term.
            width = sum(part.shape[1] for part in parts)
            terms = np.concatenate((np.zeros((rows, width), np.float32), token_terms), axis=1) if width else token_terms
        parts.append(token_labels)
    return merge_shortlists(np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0], terms, num_labels)


def merge_shortlists(
    labels: np.ndarray, terms: np.ndarray | None, num_labels: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Label ids [B, N] (-1 = empty slot, repeats allowed) and their terms [B, N] (or None) ->
    each row's distinct ids [B, C], sorted, -1 padded at the end, and the sum of each id's terms.

    One stable sort of all rows at once (key row * (L + 1) + id + 1), so a text's ids and sums
    are the same alone and in a batch.
    """
    rows = len(labels)
    span = num_labels + 1
    key = np.add(labels, 1, dtype=np.int64)
    if rows > 1:
        key += np.arange(0, rows * span, span, dtype=np.int64)[:, None]
    key = key.ravel()
    if terms is None:
        key = np.sort(key)
    else:
        order = np.argsort(key, kind="stable")
        key = key[order]
    first = np.empty(len(key), dtype=bool)
    first[0] = True
    np.not_equal(key[1:], key[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    groups = key[starts]
    sums = None if terms is None else np.add.reduceat(terms.ravel()[order], starts)
    if rows == 1:
        skip = int(groups[0] == 0)  # the empty slots' group sorts first
        if skip == len(groups):
            return np.full((1, 1), -1, dtype=np.int64), None if sums is None else np.zeros((1, 1), np.float32)
        return (groups[skip:] - 1)[None, :], None if sums is None else sums[skip:][None, :]
    row_of, ids = np.divmod(groups, span)
    keep = ids > 0
    row_of, ids = row_of[keep], ids[keep] - 1
    counts = np.bincount(row_of, minlength=rows)
    cols = np.arange(len(ids)) - np.repeat(np.cumsum(counts) - counts, counts)
    cands = np.full((rows, max(1, int(counts.max()))), -1, dtype=np.int64)
    cands[row_of, cols] = ids
    if sums is None:
        return cands, None
    lexical = np.zeros(cands.shape, dtype=np.float32)
    lexical[row_of, cols] = sums[keep]
    return cands, lexical


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
