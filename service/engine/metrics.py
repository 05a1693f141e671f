"""Ranking metrics for XMC, one module used by training, export evaluation and bench/.

P@k, nDCG@k, PSP@k and PSnDCG@k with Jain et al. (2016) propensities (A=0.55, B=1.5),
the propensity-scored ones normalised by the best achievable value, and recall@K of
a shortlist. Predictions are [N, >=k] arrays of label ids, best first (-1 = no label);
truths are lists of label-id collections (or Truths, which may weigh each label).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np


def propensities(label_freq: np.ndarray, num_train_docs: int, a: float = 0.55, b: float = 1.5) -> np.ndarray:
    """p_l = 1 / (1 + C exp(-A ln(N_l + B))), C = (ln N - 1) (B + 1)^A."""
    c = (np.log(num_train_docs) - 1.0) * (b + 1.0) ** a
    return 1.0 / (1.0 + c * np.exp(-a * np.log(np.asarray(label_freq, dtype=np.float64) + b)))


def label_frequencies(targets: Iterable[Iterable[int]], num_labels: int,
                      weights: Iterable[Iterable[float]] | None = None) -> np.ndarray:
    """Per label, how many documents carry it; with weights (each target's, in (0, 1]: how sure
    it is, as imputed from group labels) the expected number, the sum of its weights."""
    if weights is not None:
        freq = np.zeros(num_labels, dtype=np.float64)
        for t, w in zip(targets, weights, strict=True):
            for label, x in dict(zip(t, w, strict=True)).items():
                freq[label] += x
        return freq
    freq = np.zeros(num_labels, dtype=np.int64)
    for t in targets:
        for label in set(t):
            freq[label] += 1
    return freq


def _discounts(k: int) -> np.ndarray:
    return 1.0 / np.log2(np.arange(2, k + 2))


class Truths:
    """Each document's true labels (a set per document), indexed once so that many rankings of
    the same documents (a tuning grid, a bootstrap) are scored without a loop over documents.

    weights (optional, per document one per label, in (0, 1]): how sure each true label is (labels
    imputed from group labels, training/aggregated.py). A hit then gains its weight, so P@k is its
    expected value with each label carried with that probability, and the bests (nDCG's ideal,
    PSP's) are the largest weights; without weights every label weighs 1."""

    def __init__(self, truths: Sequence[Iterable[int]], inv_propensity: np.ndarray | None = None,
                 weights: Sequence[Iterable[float]] | None = None) -> None:
        labels, values = _truth_arrays(truths, weights)
        self.sizes = np.array([len(t) for t in labels], dtype=np.int64)
        docs = np.repeat(np.arange(len(labels), dtype=np.int64), self.sizes)
        self._labels = np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64)
        self._values = np.concatenate(values) if values else np.ones(len(self._labels))
        self.span = int(self._labels.max()) + 1 if len(self._labels) else 1
        self._keys = docs * self.span + self._labels  # sorted: by document, then label
        self.inv_propensity = inv_propensity
        self._docs = docs
        self._best: dict[tuple[str, int], np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.sizes)

    def gains(self, predictions: np.ndarray) -> np.ndarray:
        """float64 [N, K]: each predicted label's weight as a truth of its document (0: not one)."""
        if not len(self._keys):
            return np.zeros(predictions.shape, dtype=np.float64)
        valid = (predictions >= 0) & (predictions < self.span)
        keys = np.arange(len(predictions), dtype=np.int64)[:, None] * self.span + np.where(valid, predictions, 0)
        at = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
        return np.where(valid & (self._keys[at] == keys), self._values[at], 0.0)

    def best_gains(self, kmax: int) -> np.ndarray:
        """float64 [N, kmax]: each document's largest inverse propensities (times weights),
        largest first, 0 padded."""
        return self._largest("psp", np.asarray(self.inv_propensity, dtype=np.float64)[self._labels] * self._values,
                             kmax)

    def best_hits(self, kmax: int) -> np.ndarray:
        """float64 [N, kmax]: each document's largest weights (1 each without weights), 0 padded."""
        return self._largest("hits", self._values, kmax)

    def _largest(self, name: str, values: np.ndarray, kmax: int) -> np.ndarray:
        if (name, kmax) in self._best:
            return self._best[name, kmax]
        order = np.lexsort((-values, self._docs))
        rank = np.arange(len(order)) - np.repeat(np.cumsum(self.sizes) - self.sizes, self.sizes)
        out = np.zeros((len(self), kmax))
        keep = rank < kmax
        out[self._docs[order][keep], rank[keep]] = values[order][keep]
        self._best[name, kmax] = out
        return out


