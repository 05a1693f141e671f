"""Canary queries: answered at export and recorded in the manifest; a loaded bundle must give
the same answers through the whole path (tokenizer, ONNX encoder, shortlist sources, scorers)
before it is served."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from service.engine.schema import BundleError, CanaryQuery

if TYPE_CHECKING:
    from service.engine.predictor import Predictor

CANARY_K = 5
# How far a reproduced top score may drift from export's (ONNX on another CPU, BLAS kernels).
_SCORE_TOLERANCE = 1e-3


def record(predictor: Predictor, texts: Sequence[str]) -> list[CanaryQuery]:
    """The top CANARY_K answers of `texts` with the bundle's own scoring, to store in the manifest."""
    ids, scores = predictor.predict_ids(list(texts), k=CANARY_K)
    return [
        CanaryQuery(text=t, top_ids=[int(i) for i in row_ids if i >= 0], top_scores=[float(s) for s in row_scores])
        for t, row_ids, row_scores in zip(texts, ids, scores, strict=True)
    ]


def check(predictor: Predictor) -> None:
    """Raise BundleError unless the bundle reproduces its canaries and every scorer path a
    request can select (alpha 0, 1 and the bundle's; the tree) answers with finite scores."""
    bundle = predictor.bundle
    canaries = bundle.manifest.canary
    texts = [c.text for c in canaries] or [bundle.labels.titles[0]]
    try:
        ids, scores = predictor.predict_ids(texts, k=CANARY_K)
        paths = [(ids, scores), predictor.predict_ids(texts, k=CANARY_K, alpha=0.0),
                 predictor.predict_ids(texts, k=CANARY_K, alpha=1.0)]
        if bundle.tree is not None:
            paths.append(predictor.predict_tree_ids(texts[:1], k=CANARY_K))
    except BundleError:
        raise
    except Exception as exc:  # any runtime failure on the path disqualifies the bundle
        raise BundleError(f"{bundle.path}: canary query failed: {type(exc).__name__}: {exc}") from exc
    for path_ids, path_scores in paths:
        if not np.all(np.isfinite(path_scores[path_ids >= 0])):
            raise BundleError(f"{bundle.path}: canary query produced non-finite scores")
    for c, row_ids, row_scores in zip(canaries, ids[: len(canaries)], scores[: len(canaries)], strict=True):
        if not c.top_ids:
            continue
        if c.top_ids[0] not in row_ids.tolist():
            raise BundleError(
                f"{bundle.path}: canary {c.text!r}: expected label {c.top_ids[0]} in the top {CANARY_K}, got "
                f"{row_ids.tolist()} (encoder, arrays and indices disagree with export)"
            )
        if abs(float(row_scores[0]) - c.top_scores[0]) > _SCORE_TOLERANCE * max(1.0, abs(c.top_scores[0])):
            raise BundleError(
                f"{bundle.path}: canary {c.text!r}: top score {row_scores[0]:.6f}, export saw {c.top_scores[0]:.6f}"
            )
