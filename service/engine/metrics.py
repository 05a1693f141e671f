"""Ranking metrics for XMC, one module used by training, export evaluation and bench/.

P@k, nDCG@k, PSP@k and PSnDCG@k with Jain et al. (2016) propensities (A=0.55, B=1.5),
the propensity-scored ones normalised by the best achievable value, and recall@K of
a shortlist. Predictions are [N, >=k] arrays of label ids, best first (-1 = no label);
truths are lists of label-id collections.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def propensities(label_freq: np.ndarray, num_train_docs: int, a: float = 0.55, b: float = 1.5) -> np.ndarray:
    """p_l = 1 / (1 + C exp(-A ln(N_l + B))), C = (ln N - 1) (B + 1)^A."""
    c = (np.log(num_train_docs) - 1.0) * (b + 1.0) ** a
    return 1.0 / (1.0 + c * np.exp(-a * np.log(np.asarray(label_freq, dtype=np.float64) + b)))


def label_frequencies(targets: Iterable[Iterable[int]], num_labels: int) -> np.ndarray:
    freq = np.zeros(num_labels, dtype=np.int64)
    for t in targets:
        for label in set(t):
            freq[label] += 1
    return freq


def _discounts(k: int) -> np.ndarray:
    return 1.0 / np.log2(np.arange(2, k + 2))


def document_terms(
    predictions: np.ndarray,
    truths: Sequence[Iterable[int]],
    ks: Sequence[int] = (1, 3, 5),
    inv_propensity: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Each document's share of the metrics, float64 [N] per name: P@k and nDCG@k (a metric is
    their mean); with inv_propensity, PSP@k / PSnDCG@k gains and their best achievable values
    ("PSP@k:best", ...) (a metric is sum of gains / sum of bests). `aggregate` turns them into
    ranking_metrics' numbers, over all documents or a resample of them."""
    kmax = max(ks)
    preds = np.asarray(predictions)
    if preds.ndim != 2 or len(preds) != len(truths):
        raise ValueError("predictions must be [N, k] with one row per truth")
    if preds.shape[1] < kmax:
        preds = np.pad(preds, ((0, 0), (0, kmax - preds.shape[1])), constant_values=-1)
    disc = _discounts(kmax)
    names = [f"{m}@{k}" for k in ks for m in ("P", "nDCG")]
    if inv_propensity is not None:
        names += [f"{m}@{k}{part}" for k in ks for m in ("PSP", "PSnDCG") for part in ("", ":best")]
    out = {name: np.zeros(len(preds)) for name in names}
    for i, (row, truth) in enumerate(zip(preds, truths, strict=True)):
        tset = set(truth)
        hits = np.array([1.0 if int(p) in tset else 0.0 for p in row[:kmax]])
        for k in ks:
            out[f"P@{k}"][i] = hits[:k].sum() / k
            ideal = disc[: min(k, len(tset))].sum()
            if ideal > 0:
                out[f"nDCG@{k}"][i] = (hits[:k] * disc[:k]).sum() / ideal
        if inv_propensity is not None:
            gains = np.array([inv_propensity[int(p)] if h else 0.0 for p, h in zip(row[:kmax], hits, strict=True)])
            best = np.sort(np.array([inv_propensity[t] for t in tset]))[::-1] if tset else np.zeros(0)
            for k in ks:
                out[f"PSP@{k}"][i] = gains[:k].sum() / k
                out[f"PSP@{k}:best"][i] = best[:k].sum() / k
                out[f"PSnDCG@{k}"][i] = (gains[:k] * disc[:k]).sum()
                out[f"PSnDCG@{k}:best"][i] = (best[:k] * disc[: len(best[:k])]).sum()
    return out


def aggregate(
    terms: dict[str, np.ndarray], rows: np.ndarray | None = None, names: Sequence[str] | None = None
) -> dict[str, float]:
    """The metrics (all, or `names`), in percent, of `document_terms` over all documents or the
    given rows (indices, repeats allowed: a bootstrap resample)."""
    pick = (lambda a: a) if rows is None else (lambda a: a[rows])
    out: dict[str, float] = {}
    for name, values in terms.items():
        if name.endswith(":best") or (names is not None and name not in names):
            continue
        if name.startswith("PS"):
            best = pick(terms[name + ":best"]).sum()
            out[name] = 100.0 * pick(values).sum() / best if best else 0.0
        else:
            out[name] = 100.0 * pick(values).mean() if len(pick(values)) else 0.0
    return out


def ranking_metrics(
    predictions: np.ndarray,
    truths: Sequence[Iterable[int]],
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
