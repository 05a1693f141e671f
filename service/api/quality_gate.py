"""The activation's quality gate (QUALITY_GATE_MIN_P1): a bundle's P@1 on the validation rows it
stores, scored on the truths it can answer, against the operator's floor."""

from __future__ import annotations

import numpy as np

from service.api.activation import ActivationFailed
from service.engine.metrics import answerable_truths, ranking_metrics
from service.engine.predictor import Predictor


def gate_scores(predictor: Predictor, rows: list[dict]) -> dict[str, float]:
    """The quality gate's P@1/P@5 (nDCG@1/5) of the bundle on its validation rows, scored on the
    truths it can answer: a retired label is never answered, and counting it as a missed truth
    refused retirements as quality failures (P@1 72 -> 58 on 120 of 300 labels retired). A row
    whose every truth is retired is not scored; the counts of what was left out are in the result."""
    retired = predictor.bundle.retired
    answerable = answerable_truths([r["target_ind"] for r in rows], retired)
    keep = np.flatnonzero(answerable.scored)
    scores: dict[str, float] = {"validation_rows": float(len(keep)),
                                "validation_rows_left_out": float(len(rows) - len(keep)),
                                "retired_truths_left_out": float(answerable.truths_left_out)}
    if len(keep):
        ids, _ = predictor.predict_ids([str(rows[i]["text"]) for i in keep], k=5)
        truths = [np.asarray(answerable.truths[i], dtype=np.int64) for i in keep]
        scores.update((k, float(v)) for k, v in ranking_metrics(ids, truths, ks=(1, 5)).items())
    else:
        scores["P@1"] = 0.0
    return scores


def check_quality(predictor: Predictor, min_p1: float) -> dict[str, float]:
    """gate_scores of the predictor's bundle, or ActivationFailed (the bundle closed) when it
    stores no validation rows, none keeps a truth it can answer, or its P@1 is below min_p1."""
    bundle = predictor.bundle
    rows = bundle.validation_rows()
    if not rows:
        bundle.close()
        raise ActivationFailed(f"{bundle.path}: quality gate is on (min P@1 {min_p1}) "
                               "but the bundle stores no validation rows")
    scores = gate_scores(predictor, rows)
    p1, scored = float(scores["P@1"]), int(scores["validation_rows"])
    if scored == 0 or p1 < min_p1:
        bundle.close()
        measured = (f"P@1 {p1:.2f} on {scored} validation rows" if scored else
                    "no validation row has a truth the bundle can answer")
        raise ActivationFailed(f"{bundle.path}: quality gate failed: {measured}{_left_out(scores)}, "
                               f"the floor is {min_p1:.2f}")
    return scores


def _left_out(scores: dict[str, float]) -> str:
    """What the gate left out, for its refusal ("" when nothing was)."""
    rows, truths = int(scores["validation_rows_left_out"]), int(scores["retired_truths_left_out"])
    if not truths:
        return ""
    return f" ({truths} retired truths left out, {rows} rows with only retired truths not scored)"
