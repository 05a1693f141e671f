"""Canary queries: answered at export and recorded in the manifest; a loaded bundle must give
the same answers through the whole path (tokenizer, ONNX encoder, shortlist sources, scorers)
before it is served."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from service.engine.schema import BundleError, CanaryQuery

if TYPE_CHECKING:
    from service.engine.bundle import Bundle


class TreeTarget(Protocol):
    """What check_tree asks of a route (service.engine.predictor.TreeRoute, whose module calls
    this one on load: a protocol here keeps the import one way)."""

    bundle: Bundle

    @property
    def num_labels(self) -> int: ...

    @property
    def tree_serves(self) -> bool: ...

    def predict_tree_ids(self, texts: list[str], k: int) -> tuple[np.ndarray, np.ndarray]: ...


class CanaryTarget(TreeTarget, Protocol):
    """What check asks of a predictor (service.engine.predictor.Predictor)."""

    def predict_ids(self, texts: list[str], k: int, alpha: float | None = None) -> tuple[np.ndarray, np.ndarray]: ...

CANARY_K = 5
# How far a reproduced top score may drift from export's (ONNX on another CPU, BLAS kernels).
_SCORE_TOLERANCE = 1e-3


def record(predictor: CanaryTarget, texts: Sequence[str]) -> list[CanaryQuery]:
    """The top CANARY_K answers of `texts` with the bundle's own scoring, to store in the manifest."""
    ids, scores = predictor.predict_ids(list(texts), k=CANARY_K)
    return [
        CanaryQuery(text=t, top_ids=[int(i) for i in row_ids if i >= 0], top_scores=[float(s) for s in row_scores])
        for t, row_ids, row_scores in zip(texts, ids, scores, strict=True)
    ]


def check_tree(route: TreeTarget) -> None:
    """Raise BundleError unless the tree route answers every check text with finite scores and
    label ids, and each canary text with some label while it has one to answer (check's test of
    the tree path, on a route that needs neither the shortlist sources nor the label vectors:
    Predictor.checked)."""
    texts = check_texts(route.bundle)
    _answered(route.bundle, route.num_labels, lambda: {TREE: route.predict_tree_ids(texts, k=CANARY_K)},
              route.tree_serves)


Answers = dict[str, tuple[np.ndarray, np.ndarray]]  # path -> (ids, scores) of the check texts
TREE = "tree"  # the tree route's path in Answers


def _answered(bundle: Bundle, num_labels: int, answers: Callable[[], Answers], tree_serves: bool = True) -> Answers:
    """answers(), each path checked: finite scores, label ids in range (the tree's: the labels it
    holds), no retired label, and a label for every canary text that had one at export. The tree
    path is held to that last one only while it has a live label (tree_serves): its beam then
    reaches one from any text; with every label it holds retired it has none to answer, while
    the alpha route still answers labels added since training."""
    try:
        paths = answers()
    except BundleError:
        raise
    except Exception as exc:  # any runtime failure on the path disqualifies the bundle
        raise BundleError(f"{bundle.path}: canary query failed: {type(exc).__name__}: {exc}") from exc
    canaries = bundle.manifest.canary
    for name, (path_ids, path_scores) in paths.items():
        found = path_ids >= 0
        limit = bundle.manifest.tree_labels if name == TREE else num_labels
        if not np.all(np.isfinite(path_scores[found])) or np.any(path_ids >= limit):
            raise BundleError(f"{bundle.path}: canary queries at {name} produced non-finite scores or bad label ids")
        if bundle.retired is not None and bundle.retired[path_ids[found]].any():
            raise BundleError(f"{bundle.path}: canary queries at {name} answered a retired label")
        if name == TREE and not tree_serves:
            continue
        answered = [c.top_ids != [] for c in canaries]
        if not found[: len(canaries)].any(axis=1)[answered].all():
            raise BundleError(f"{bundle.path}: canary queries at {name}: a canary text found no label")
    return paths


def check_texts(bundle: Bundle) -> list[str]:
    """The texts `check` asks: the canaries, three label titles, the empty text."""
    return [c.text for c in bundle.manifest.canary] + list(bundle.labels.titles[:3]) + [""]


def check(predictor: CanaryTarget, tree: bool = True) -> None:
    """Raise BundleError unless the bundle reproduces its canaries and every scorer path a
    request can select (alpha 0, between and 1, and the bundle's; each shortlist source, which
    every query searches; the tree, unless `tree` is False: check_tree checked it) answers
    each text with finite scores and label ids."""
    bundle = predictor.bundle
    canaries = bundle.manifest.canary
    # Label titles too: a canary set may miss a source (no canary text matches a token row).
    texts = check_texts(bundle)

    def answers() -> Answers:
        paths = {"bundle's alpha": predictor.predict_ids(texts, k=CANARY_K)}
        for alpha in (0.0, 0.5, 1.0):
            paths[f"alpha {alpha}"] = predictor.predict_ids(texts, k=CANARY_K, alpha=alpha)
        if tree and bundle.tree is not None:
            paths[TREE] = predictor.predict_tree_ids(texts, k=CANARY_K)
        return paths

    paths = _answered(bundle, predictor.num_labels, answers, tree and bundle.tree is not None and predictor.tree_serves)
    ids, scores = paths["bundle's alpha"]
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