def _truth_arrays(truths: Sequence[Iterable[int]], weights: Sequence[Iterable[float]] | None
                  ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per document its distinct labels, sorted, and their weights (none without weights: each 1;
    a label given twice keeps its first weight)."""
    if weights is None:
        return [np.unique(np.fromiter(t, dtype=np.int64)) for t in truths], []
    if len(weights) != len(truths):
        raise ValueError(f"{len(weights)} rows of weights for {len(truths)} rows of truths")
    labels, values = [], []
    for t, w in zip(truths, weights, strict=True):
        ids, x = np.fromiter(t, dtype=np.int64), np.fromiter(w, dtype=np.float64)
        if len(ids) != len(x):
            raise ValueError(f"a document with {len(ids)} labels and {len(x)} weights")
        ids, first = np.unique(ids, return_index=True)
        labels.append(ids)
        values.append(x[first])
    return labels, values


def document_terms(
    predictions: np.ndarray,
    truths: Sequence[Iterable[int]] | Truths,
    ks: Sequence[int] = (1, 3, 5),
    inv_propensity: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Each document's share of the metrics, float64 [N] per name: P@k and nDCG@k (a metric is
    their mean); with inv_propensity (or Truths built with it), PSP@k / PSnDCG@k gains and their
    best achievable values ("PSP@k:best", ...) (a metric is sum of gains / sum of bests).
    `aggregate` turns them into ranking_metrics' numbers, over all documents or a resample."""
    if not isinstance(truths, Truths):
        truths = Truths(truths, inv_propensity)
    kmax = max(ks)
    preds = np.asarray(predictions)
    if preds.ndim != 2 or len(preds) != len(truths):
        raise ValueError("predictions must be [N, k] with one row per truth")
    if preds.shape[1] < kmax:
        preds = np.pad(preds, ((0, 0), (0, kmax - preds.shape[1])), constant_values=-1)
    preds = preds[:, :kmax]
    disc = _discounts(kmax)
    hits, ideal = truths.gains(preds), truths.best_hits(kmax)
    out: dict[str, np.ndarray] = {}
    for k in ks:
        out[f"P@{k}"] = hits[:, :k].sum(axis=1) / k
        best = (ideal[:, :k] * disc[:k]).sum(axis=1)
        out[f"nDCG@{k}"] = np.divide((hits[:, :k] * disc[:k]).sum(axis=1), best, out=np.zeros(len(preds)),
                                     where=best > 0)
    if truths.inv_propensity is not None:
        inv = np.asarray(truths.inv_propensity, dtype=np.float64)
        gains = hits * inv[np.maximum(preds, 0)]
        best = truths.best_gains(kmax)
        for k in ks:
            out[f"PSP@{k}"] = gains[:, :k].sum(axis=1) / k
            out[f"PSP@{k}:best"] = best[:, :k].sum(axis=1) / k
            out[f"PSnDCG@{k}"] = (gains[:, :k] * disc[:k]).sum(axis=1)
            out[f"PSnDCG@{k}:best"] = (best[:, :k] * disc[:k]).sum(axis=1)
    return out


def aggregate(
    terms: dict[str, np.ndarray], rows: np.ndarray | None = None, names: Sequence[str] | None = None
) -> dict[str, float]:
    """The metrics (all, or `names`), in percent, of `document_terms` over all documents or the
    given rows (indices, repeats allowed: a bootstrap resample)."""
    n = len(next(iter(terms.values()))) if terms else 0
    counts = np.ones((1, n)) if rows is None else np.bincount(np.asarray(rows), minlength=n)[None, :]
    return {name: float(values[0]) for name, values in resampled_metrics(terms, counts, names).items()}


def resampled_metrics(
    terms: dict[str, np.ndarray], counts: np.ndarray, names: Sequence[str] | None = None
) -> dict[str, np.ndarray]:
    """The metrics (all, or `names`), in percent, of `document_terms` on each of R resamples of
    the documents, float64 [R] per name; counts [R, N]: how often each document is drawn in each
    (a paired bootstrap scores every system on the same counts). P@k, nDCG@k: the mean over the
    drawn documents; PSP@k, PSnDCG@k: the sum of their gains over the sum of their bests."""
    counts = np.asarray(counts, dtype=np.float64)
    out: dict[str, np.ndarray] = {}
    for name, values in terms.items():
        if name.endswith(":best") or (names is not None and name not in names):
            continue
        total = counts @ (terms[name + ":best"] if name.startswith("PS") else np.ones(len(values)))
        out[name] = 100.0 * np.divide(counts @ values, total, out=np.zeros(len(counts)), where=total > 0)
    return out


def ranking_metrics(
    predictions: np.ndarray,
    truths: Sequence[Iterable[int]] | Truths,
    ks: Sequence[int] = (1, 3, 5),
    inv_propensity: np.ndarray | None = None,
) -> dict[str, float]:
    """Mean P@k and nDCG@k (and PSP@k, PSnDCG@k when inv_propensity is given), in percent."""
    return aggregate(document_terms(predictions, truths, ks, inv_propensity))


def paired_bootstrap(
    terms_a: dict[str, np.ndarray],
    terms_b: dict[str, np.ndarray],
    names: Sequence[str],
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, tuple[float, float, float]]:
    """Metric of system a minus system b on the same documents, with a paired bootstrap
    interval: per name (difference, low, high) in points. Both systems are scored on each
    resample of the documents, so what the two share (the documents' difficulty) cancels."""
    if resamples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"resamples must be >= 1 and level in (0, 1), got {resamples} and {level}")
    missing = [name for name in names if name not in terms_a or name not in terms_b]
    if missing:
        raise ValueError(f"no terms for {', '.join(missing)}")
    n = len(next(iter(terms_a.values())))
    if any(len(v) != n for v in (*terms_a.values(), *terms_b.values())):
        raise ValueError("both systems must be scored on the same documents")
    rng = np.random.default_rng(seed)
    full_a, full_b = aggregate(terms_a), aggregate(terms_b)
    draws = {name: np.empty(resamples) for name in names}
    for r in range(resamples):
        rows = rng.integers(0, n, n)
        a, b = aggregate(terms_a, rows, names), aggregate(terms_b, rows, names)
        for name in names:
            draws[name][r] = a[name] - b[name]
    tail = 100.0 * (1.0 - level) / 2.0
    out = {}
    for name in names:
        low, high = np.percentile(draws[name], [tail, 100.0 - tail])
        out[name] = (float(full_a[name] - full_b[name]), float(low), float(high))
    return out


