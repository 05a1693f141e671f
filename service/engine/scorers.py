"""The scoring contract: calibrations, the alpha combination, and the label scorer.

score_l = alpha * f(w_l . q + b_l) + (1 - alpha) * g(mu_l . q) + lambda * lex_l
(lex: the token shortlist's lexical score, service/engine/lexical.py; lambda 0 without one)

One definition, used by serving (over a shortlist), exact scoring over all labels (evaluation,
benchmarks, training's test metrics) and training's tuning of alpha, f, g and lambda.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from service.engine.schema import CalibrationKind, CalibrationSpec, Scoring
from service.engine.vectors import as_float32

_SORT_WHOLE_ROWS = 256  # top_k sorts rows this short outright
_GATHER_ROWS = 64  # queries whose candidate rows are gathered at once
# ...and at most this many candidate rows (at least one query's): [rows, C, D] float32, 256 KiB at
# D = 256 (a batch's C is its longest row: a 64-token text's token shortlist alone holds 640
# labels). With the float16 rows and as_float32's intp indices ~900 KiB at a time, so a slice's
# pieces stay in a core's L2 cache (2 MiB here) between the gather, the cast and the product:
# debian-deps, 16-text batches, 115 -> 65 us a text at 4,096 rows (memory once 64 rows of C = 640 took 110 MiB).
_GATHER_AT_ONCE = 256
EXACT_CHUNK = 512  # queries scored against all labels at once, at most
# ...and at most this many (query, label) scores at once: [chunk, L] float32 arrays of 128 MiB
# (a few live at a time), so exact scoring of 10^6 labels does not need gigabytes.
EXACT_SCORES_AT_ONCE = 1 << 25


@dataclass(frozen=True)
class Calibration:
    """f(x) = act(a * x + b) with act in {sigmoid, exp, identity}.

    The reference SiameseXML code uses sigmoid for centroids and exp(5 (x - 1)) for
    classifiers, which is Calibration("exp", a=5.0, b=-5.0).
    """

    kind: CalibrationKind = "sigmoid"
    a: float = 1.0
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("sigmoid", "exp", "identity"):
            raise ValueError(f"unknown calibration kind {self.kind!r}")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        z = np.asarray(x, dtype=np.float32)
        if self.a != 1.0 or self.b != 0.0:
            z = self.a * z + self.b
        # In place on the first array made here (the same operations as the formulas in the
        # comments, without a temporary array per step: this runs on every query).
        if self.kind == "sigmoid":
            # 1 / (1 + exp(-max(z, -60))): floored so exp(-z) never overflows; above +60 the
            # float32 result is 1.0 either way.
            t = np.maximum(z, -60.0)
            np.negative(t, out=t)
            np.exp(t, out=t)
            t += 1.0
            return np.divide(1.0, t, out=t)
        if self.kind == "exp":
            t = np.minimum(z, 60.0)
            return np.exp(t, out=t)
        return z

    @classmethod
    def of(cls, spec: CalibrationSpec) -> Calibration:
        return cls(spec.kind, spec.a, spec.b)

    def spec(self) -> CalibrationSpec:
        return CalibrationSpec(kind=self.kind, a=self.a, b=self.b)


def combine_scores(
    classifier_logits: np.ndarray,
    centroid_sims: np.ndarray,
    alpha: float,
    f: Calibration,
    g: Calibration,
    lexical: np.ndarray | None = None,
    lexical_weight: float = 0.0,
) -> np.ndarray:
    """alpha * f(w.q + b) + (1 - alpha) * g(mu.q) + lexical_weight * lexical, elementwise."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        scores = f(classifier_logits)
    elif alpha == 0.0:
        scores = g(centroid_sims)
    else:
        scores = _owned(f(classifier_logits), classifier_logits)
        scores *= alpha  # alpha * f + (1 - alpha) * g, without temporaries
        centroid = _owned(g(centroid_sims), centroid_sims)
        centroid *= 1.0 - alpha
        scores += centroid
    if lexical is not None and lexical_weight:
        scores = scores + lexical_weight * lexical
    return scores


