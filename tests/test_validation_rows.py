"""A bundle's validation rows (service.engine.validation_rows) and the quality gate's reading of
them: a label imputed from a group's labels carries its weight (`target_weight`), which the gate
counts as training's validation did."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.api.quality_gate import gate_scores
from service.engine.schema import BundleError
from service.engine.validation_rows import read_validation_rows, validation_truths


def _answers(*top: int):
    return lambda texts: np.array([[t, -1, -1, -1, -1] for t in top[: len(texts)]], dtype=np.int64)


def test_the_gate_counts_a_hit_at_its_labels_weight_and_leaves_retired_truths_out_with_theirs() -> None:
    texts, truths = ["a", "b", "c"], [[1, 4], [2], [3, 0]]
    weights = [[0.25, 1.0], [1.0], [0.5, 0.5]]
    assert gate_scores(texts, truths, None, _answers(1, 2, 0))["P@1"] == 100.0
    assert gate_scores(texts, truths, None, _answers(1, 2, 0), weights)["P@1"] == pytest.approx(100 * 1.75 / 3)
    retired = np.zeros(5, dtype=bool)
    retired[[2, 3]] = True  # row b has no truth left; row c keeps label 0 at its own weight
    scores = gate_scores(texts, truths, retired, _answers(1, 0), weights)
    assert scores["validation_rows"] == 2 and scores["retired_truths_left_out"] == 2
    assert scores["P@1"] == pytest.approx(100 * (0.25 + 0.5) / 2)


def test_rows_without_weights_among_rows_with_them_weigh_each_label_one() -> None:
    rows = [{"text": "a", "target_ind": [1, 2], "target_weight": [0.5, 1]}, {"text": "b", "target_ind": [3]}]
    assert validation_truths(rows) == ([[1, 2], [3]], [[0.5, 1], [1.0]])
    assert validation_truths(rows[1:]) == ([[3]], None)


@pytest.mark.parametrize("weight", [[0.0], [1.5], [-0.1], ["0.5"], [True], [0.5, 0.5], [], "0.5", None])
def test_a_row_with_bad_weights_is_refused_naming_its_line(tmp_path: Path, weight) -> None:
    path = tmp_path / "validation.jsonl"
    good = {"text": "a", "target_ind": [1], "target_weight": [1.0]}
    bad = {"text": "b", "target_ind": [2], "target_weight": weight}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    if weight is None:  # "target_weight": null is a row without weights
        assert read_validation_rows(path, 5)[1]["target_weight"] is None
        return
    with pytest.raises(BundleError, match=rf"^{path}:2: a validation row's \"target_weight\" is one weight in "
                                          r"\(0, 1\] per target_ind label \(1\)$"):
        read_validation_rows(path, 5)


def test_weights_at_the_edges_of_their_range_are_read(tmp_path: Path) -> None:
    path = tmp_path / "validation.jsonl"
    path.write_text(json.dumps({"text": "a", "target_ind": [0, 4], "target_weight": [1, 1e-9]}) + "\n")
    assert read_validation_rows(path, 5)[0]["target_weight"] == [1, 1e-9]
    path.write_text('{"text": "a", "target_ind": [0], "target_weight": [NaN]}\n')
    with pytest.raises(BundleError, match=rf"^{path}:1: bad validation row"):
        read_validation_rows(path, 5)
