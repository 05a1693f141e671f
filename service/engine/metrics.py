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


def ranking_metrics(
    predictions: np.ndarray,
    truths: Sequence[Iterable[int]],
    ks: Sequence[int] = (1, 3, 5),
    inv_propensity: np.ndarray | None = None,
) -> dict[str, float]:
    """Mean P@k and nDCG@k (and PSP@k, PSnDCG@k when inv_propensity is given), in percent."""
    kmax = max(ks)
    preds = np.asarray(predictions)
    if preds.ndim != 2 or len(preds) != len(truths):
        raise ValueError("predictions must be [N, k] with one row per truth")
    if preds.shape[1] < kmax:
        preds = np.pad(preds, ((0, 0), (0, kmax - preds.shape[1])), constant_values=-1)
    disc = _discounts(kmax)
    sums = {name: 0.0 for k in ks for name in (f"P@{k}", f"nDCG@{k}")}
    if inv_propensity is not None:
        sums.update({name: 0.0 for k in ks for name in (f"PSP@{k}", f"PSnDCG@{k}")})
        ps_best = {k: 0.0 for k in ks}
        psdcg_best = {k: 0.0 for k in ks}
    for row, truth in zip(preds, truths, strict=True):
        tset = set(truth)
        hits = np.array([1.0 if int(p) in tset else 0.0 for p in row[:kmax]])
        for k in ks:
            sums[f"P@{k}"] += hits[:k].sum() / k
            ideal = disc[: min(k, len(tset))].sum()
            if ideal > 0:
                sums[f"nDCG@{k}"] += (hits[:k] * disc[:k]).sum() / ideal
        if inv_propensity is not None:
            gains = np.array([inv_propensity[int(p)] if h else 0.0 for p, h in zip(row[:kmax], hits, strict=True)])
            best = np.sort(np.array([inv_propensity[t] for t in tset]))[::-1] if tset else np.zeros(0)
            for k in ks:
                sums[f"PSP@{k}"] += gains[:k].sum() / k
                ps_best[k] += best[:k].sum() / k
                sums[f"PSnDCG@{k}"] += (gains[:k] * disc[:k]).sum()
                psdcg_best[k] += (best[:k] * disc[: len(best[:k])]).sum()
    n = max(len(truths), 1)
    out = {name: 100.0 * s / n for name, s in sums.items() if not name.startswith("PS")}
    if inv_propensity is not None:
        for k in ks:
            out[f"PSP@{k}"] = 100.0 * sums[f"PSP@{k}"] / ps_best[k] if ps_best[k] else 0.0
            out[f"PSnDCG@{k}"] = 100.0 * sums[f"PSnDCG@{k}"] / psdcg_best[k] if psdcg_best[k] else 0.0
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