def _owned(values: np.ndarray, given: np.ndarray) -> np.ndarray:
    """`values`, or a copy when it is the caller's array `given` (an identity calibration)."""
    return values.copy() if values is given else values


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise top k of a dense [B, N] score matrix: (indices, scores), best first."""
    k = min(k, scores.shape[1])
    # Index arrays rather than np.take_along_axis: same result, a third of the per-call overhead.
    rows = np.arange(scores.shape[0])[:, None]
    if scores.shape[1] <= _SORT_WHOLE_ROWS:
        # A shortlist's few dozen scores: one sort costs less than partition + sort.
        # Array methods, not the np.* functions: the same calls without their Python wrappers.
        order = (-scores).argsort(axis=1, kind="stable")[:, :k]
        return order, scores[rows, order]
    part = (-scores).argpartition(k - 1, axis=1)[:, :k]
    part_scores = scores[rows, part]
    order = (-part_scores).argsort(axis=1, kind="stable")
    return part[rows, order], part_scores[rows, order]


def exact_chunk(num_labels: int) -> int:
    """Queries scored against all num_labels labels at once."""
    return max(1, min(EXACT_CHUNK, EXACT_SCORES_AT_ONCE // max(num_labels, 1)))


class LabelScorer:
    """The combined score of labels for query embeddings, over a shortlist or over all labels.

    w [L, D], b [L], mu [L, D] as a bundle stores them (float32, float16, or int8 with the per-row
    scales w_scales, mu_scales [L]: service.engine.vectors; plain arrays or memory maps); f, g the
    calibrations; lexical_weight the lambda of the lexical term (its values come from the caller).
    """

    def __init__(
        self, w: np.ndarray, b: np.ndarray, mu: np.ndarray, f: Calibration, g: Calibration, lexical_weight: float = 0.0,
        w_scales: np.ndarray | None = None, mu_scales: np.ndarray | None = None,
    ) -> None:
        # Plain ndarray views of memory maps: same pages, without np.memmap's per-index overhead.
        self.w, self.b, self.mu = np.asarray(w), np.asarray(b), np.asarray(mu)
        self.w_scales = None if w_scales is None else np.asarray(w_scales, dtype=np.float32)
        self.mu_scales = None if mu_scales is None else np.asarray(mu_scales, dtype=np.float32)
        self.f, self.g = f, g
        self.lexical_weight = float(lexical_weight)

    @classmethod
    def of(cls, w: np.ndarray, b: np.ndarray, mu: np.ndarray, scoring: Scoring,
           scales: tuple[np.ndarray | None, np.ndarray | None] = (None, None)) -> LabelScorer:
        cal = scoring.calibration
        return cls(w, b, mu, Calibration.of(cal.classifier), Calibration.of(cal.centroid), scoring.lexical_weight,
                   *scales)

    @property
    def num_labels(self) -> int:
        return len(self.b)

    def dots(self, q: np.ndarray, cands: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """w_l.q + b_l and mu_l.q [B, C] for candidate ids [B, C] (-1 entries: any value)."""
        # A single row has -1 slots only when it is empty: the single-query path skips the copy.
        safe = np.maximum(cands, 0) if len(cands) > 1 or cands[0, 0] < 0 else cands
        step = max(1, min(_GATHER_ROWS, _GATHER_AT_ONCE // cands.shape[1]))
        if len(q) <= step:
            logits, sims = self._dots(safe, q)
        else:
            # The gathered rows are [rows, C, D] floats: in slices, so a batch of 1000 queries
            # needs ~2 x 8 MB at a time instead of 2 x 135 MB or more.
            logits = np.empty(cands.shape, dtype=np.float32)
            sims = np.empty(cands.shape, dtype=np.float32)
            for start in range(0, len(q), step):
                part = slice(start, start + step)
                logits[part], sims[part] = self._dots(safe[part], q[part])
        logits += self.b[safe]
        return logits, sims

    def _dots(self, rows: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # float16 or int8 vectors (a bundle's vector_dtype): the gathered rows are scored in float32.
        col = q[:, :, None]
        return _gathered_dots(self.w, self.w_scales, rows, col), _gathered_dots(self.mu, self.mu_scales, rows, col)

    def score(self, q: np.ndarray, cands: np.ndarray, alpha: float, lexical: np.ndarray | None = None) -> np.ndarray:
        """Combined scores float32 [B, C] of candidate ids [B, C]; -1 entries score -inf."""
        logits, sims = self.dots(q, cands)
        scores = combine_scores(logits, sims, alpha, self.f, self.g, lexical, self.lexical_weight)
        scores = scores.astype(np.float32, copy=False)
        if len(cands) > 1 or cands[0, 0] < 0:
            scores[cands < 0] = -np.inf
        return scores

    def exact_top_k(
        self,
        q: np.ndarray,
        k: int,
        alpha: float,
        lexical: Callable[[slice], np.ndarray] | None = None,
        exclude: list[np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top k over ALL labels (brute force, exact_chunk(L) queries at a time): ids int64 [B, k]
        and scores float32 [B, k]. lexical(rows) gives the dense lexical scores [rows, L] of a
        slice of the queries; exclude, per query, label ids never returned (scored -inf)."""
        k = min(k, self.num_labels)
        ids = np.empty((len(q), k), dtype=np.int64)
        best = np.empty((len(q), k), dtype=np.float32)
        chunk = exact_chunk(self.num_labels)
        for start in range(0, len(q), chunk):
            part = slice(start, start + chunk)
            logits = _times_rows(q[part], self.w, self.w_scales) + self.b
            sims = _times_rows(q[part], self.mu, self.mu_scales)
            lex = lexical(part) if lexical is not None and self.lexical_weight else None
            scores = combine_scores(logits, sims, alpha, self.f, self.g, lex, self.lexical_weight)
            scores = scores.astype(np.float32, copy=False)
            for row, drop in enumerate((exclude or [])[part]):
                scores[row, drop] = -np.inf
            ids[part], best[part] = top_k(scores, k)
        return ids, best


_ROWS_CAST_AT_ONCE = 1 << 16


def _gathered_dots(m: np.ndarray, scales: np.ndarray | None, rows: np.ndarray, col: np.ndarray) -> np.ndarray:
    """m_r . q [B, C] for the rows `rows` [B, C] of m and queries col [B, D, 1]."""
    dots = np.matmul(as_float32(m.take(rows, axis=0)), col)[:, :, 0]
    if scales is not None:
        dots *= scales.take(rows)
    return dots


def _times_rows(q: np.ndarray, m: np.ndarray, scales: np.ndarray | None = None) -> np.ndarray:
    """q @ m.T in float32 (times each row's scale); rows of a float16 or int8 m are cast a block
    at a time, not all L at once."""
    if m.dtype == np.float32 and scales is None:
        return q @ m.T
    out = np.empty((len(q), len(m)), dtype=np.float32)
    for start in range(0, len(m), _ROWS_CAST_AT_ONCE):
        block = m[start : start + _ROWS_CAST_AT_ONCE].astype(np.float32)
        out[:, start : start + len(block)] = q @ block.T
        if scales is not None:
            out[:, start : start + len(block)] *= scales[start : start + len(block)]
    return out