def shortlist_recall(shortlists: Sequence[Iterable[int]], truths: Sequence[Iterable[int]]) -> float:
    """Mean fraction of each document's true labels present in its shortlist, in percent."""
    total, n = 0.0, 0
    for short, truth in zip(shortlists, truths, strict=True):
        tset = set(truth)
        if not tset:
            continue
        total += len(tset & set(int(x) for x in short)) / len(tset)
        n += 1
    return 100.0 * total / n if n else 0.0


class AnswerableTruths(NamedTuple):
    """Truths a bundle can still answer (answerable_truths)."""

    truths: list[list[int]]  # each document's truths, its retired labels left out
    scored: np.ndarray  # bool [N]: False for a document whose every truth is retired
    truths_left_out: int  # retired labels among all the documents' truths
    weights: list[list[float]] | None  # the kept truths' weights (None when none were given)


def answerable_truths(truths: Sequence[Iterable[int]], retired: np.ndarray | None,
                      weights: Sequence[Sequence[float]] | None = None) -> AnswerableTruths:
    """Each document's truths without the labels a bundle retired (`retired`: Bundle.retired, True
    per retired label row, None when none is), and their `weights` with them. A retired label is
    never answered, so as a truth it measures the operator's retirement, not the bundle: the
    quality gate scores only what is left, and `shortlist eval` counts them. A document whose every
    truth is retired is not `scored`; one with no truth to begin with is (as it would be without
    retirements)."""
    kept: list[list[int]] = []
    kept_weights: list[list[float]] | None = None if weights is None else []
    scored = np.ones(len(truths), dtype=bool)
    left_out = 0
    for i, truth in enumerate(truths):
        labels = [int(t) for t in truth]
        live = [j for j, t in enumerate(labels) if retired is None or not retired[t]]
        kept.append([labels[j] for j in live])
        if kept_weights is not None:
            kept_weights.append([float(weights[i][j]) for j in live])
        left_out += len(labels) - len(live)
        scored[i] = bool(live) or not labels
    return AnswerableTruths(kept, scored, left_out, kept_weights)
