"""The activation's quality gate (QUALITY_GATE_MIN_P1): a bundle's P@1 on the validation rows it
stores, scored on the truths it can answer, against the operator's floor; for a sharded version
(service.api.ray_app) the rows its shards store, answered by the shards merged."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from service.api.activation import ActivationFailed
from service.engine.metrics import Truths, answerable_truths, ranking_metrics
from service.engine.predictor import Predictor
from service.engine.validation_rows import validation_truths


def gate_scores(texts: list[str], truths: list[list[int]], retired: np.ndarray | None,
                top5: Callable[[list[str]], np.ndarray], weights: list[list[float]] | None = None) -> dict[str, float]:
    """The quality gate's P@1/P@5 (nDCG@1/5) on validation rows (`texts` and their `truths`, a
    truth counting its weight when `weights` are given: a label imputed from a group's labels, at
    its posterior, as training chose the bundle's scoring by), as `top5` answers them (label ids
    [n, 5], -1 where fewer), scored on the truths the bundle can
    answer: a retired label (`retired`: True per retired label id) is never answered, and counting
    it as a missed truth refused retirements as quality failures (P@1 72 -> 58 on 120 of 300 labels
    retired). A row whose every truth is retired is not scored; the counts of what was left out are
    in the result."""
    answerable = answerable_truths(truths, retired, weights)
    keep = np.flatnonzero(answerable.scored)
    scores: dict[str, float] = {"validation_rows": float(len(keep)),
                                "validation_rows_left_out": float(len(texts) - len(keep)),
                                "retired_truths_left_out": float(answerable.truths_left_out)}
    if len(keep):
        ids = top5([texts[i] for i in keep])
        kept = Truths([answerable.truths[i] for i in keep],
                      weights=None if answerable.weights is None else [answerable.weights[i] for i in keep])
        scores.update((k, float(v)) for k, v in ranking_metrics(ids, kept, ks=(1, 5)).items())
    else:
        scores["P@1"] = 0.0
    return scores


def require_quality(where: str, texts: list[str], truths: list[list[int]], retired: np.ndarray | None,
                    top5: Callable[[list[str]], np.ndarray], min_p1: float,
                    weights: list[list[float]] | None = None) -> dict[str, float]:
    """gate_scores, or ActivationFailed naming `where` when there are no validation rows, none keeps
    a truth the bundle can answer, or the P@1 is below min_p1."""
    if not texts:
        raise ActivationFailed(f"{where}: quality gate is on (min P@1 {min_p1}) but the bundle stores no "
                               "validation rows")
    scores = gate_scores(texts, truths, retired, top5, weights)
    p1, scored = float(scores["P@1"]), int(scores["validation_rows"])
    if scored == 0 or p1 < min_p1:
        measured = (f"P@1 {p1:.2f} on {scored} validation rows" if scored else
                    "no validation row has a truth the bundle can answer")
        raise ActivationFailed(f"{where}: quality gate failed: {measured}{_left_out(scores)}, "
                               f"the floor is {min_p1:.2f}")
    return scores


def check_quality(predictor: Predictor, min_p1: float) -> dict[str, float]:
    """require_quality of the predictor's bundle on the validation rows it stores (the bundle closed
    when refused)."""
    bundle = predictor.bundle
    rows = bundle.validation_rows()
    truths, weights = validation_truths(rows)
    try:
        return require_quality(str(bundle.path), [str(r["text"]) for r in rows], truths, bundle.retired,
                               lambda texts: predictor.predict_ids(texts, k=5)[0], min_p1, weights)
    except ActivationFailed:
        bundle.close()
        raise


def _left_out(scores: dict[str, float]) -> str:
    """What the gate left out, for its refusal ("" when nothing was)."""
    rows, truths = int(scores["validation_rows_left_out"]), int(scores["retired_truths_left_out"])
    if not truths:
        return ""
    return f" ({truths} retired truths left out, {rows} rows with only retired truths not scored)"
