"""Metrics against hand-computed examples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.engine.metrics import label_frequencies, propensities, ranking_metrics, shortlist_recall

PREDS = np.array([[1, 2, 3], [4, 5, 6]])
TRUTHS = [[1, 3], [7]]
INV_PROP = np.array([0.0, 2.0, 1.0, 4.0, 1.0, 1.0, 1.0, 3.0])


def test_precision_at_k() -> None:
    m = ranking_metrics(PREDS, TRUTHS, ks=(1, 3))
    assert m["P@1"] == pytest.approx(50.0)
    assert m["P@3"] == pytest.approx(100.0 * (2 / 3) / 2)


def test_ndcg_at_k() -> None:
    m = ranking_metrics(PREDS, TRUTHS, ks=(3,))
    # doc 1: hits at ranks 1 and 3 over an ideal of two hits at ranks 1, 2; doc 2: none.
    doc1 = (1.0 + 1.0 / math.log2(4)) / (1.0 + 1.0 / math.log2(3))
    assert m["nDCG@3"] == pytest.approx(100.0 * doc1 / 2)


def test_psp_at_k_normalised_by_best() -> None:
    m = ranking_metrics(PREDS, TRUTHS, ks=(1, 3), inv_propensity=INV_PROP)
    # @1: gains 2 + 0 over best 4 + 3.  @3: (2 + 4) / 3 + 0 over (4 + 2) / 3 + 3 / 3.
    assert m["PSP@1"] == pytest.approx(100.0 * 2 / 7)
    assert m["PSP@3"] == pytest.approx(100.0 * 2 / 3)


def test_perfect_predictions_score_100() -> None:
    m = ranking_metrics(np.array([[1, 3, -1], [7, -1, -1]]), TRUTHS, ks=(1,), inv_propensity=INV_PROP)
    assert m["P@1"] == pytest.approx(100.0)
    assert m["nDCG@1"] == pytest.approx(100.0)
    # rank 1 holds label 1 (inv. propensity 2), the best would hold label 3 (4)
    assert m["PSP@1"] == pytest.approx(100.0 * (2 + 3) / (4 + 3))


def test_short_prediction_rows_are_padded_not_credited() -> None:
    m = ranking_metrics(np.array([[1], [7]]), TRUTHS, ks=(3,))
    assert m["P@3"] == pytest.approx(100.0 * (1 / 3 + 1 / 3) / 2)


def test_wrong_shape_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="one row per truth"):
        ranking_metrics(PREDS, [[1]], ks=(1,))


def test_propensity_formula() -> None:
    n, a, b = 100, 0.55, 1.5
    c = (math.log(n) - 1) * (b + 1) ** a
    expected = [1 / (1 + c * (f + b) ** -a) for f in (0, 10)]
    assert propensities(np.array([0, 10]), n) == pytest.approx(expected)
    # frequent labels are more likely observed, so they carry less weight
    p = propensities(np.array([1, 100, 10000]), 20000)
    assert p[0] < p[1] < p[2]


def test_label_frequencies_count_each_doc_once() -> None:
    assert label_frequencies([[0, 0, 2], [2]], 3).tolist() == [1, 0, 2]


def test_shortlist_recall() -> None:
    assert shortlist_recall([[1, 2], [3]], [[1, 5], [3]]) == pytest.approx(75.0)
    assert shortlist_recall([[1]], [[]]) == 0.0
