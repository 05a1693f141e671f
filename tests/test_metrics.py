"""Metrics against hand-computed examples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.engine.metrics import (
    Truths,
    aggregate,
    document_terms,
    label_frequencies,
    paired_bootstrap,
    propensities,
    ranking_metrics,
    shortlist_recall,
)

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


def test_label_frequencies_with_weights_sum_them() -> None:
    freq = label_frequencies([[0, 2], [2]], 3, weights=[[0.5, 0.25], [1.0]])
    assert freq.tolist() == pytest.approx([0.5, 0.0, 1.25])


def test_weighted_truths_credit_a_hit_its_weight() -> None:
    # doc 0: labels 1 (sure) and 3 (a quarter sure); doc 1: label 7 at 0.5.
    truths = Truths(TRUTHS, INV_PROP, weights=[[1.0, 0.25], [0.5]])
    m = ranking_metrics(PREDS, truths, ks=(1, 3))
    assert m["P@1"] == pytest.approx(100.0 * (1.0 + 0.0) / 2)
    assert m["P@3"] == pytest.approx(100.0 * (1.25 / 3 + 0.0) / 2)
    # PSP@1: gain 2 * 1 over the bests max(2 * 1, 4 * 0.25) + 3 * 0.5
    assert m["PSP@1"] == pytest.approx(100.0 * 2.0 / (2.0 + 1.5))
    # nDCG@3 of doc 0: (1 + 0.25 / log2 4) over its ideal (1 + 0.25 / log2 3)
    doc0 = (1.0 + 0.25 / math.log2(4)) / (1.0 + 0.25 / math.log2(3))
    assert m["nDCG@3"] == pytest.approx(100.0 * doc0 / 2)


def test_weights_of_one_score_as_no_weights() -> None:
    plain = ranking_metrics(PREDS, TRUTHS, ks=(1, 3), inv_propensity=INV_PROP)
    ones = ranking_metrics(PREDS, Truths(TRUTHS, INV_PROP, weights=[[1.0, 1.0], [1.0]]), ks=(1, 3))
    assert ones == pytest.approx(plain)


@pytest.mark.parametrize(("weights", "message"), [([[1.0, 1.0]], "1 rows of weights for 2"),
                                                   ([[1.0], [1.0]], "2 labels and 1 weights")])
def test_weights_not_matching_the_truths_are_refused(weights: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Truths(TRUTHS, weights=weights)


def test_shortlist_recall() -> None:
    assert shortlist_recall([[1, 2], [3]], [[1, 5], [3]]) == pytest.approx(75.0)
    assert shortlist_recall([[1]], [[]]) == 0.0


def test_aggregate_over_rows_scores_that_resample() -> None:
    rng = np.random.default_rng(0)
    preds = rng.integers(0, 8, size=(40, 5))
    truths = [list(rng.choice(8, size=rng.integers(1, 4), replace=False)) for _ in range(40)]
    terms = document_terms(preds, truths, ks=(1, 5), inv_propensity=INV_PROP + 1.0)
    rows = rng.integers(0, 40, 40)  # with repeats, as a bootstrap draws them
    expected = ranking_metrics(preds[rows], [truths[i] for i in rows], ks=(1, 5), inv_propensity=INV_PROP + 1.0)
    assert aggregate(terms, rows) == pytest.approx(expected)
    assert aggregate(terms) == pytest.approx(ranking_metrics(preds, truths, (1, 5), INV_PROP + 1.0))


def test_paired_bootstrap_gives_the_difference_and_an_interval_around_it() -> None:
    rng = np.random.default_rng(1)
    truths = [[int(rng.integers(0, 8))] for _ in range(400)]
    right = np.array([[t[0], -1] for t in truths])
    # b is right on about half the documents a is right on (all of them)
    half = np.where(rng.random(400)[:, None] < 0.5, right, np.array([[-1, -1]]))
    a, b = (document_terms(p, truths, ks=(1,), inv_propensity=INV_PROP + 1.0) for p in (right, half))
    out = paired_bootstrap(a, b, ("P@1", "PSP@1"), resamples=200)
    diff, low, high = out["P@1"]
    expected = ranking_metrics(right, truths, (1,))["P@1"] - ranking_metrics(half, truths, (1,))["P@1"]
    assert diff == pytest.approx(expected)
    assert 0 < low < diff < high
    assert paired_bootstrap(a, a, ("P@1",), resamples=50)["P@1"] == (0.0, 0.0, 0.0)
    # the same seed draws the same resamples
    again = [paired_bootstrap(a, b, ("P@1",), resamples=50, seed=3) for _ in range(2)]
    assert again[0] == again[1]
    # one resample is the smallest allowed: its interval is that resample's difference
    _, low, high = paired_bootstrap(a, b, ("P@1",), resamples=1)["P@1"]
    assert low == pytest.approx(high) and low > 0
    assert set(aggregate(a, names=("PSP@1",))) == {"PSP@1"}


def test_paired_bootstrap_refuses_systems_scored_on_different_documents() -> None:
    a = document_terms(PREDS, TRUTHS, ks=(1,))
    b = document_terms(PREDS[:1], TRUTHS[:1], ks=(1,))
    with pytest.raises(ValueError, match="same documents"):
        paired_bootstrap(a, b, ("P@1",))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"resamples": 0}, "resamples must be >= 1"),
    ({"level": 1.0}, "level in"),
    ({"names": ("PSP@1",)}, "no terms for PSP@1"),
])
def test_paired_bootstrap_refuses_bad_arguments_by_name(kwargs: dict, message: str) -> None:
    a = document_terms(PREDS, TRUTHS, ks=(1,))
    with pytest.raises(ValueError, match=message):
        paired_bootstrap(a, a, **{"names": ("P@1",), **kwargs})
