"""End-to-end training on small generated data: quality, determinism, checkpoint, CLI errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from service.engine.metrics import label_frequencies, propensities, ranking_metrics
from service.engine.scorers import Calibration
from shortlist.cli import main as cli_main
from training.checkpoint import Checkpoint
from training.data import load_split
from training.synthetic import generate
from training.train import (
    DEFAULT_OBJECTIVE,
    LEXICAL_WEIGHTS,
    Scoring,
    TrainConfig,
    _encode_texts,
    embed,
    objective_value,
    predict_exact,
    train,
    tune_scoring,
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("syn"), num_labels=300, train_docs=2000, test_docs=400, seed=1)


def _tiny(**overrides: object) -> TrainConfig:
    # The tree scorer has its own tests; leaving it out keeps these fast.
    return TrainConfig.from_dict({"tree_enabled": False, **overrides}, TrainConfig.tiny())


@pytest.fixture(scope="module")
def trained(dataset: Path) -> Checkpoint:
    return train(dataset, _tiny(), seed=7, log=lambda *_: None)


def test_quality_far_above_chance(trained: Checkpoint, dataset: Path) -> None:
    tst = load_split(dataset, "tst", "title", len(trained.labels))
    trn = load_split(dataset, "trn", "title", len(trained.labels))
    most_frequent = np.argsort(-label_frequencies(trn.targets, len(trained.labels)))[:5]
    baseline = ranking_metrics(np.tile(most_frequent, (len(tst), 1)), tst.targets, (1,))["P@1"]
    combined = trained.metrics["module3"]["combined"]
    assert combined["P@1"] > max(40.0, baseline + 20.0)
    # the metrics recorded are those of the exported arrays under the recorded scoring
    s = trained.scoring
    scoring = Scoring(s["alpha"], Calibration.from_dict(s["calibration"]["classifier"]),
                      Calibration.from_dict(s["calibration"]["centroid"]))
    q = embed(trained.encoder, _encode_texts(trained.tokenizer, tst.texts), trained.encoder.embedding.device)
    preds = predict_exact(q, trained.classifiers, trained.classifier_bias, trained.centroids, scoring, 5,
                          trained.encoder.embedding.device)
    assert ranking_metrics(preds, tst.targets, (1,))["P@1"] == pytest.approx(combined["P@1"], abs=1e-6)


def test_checkpoint_contents(trained: Checkpoint) -> None:
    L = len(trained.labels)
    assert trained.classifiers.shape == (L, 32) and trained.classifier_bias.shape == (L,)
    assert trained.centroids.shape == (L, 32)
    assert set(trained.scoring) == {
        "alpha", "lexical_weight", "lexical_form", "classifier_form", "calibration", "shortlist"
    }
    assert trained.scoring["lexical_form"] == "logistic"
    assert trained.scoring["lexical_weight"] in LEXICAL_WEIGHTS
    assert trained.scoring["classifier_form"] == "scaled_bias"
    assert set(trained.scoring["calibration"]) == {"classifier", "centroid"}
    # the tiny config serves HNSW 20 / 20 and 10 labels per token; the prior's head as fallback
    assert trained.scoring["shortlist"] == {"k_w": 20, "k_mu": 20, "k_tok": 10, "k_head": 32, "head": "fallback"}
    table = trained.extra_arrays["token_shortlist"]["labels"]
    assert table.dtype == np.int32 and table.shape[0] == trained.tokenizer.vocab_size
    assert (table[0] == -1).all() and table.min() >= -1 and table.max() < L
    lexical = trained.extra_arrays["token_shortlist"]
    weights, bias = lexical["weights"], lexical["bias"]
    assert set(lexical) == {"labels", "weights", "bias"} and bias.shape == (L,)
    assert weights.shape == table.shape and np.isfinite(weights).all() and np.isfinite(bias).all()
    # learned on the served slots only: the first k_tok columns, where a label is listed
    assert not weights[:, 10:].any() and not weights[table < 0].any()
    assert (weights[:, :10][table[:, :10] >= 0] != 0).mean() > 0.9
    assert 0 < len(trained.validation) <= 50
    assert all(set(row) == {"text", "target_ind"} and row["target_ind"] for row in trained.validation)
    for stage in ("module1", "module3", "times"):
        assert stage in trained.metrics
    assert trained.fingerprint["counts"]["lbl"] == L


def test_deterministic_given_seed(dataset: Path, trained: Checkpoint) -> None:
    again = train(dataset, _tiny(), seed=7, log=lambda *_: None)
    np.testing.assert_array_equal(again.classifiers, trained.classifiers)
    np.testing.assert_array_equal(again.centroids, trained.centroids)
    other = train(dataset, _tiny(), seed=8, log=lambda *_: None)
    assert not np.array_equal(other.classifiers, trained.classifiers)


def test_paper_form_with_shortlisted_negatives(dataset: Path) -> None:
    cfg = _tiny(classifier_form="paper", m3_negatives="shortlist", m3_train_encoder=False)
    ckpt = train(dataset, cfg, seed=1, log=lambda *_: None)
    assert ckpt.scoring["classifier_form"] == "paper"
    assert not ckpt.classifier_bias.any()
    np.testing.assert_allclose(np.linalg.norm(ckpt.classifiers, axis=1), 1.0, rtol=1e-5)
    assert ckpt.metrics["module3"]["combined"]["P@1"] > 30.0


def test_softmax_term_trains_a_different_model_of_the_same_quality(dataset: Path, trained: Checkpoint) -> None:
    ckpt = train(dataset, _tiny(m3_softmax_weight=1.0), seed=7, log=lambda *_: None)
    assert not np.allclose(ckpt.classifiers, trained.classifiers)
    assert ckpt.metrics["module3"]["combined"]["P@1"] > trained.metrics["module3"]["combined"]["P@1"] - 10.0
    with pytest.raises(ValueError, match="m3_softmax_weight"):
        TrainConfig.from_dict({"m3_softmax_weight": -1.0})


def test_checkpoint_round_trip(trained: Checkpoint, tmp_path: Path) -> None:
    trained.save(tmp_path / "ck")
    back = Checkpoint.load(tmp_path / "ck")
    np.testing.assert_array_equal(back.classifiers, trained.classifiers)
    assert back.scoring == trained.scoring and back.validation == trained.validation


def test_config_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown training config keys: m9_epochs"):
        TrainConfig.from_dict({"m9_epochs": 3})
    with pytest.raises(ValueError, match="classifier_form"):
        TrainConfig.from_dict({"classifier_form": "magic"})
    with pytest.raises(ValueError, match="serve_k_tok must be in"):
        TrainConfig.from_dict({"serve_k_tok": 21, "token_shortlist_width": 20})
    with pytest.raises(ValueError, match="all 0"):
        TrainConfig.from_dict({"serve_k_w": 0, "serve_k_mu": 0, "serve_k_tok": 0})
    with pytest.raises(ValueError, match="serve_k_w must be >= 0"):
        TrainConfig.from_dict({"serve_k_w": -1})
    with pytest.raises(ValueError, match="serve_k_head must be >= 0"):
        TrainConfig.from_dict({"serve_k_head": -1})
    assert TrainConfig.from_dict({"serve_k_head": 0}).serve_k_head == 0  # no head at all
    with pytest.raises(ValueError, match="lexical_form must be one of"):
        TrainConfig.from_dict({"lexical_form": "softmax"})
    for name in ("lexical_epochs", "lexical_batch_size"):
        with pytest.raises(ValueError, match=f"{name} must be >= 1"):
            TrainConfig.from_dict({name: 0})
        assert getattr(TrainConfig.from_dict({name: 1}), name) == 1
    for name in ("lexical_lr", "lexical_l2"):
        for bad_value in (-1e-9, float("nan"), "0.1"):
            with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0"):
                TrainConfig.from_dict({name: bad_value})
        assert getattr(TrainConfig.from_dict({name: 0.0}), name) == 0.0
    assert TrainConfig.from_dict({"lexical_form": "shares"}).lexical_form == "shares"
    # the edge: only the token shortlist, at the table's full width
    TrainConfig.from_dict({"serve_k_w": 0, "serve_k_mu": 0, "serve_k_tok": 20, "token_shortlist_width": 20})
    bad = tmp_path / "cfg.json"
    bad.write_text("[1]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        TrainConfig.from_json(bad)


def test_shares_form_on_request(dataset: Path) -> None:
    ckpt = train(dataset, _tiny(m1_epochs=1, m3_epochs=1, lexical_form="shares"), seed=7, log=lambda *_: None)
    assert ckpt.scoring["lexical_form"] == "shares"
    lexical = ckpt.extra_arrays["token_shortlist"]
    assert set(lexical) == {"labels", "shares"} and 0 <= lexical["shares"].min() <= lexical["shares"].max() <= 1
    assert ((lexical["shares"] > 0) == (lexical["labels"] >= 0)).all()  # every listed label co-occurred


def test_cli_trains_and_reports_bad_data(dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(
        {"preset": "tiny", "m1_epochs": 1, "m3_epochs": 1, "tree_enabled": False, "lexical_form": "auto"}
    ))
    capsys.readouterr()
    assert cli_main(["train", "--data", str(dataset), "--out", str(tmp_path / "ck"), "--config", str(cfg)]) == 0
    # "auto" tunes both lexical forms on validation and keeps the better one
    values = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"lexical form (\w+): validation .* = ([0-9.]+)", capsys.readouterr().out)
    }
    assert set(values) == {"shares", "logistic"}
    ckpt = Checkpoint.load(tmp_path / "ck")
    chosen = ckpt.scoring["lexical_form"]
    assert values[chosen] == max(values.values())
    lexical = ckpt.extra_arrays["token_shortlist"]
    assert set(lexical) == ({"labels", "shares"} if chosen == "shares" else {"labels", "weights", "bias"})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "lbl.jsonl").write_text('{"uid": "a", "title": "x", "content": ""}\n')
    (bad / "trn.jsonl").write_text('{"uid": "d", "title": "x", "content": "", "target_ind": [3]}\n')
    capsys.readouterr()
    assert cli_main(["train", "--data", str(bad), "--out", str(tmp_path / "ck2"), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "trn.jsonl:1: target_ind 3 out of range" in err and "Traceback" not in err


def test_tuning_maximises_the_configured_objective(trained: Checkpoint, dataset: Path) -> None:
    # The tuner's own behaviour on a held-out split (a quality claim would use validation).
    tst = load_split(dataset, "tst", "title", len(trained.labels))
    device = trained.encoder.embedding.device
    q = embed(trained.encoder, _encode_texts(trained.tokenizer, tst.texts), device)
    inv_prop = 1.0 / propensities(label_frequencies(tst.targets, len(trained.labels)), len(tst))
    args = (q, tst.targets, trained.classifiers, trained.classifier_bias, trained.centroids, "scaled_bias",
            inv_prop, device)
    head_scoring, head = tune_scoring(*args, objective={"P@1": 1.0})
    tail_scoring, tail = tune_scoring(*args, objective={"PSP@5": 1.0})
    assert head_scoring != tail_scoring
    assert head["P@1"] >= tail["P@1"] and tail["PSP@5"] >= head["PSP@5"]
    assert head["P@1"] > tail["P@1"] or tail["PSP@5"] > head["PSP@5"]
    _, default = tune_scoring(*args)
    assert objective_value(default, DEFAULT_OBJECTIVE) >= objective_value(head, DEFAULT_OBJECTIVE)
    assert objective_value(default, DEFAULT_OBJECTIVE) >= objective_value(tail, DEFAULT_OBJECTIVE)


def test_tuning_without_own_labels_scores_what_exclusion_serves(trained: Checkpoint, dataset: Path) -> None:
    tst = load_split(dataset, "tst", "title", len(trained.labels))
    device = trained.encoder.embedding.device
    q = embed(trained.encoder, _encode_texts(trained.tokenizer, tst.texts), device)
    inv_prop = 1.0 / propensities(label_frequencies(tst.targets, len(trained.labels)), len(tst))
    w, b, mu = trained.classifiers, trained.classifier_bias, trained.centroids
    args = (q, tst.targets, w, b, mu, "scaled_bias", inv_prop, device)
    plain_scoring, plain = tune_scoring(*args)
    # Pretend each document whose best label is wrong is that label (its own, never a target).
    top = predict_exact(q, w, b, mu, plain_scoring, 1, device)[:, 0]
    own = np.array([t if t not in truth else -1 for t, truth in zip(top, tst.targets, strict=True)])
    assert (own >= 0).sum() > 20
    scoring, tuned = tune_scoring(*args, own=own)
    assert tuned["P@1"] > plain["P@1"]  # the wrong best labels are gone
    ranked = predict_exact(q, w, b, mu, scoring, 6, device)
    served = np.array([[x for x in row if x != o][:5] for row, o in zip(ranked, own, strict=True)])
    expected = ranking_metrics(served, tst.targets, (1, 5), inv_prop)
    for name in ("P@1", "P@5", "PSP@5"):
        assert tuned[name] == pytest.approx(expected[name], abs=1e-9)


@pytest.mark.parametrize(
    ("objective", "message"),
    [
        ({}, "non-empty"),
        ({"P@2": 1.0}, r"unknown metrics \['P@2'\]"),
        ({"P@1": -1.0}, "finite number >= 0"),
        ({"P@1": float("nan")}, "finite number >= 0"),
        ({"P@1": "1"}, "finite number >= 0"),
        ({"P@1": 0.0, "PSP@5": 0}, "all weights are 0"),
    ],
)
def test_tune_objective_is_validated(objective: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_dict({"tune_objective": objective})
    weights = {"P@1": 2, "PSP@5": 0.5}
    assert TrainConfig.from_dict({"tune_objective": weights}).tune_objective == weights
