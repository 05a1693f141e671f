"""Training on small generated data: quality, determinism, the model's parts, tuning, the CLI.

The pipeline's runs are conftest's checkpoints (v1, v2: the tiny preset, seeds 1 and 2); each
part is also fitted on its own here, on v1's data and encoder."""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from model_export.export import export_checkpoint
from service.engine import Predictor
from service.engine.candidates import CandidateSources
from service.engine.metrics import Truths, label_frequencies, propensities, ranking_metrics
from service.engine.schema import Shortlist
from service.engine.scorers import Calibration, LabelScorer
from service.engine.tokenizer import Tokenizer
from shortlist.cli import main as cli_main
from training.checkpoint import Checkpoint
from training.classifiers import OneVsAll
from training.config import DEFAULT_OBJECTIVE, M3_ALL_MAX_LABELS, TrainConfig
from training.data import load_split
from training.dataset import TokenizerFit, TrainingSet, no_token_cause, target_matrix
from training.encoder import EncodedTexts, embed
from training.pipeline import train
from training.progress import Progress
from training.siamese import PositiveDraw
from training.token_shortlist import TokenTable
from training.tuning import (
    LEXICAL_WEIGHTS,
    ScoringTuner,
    classifier_objective,
    objective_text,
    objective_value,
    source_cost,
)

CPU = torch.device("cpu")
IDENTITY = Calibration("identity")


@pytest.fixture(scope="module")
def ckpt(checkpoints) -> Checkpoint:
    return Checkpoint.load(checkpoints["v1"])


@pytest.fixture(scope="module")
def test_split(ckpt, synthetic_data):
    """The test documents embedded by v1's encoder, with their truths (propensities from trn)."""
    tst = load_split(synthetic_data, "tst", "title", len(ckpt.labels))
    trn = load_split(synthetic_data, "trn", "title", len(ckpt.labels))
    inv_prop = 1.0 / propensities(label_frequencies(trn.targets, len(ckpt.labels)), len(trn))
    texts = EncodedTexts.of(ckpt.tokenizer, tst.texts)
    return tst, texts, embed(ckpt.encoder, texts, CPU), Truths(tst.targets, inv_prop)


def test_quality_far_above_chance_and_recorded_as_exported(ckpt, test_split):
    tst, _, q, truths = test_split
    most_frequent = np.argsort(-label_frequencies(tst.targets, len(ckpt.labels)))[:5]
    baseline = ranking_metrics(np.tile(most_frequent, (len(tst), 1)), tst.targets, (1,))["P@1"]
    combined = ckpt.metrics["module3"]["combined"]
    assert combined["P@1"] > max(40.0, baseline + 20.0)
    # the metrics recorded are those of the saved arrays under the recorded scoring
    scorer = LabelScorer.of(ckpt.classifiers.weights_, ckpt.classifiers.bias_, ckpt.centroids.vectors_, ckpt.scoring)
    ids, _ = scorer.exact_top_k(q, 5, ckpt.scoring.alpha)
    assert ranking_metrics(ids, truths, (1,))["P@1"] == pytest.approx(combined["P@1"], abs=1e-3)


def test_checkpoint_holds_every_part_of_the_model(ckpt):
    L = len(ckpt.labels)
    assert ckpt.classifiers.weights_.shape == (L, 32) and ckpt.classifiers.bias_.shape == (L,)
    assert ckpt.centroids.vectors_.shape == (L, 32)
    s = ckpt.scoring
    assert s.lexical_form == "logistic" and s.lexical_weight in LEXICAL_WEIGHTS and s.classifier_form == "scaled_bias"
    # the tiny config serves HNSW 20 / 20 and 10 labels per token; the prior's head as fallback
    assert s.shortlist.model_dump() == {"k_w": 20, "k_mu": 20, "k_tok": 10, "k_head": 32, "head": "fallback"}
    assert ckpt.indices is not None and ckpt.indices[0].count == ckpt.indices[1].count == L
    table = ckpt.token_table
    assert table.labels.dtype == np.int32 and table.labels.shape[0] == ckpt.tokenizer.vocab_size
    assert (table.labels[0] == -1).all() and table.labels.min() >= -1 and table.labels.max() < L
    assert table.bias.shape == (L,) and np.isfinite(table.weights).all() and np.isfinite(table.bias).all()
    # learned on the served slots only: the first k_tok columns, where a label is listed
    assert not table.weights[:, 10:].any() and not table.weights[table.labels < 0].any()
    assert (table.weights[:, :10][table.labels[:, :10] >= 0] != 0).mean() > 0.9
    assert ckpt.tree is not None and ckpt.tree.arrays_["classifier_weights"].shape == (L, 32)
    assert 0 < len(ckpt.validation) <= 50
    assert all(set(row) == {"text", "target_ind"} and row["target_ind"] for row in ckpt.validation)
    for part in ("module1", "module3", "validation", "times", "losses", "losses_lexical"):
        assert part in ckpt.metrics
    if Path("/proc/self/clear_refs").exists():  # each stage's peak resident memory, where Linux says it
        assert set(ckpt.metrics["peak_rss_mib"]) >= {"data", "module1", "module3", "tuning", "tree"}
    assert ckpt.fingerprint["counts"]["lbl"] == L


def test_deterministic_given_seed(ckpt, checkpoints, synthetic_data):
    # Only the tree, fitted last with its own seed, is left out: the rest is v1's run again.
    again = train(synthetic_data, TrainConfig.from_dict({"tree_enabled": False}, TrainConfig.tiny()), seed=1)
    np.testing.assert_array_equal(again.classifiers.weights_, ckpt.classifiers.weights_)
    np.testing.assert_array_equal(again.centroids.vectors_, ckpt.centroids.vectors_)
    assert again.scoring == ckpt.scoring
    other = Checkpoint.load(checkpoints["v2"])  # seed 2
    assert not np.array_equal(other.classifiers.weights_, ckpt.classifiers.weights_)


@pytest.fixture(scope="module")
def module3_inputs(ckpt, synthetic_data):
    trn = load_split(synthetic_data, "trn", "title", len(ckpt.labels))
    docs = EncodedTexts.of(ckpt.tokenizer, trn.texts)
    labels = [ckpt.labels.titles[i] for i in range(len(ckpt.labels))]
    label_emb = embed(ckpt.encoder, EncodedTexts.of(ckpt.tokenizer, labels), CPU)
    return docs, target_matrix(trn.targets, len(ckpt.labels)), label_emb


def _p1(clf: OneVsAll, q: np.ndarray, truths: Truths) -> float:
    scorer = LabelScorer(clf.weights_, clf.bias_, clf.weights_, IDENTITY, IDENTITY)
    return ranking_metrics(scorer.exact_top_k(q, 1, 1.0)[0], truths, (1,))["P@1"]


def test_paper_classifiers_on_shortlisted_negatives_are_unit_vectors_without_bias(ckpt, module3_inputs, test_split):
    docs, y, label_emb = module3_inputs
    negatives = np.tile(np.arange(20), (len(docs), 1))  # every document's 20 hard negatives
    clf = OneVsAll("paper", "shortlist", epochs=2, batch_size=128, train_encoder=False, progress=False).fit(
        ckpt.encoder, label_emb, docs, y, negatives, CPU, np.random.default_rng(0))
    assert not clf.bias_.any()
    np.testing.assert_allclose(np.linalg.norm(clf.weights_, axis=1), 1.0, rtol=1e-5)
    assert _p1(clf, test_split[2], test_split[3]) > 30.0


def test_scaled_bias_classifiers_on_shortlisted_negatives_step_only_the_rows_they_use(ckpt, module3_inputs,
                                                                                     test_split):
    docs, y, label_emb = module3_inputs
    negatives = np.tile(np.arange(20), (len(docs), 1))
    rows = np.flatnonzero(np.diff(y.indptr) > 0)
    touched = np.zeros(y.shape[1], bool)
    touched[y[rows].indices] = True
    touched[:20] = True
    clf = OneVsAll("scaled_bias", "shortlist", epochs=2, batch_size=128, train_encoder=False, progress=False).fit(
        ckpt.encoder, label_emb, docs, y, negatives, CPU, np.random.default_rng(0))
    prior = OneVsAll("scaled_bias", "shortlist", epochs=0, progress=False).fit(
        ckpt.encoder, label_emb, docs, y, negatives, CPU, np.random.default_rng(0))
    # lazily stepped (SparseAdam): a label no document used keeps its text embedding and prior
    np.testing.assert_array_equal(clf.weights_[~touched], prior.weights_[~touched])
    np.testing.assert_array_equal(clf.bias_[~touched], prior.bias_[~touched])
    assert not np.allclose(clf.weights_[touched], prior.weights_[touched])
    assert _p1(clf, test_split[2], test_split[3]) > _p1(prior, test_split[2], test_split[3])


def test_a_soft_label_counts_by_its_weight_in_its_labels_prior(ckpt, module3_inputs):
    """scaled_bias starts each bias at its label's log-odds: half-weight (imputed) labels count half."""
    docs, y, label_emb = module3_inputs
    half = y.copy()
    half.data[:] = 0.5
    biases = [OneVsAll("scaled_bias", "all", epochs=0, progress=False).fit(
        ckpt.encoder, label_emb, docs, m, None, CPU, np.random.default_rng(0)).bias_ for m in (y, half)]
    freq = np.bincount(y.indices, minlength=y.shape[1]) / y.shape[0]
    used = (freq > 0) & (freq < 0.5)
    expected = np.log(0.5 * freq[used] / (1 - 0.5 * freq[used]))
    np.testing.assert_allclose(biases[1][used], expected, rtol=1e-4)
    assert (biases[1][used] < biases[0][used]).all()


def test_module3_negatives_follow_the_number_of_labels():
    cfg = TrainConfig()
    assert cfg.m3_negatives == "auto"
    assert cfg.module3_negatives(M3_ALL_MAX_LABELS) == "all"
    assert cfg.module3_negatives(M3_ALL_MAX_LABELS + 1) == "shortlist"
    assert TrainConfig(m3_negatives="all").module3_negatives(10**6) == "all"
    assert OneVsAll.of(cfg, 10**6).negatives == "shortlist"


def test_a_softmax_term_trains_a_different_model_of_the_same_quality(ckpt, module3_inputs, test_split):
    docs, y, label_emb = module3_inputs
    fitted = {}
    for weight in (0.0, 1.0):
        fitted[weight] = OneVsAll(epochs=2, batch_size=128, train_encoder=False, softmax_weight=weight,
                                  progress=False).fit(ckpt.encoder, label_emb, docs, y, None, CPU,
                                                      np.random.default_rng(0))
    assert not np.allclose(fitted[0.0].weights_, fitted[1.0].weights_)
    q, truths = test_split[2], test_split[3]
    assert _p1(fitted[1.0], q, truths) > _p1(fitted[0.0], q, truths) - 10.0


def test_module3_stops_after_the_first_epoch_that_gains_less_than_min_gain_on_validation(ckpt, module3_inputs,
                                                                                        test_split):
    docs, y, label_emb = module3_inputs
    q, truths = test_split[2], test_split[3]

    def fit(min_gain: float, watch: bool, epochs: int = 4) -> OneVsAll:
        validation = (lambda w, b: classifier_objective(q, w, b, truths, DEFAULT_OBJECTIVE)) if watch else None
        return OneVsAll(epochs=epochs, batch_size=128, train_encoder=False, progress=False, min_gain=min_gain).fit(
            ckpt.encoder, label_emb, docs, y, None, CPU, np.random.default_rng(0), validation)

    every = fit(-1e9, True)
    assert len(every.losses_) == 4 and len(every.validation_) == 3  # the last epoch needs no score
    assert every.validation_[-1] > every.validation_[0]  # the objective watched is the one trained for
    plateau = fit(1e9, True)  # no epoch gains that much: stopped after the second
    assert len(plateau.losses_) == 2 and plateau.validation_ == every.validation_[:2]
    assert not np.allclose(plateau.weights_, every.weights_)
    assert len(fit(1e9, False).losses_) == 4  # nothing to watch: every epoch
    two = fit(1e9, True, epochs=2)  # no epoch of two could stop: none is scored
    assert len(two.losses_) == 2 and two.validation_ == []


def test_the_logistic_form_takes_whole_epochs_up_to_its_step_budget_or_its_loss_plateau(ckpt, module3_inputs):
    docs, y, _ = module3_inputs
    labels = EncodedTexts.of(ckpt.tokenizer, list(ckpt.labels.titles))
    steps_per_epoch = -(-len(docs) // 256)
    # lexical_tol 0: every epoch the step budget allows; 1: stopped by the first epoch after the first
    for max_steps, tol, epochs in ((10**6, 0.0, 30), (3 * steps_per_epoch + 1, 0.0, 3), (1, 0.0, 1), (10**6, 1.0, 2)):
        cfg = TrainConfig.from_dict({"lexical_form": "logistic", "lexical_epochs": 30, "lexical_batch_size": 256,
                                     "lexical_max_steps": max_steps, "lexical_tol": tol}, TrainConfig.tiny())
        table = TokenTable.of(cfg).fit(docs, y, labels, ckpt.tokenizer.vocab_size, CPU)
        assert len(table.losses_) == epochs


def test_the_shares_form_on_request(ckpt, module3_inputs):
    docs, y, _ = module3_inputs
    labels = EncodedTexts.of(ckpt.tokenizer, list(ckpt.labels.titles))
    cfg = TrainConfig.from_dict({"lexical_form": "shares"}, TrainConfig.tiny())
    (table,) = TokenTable.of(cfg).fit(docs, y, labels, ckpt.tokenizer.vocab_size, CPU).tables_
    assert table.form == "shares" and table.bias is None
    assert 0 <= table.weights.min() <= table.weights.max() <= 1
    assert ((table.weights > 0) == (table.labels >= 0)).all()  # every listed label co-occurred


def test_checkpoint_round_trip(ckpt, tmp_path):
    ckpt.save(tmp_path / "ck")
    back = Checkpoint.load(tmp_path / "ck")
    np.testing.assert_array_equal(back.classifiers.weights_, ckpt.classifiers.weights_)
    np.testing.assert_array_equal(back.token_table.weights, ckpt.token_table.weights)
    assert back.scoring == ckpt.scoring and back.validation == ckpt.validation and back.hnsw == ckpt.hnsw
    meta = json.loads((tmp_path / "ck" / "checkpoint.json").read_text())
    meta["format"] = 9
    (tmp_path / "ck" / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="checkpoint format 9"):
        Checkpoint.load(tmp_path / "ck")


# Every numeric setting at its edge: (key, the last value accepted, the first refused, the other
# settings the accepted value needs).
TRAIN_SETTING_EDGES = [
    ("seed", 0, -1, {}), ("seed", 2**32 - 1, 2**32, {}), ("dim", 16, 0, {}), ("dim", 1, 0, {"tree_enabled": False}),
    ("threads", 0, -1, {}), ("index_threads", 0, -1, {}), ("min_df", 1, 0, {}), ("max_vocab", 1, 0, {}),
    ("max_tokens", 1, 0, {}), ("val_fraction", 0.0, -1e-9, {}), ("val_fraction", 0.999, 1.0, {}),
    ("val_max_docs", 1, 0, {}), ("validation_rows", 1, 0, {}), ("min_train_docs", 1, 0, {}),
    ("min_val_docs", 1, 0, {}), ("small_train_docs", 0, -1, {}), ("small_val_docs", 0, -1, {}),
    ("m1_epochs", 0, -1, {}),
    ("m1_batch_size", 1, 0, {}), ("m1_lr", 1e-9, 0.0, {}), ("m1_c", 1e-9, 0.0, {}), ("m1_c", 1.0, 1.0 + 1e-9, {}),
    ("m1_d", 1e-9, 0.0, {}), ("m1_inbatch_negatives", 0, -1, {}), ("m1_refresh_every", 0, -1, {}),
    ("m1_ann_negatives", 0, -1, {}), ("hnsw_m", 2, 1, {}), ("hnsw_ef_construction", 1, 0, {}), ("hnsw_ef", 1, 0, {}),
    ("m2_k_w", 1, 0, {}), ("m2_k_mu", 1, 0, {}), ("centroid_label_weight", 0.0, -1e-9, {}),
    ("centroid_label_weight", 1e6, 1e6 * (1 + 1e-9), {}), ("m3_epochs", 1, 0, {}),
    ("m3_max_steps", 1, 0, {}), ("m3_min_gain", -1e9, float("inf"), {}), ("m3_batch_size", 1, 0, {}),
    ("m3_lr", 1e-9, 0.0, {}), ("m3_c", 1e-9, 0.0, {}), ("m3_c", 1.0, 1.0 + 1e-9, {}), ("m3_d", 1e-9, 0.0, {}),
    ("m3_encoder_lr", 1e-9, 0.0, {}), ("m3_weight_decay", 0.0, -1e-9, {}), ("m3_softmax_weight", 0.0, -1e-9, {}),
    ("index_m", 2, 1, {}), ("index_ef_construction", 1, 0, {}), ("index_ef_search", 1, 0, {}),
    ("index_projection_dim", 0, -1, {}), ("alpha", 0.0, -1e-9, {}), ("alpha", 1.0, 1.0 + 1e-9, {}),
    ("serve_k_w", 0, -1, {}), ("serve_k_mu", 0, -1, {}), ("token_shortlist_width", 0, -1, {"serve_k_tok": 0,
                                                                                          "serve_k_mu": 1}),
    ("serve_k_tok", 0, -1, {"serve_k_mu": 1}), ("serve_k_head", 0, -1, {}), ("tune_k_hnsw", 0, -1, {}),
    ("tune_source_margin", 0.0, -1e-9, {}), ("tune_source_level", 0.0, -1e-9, {}),
    ("tune_source_level", 1.0, 1.0 + 1e-9, {}), ("lexical_epochs", 1, 0, {}), ("lexical_max_steps", 1, 0, {}),
    ("lexical_tol", 0.0, -1e-9, {}), ("lexical_lr", 0.0, -1e-9, {}), ("lexical_l2", 0.0, -1e-9, {}),
    ("lexical_batch_size", 1, 0, {}), ("aggregated_iterations", 0, -1, {}),
    ("aggregated_validation", 0.0, -1e-9, {"aggregated_keep_ratio": 0.5}), ("aggregated_validation", 0.999, 1.0, {}),
    ("aggregated_min_val_groups", 1, 0, {}),
    ("aggregated_step", 1e-9, 0.0, {}), ("aggregated_step", 1.0, 1.0 + 1e-9, {}), ("aggregated_rounds", 1, 0, {}),
    ("aggregated_keep_ratio", 0.0, -1e-9, {}), ("aggregated_keep_ratio", 1.0, 1.0 + 1e-9, {}),
    ("aggregated_min_posterior", 0.0, -1e-9, {}), ("aggregated_min_posterior", 0.999, 1.0, {}),
    ("aggregated_posterior_folds", 1, 0, {}), ("aggregated_posterior_folds", 100, 101, {}),
]


def test_every_numeric_training_setting_has_a_tested_range():
    numeric = {f.name for f in dataclasses.fields(TrainConfig) if f.type in ("int", "float", "float | None")}
    assert numeric == {key for key, *_ in TRAIN_SETTING_EDGES}


@pytest.mark.parametrize(("key", "accepted", "refused", "needs"), TRAIN_SETTING_EDGES)
def test_training_settings_are_checked_at_and_past_their_edges(key, accepted, refused, needs):
    assert getattr(TrainConfig.from_dict({key: accepted, **needs}), key) == accepted
    past = [refused] + ([float("inf"), float("nan")] if isinstance(accepted, float) else [])
    for value in past:
        with pytest.raises(ValueError, match=f"training config '{key}' must be (an integer|a finite number)"):
            TrainConfig.from_dict({key: value, **needs})


def test_training_runs_and_serves_at_its_settings_smallest_accepted_values(synthetic_data, tmp_path):
    """The accepted edges are usable, not only accepted: one run at the smallest sizes, counts and
    penalties at once (the tree's own edges: tests/test_tree.py), exported and answering."""
    smallest = {key: accepted for key, accepted, _, needs in TRAIN_SETTING_EDGES if not needs and key not in (
        "seed", "threads", "index_threads", "val_fraction", "alpha", "aggregated_validation", "aggregated_step",
        "aggregated_keep_ratio", "tune_source_level") and accepted in (0, 1, 2, 0.0)}
    cfg = TrainConfig.from_dict({**smallest, "m1_epochs": 1, "dim": 2, "tree": {"pca_dim": 2, "epochs": 1},
                                 "val_fraction": 0.0}, TrainConfig.tiny())
    assert cfg.m1_batch_size == cfg.m3_batch_size == cfg.max_vocab == cfg.validation_rows == 1
    # Seed 1 carves a validation document holding the vocabulary's one token (min_val_docs counts
    # only those: with seed 0 the tuning would have judged a document only the prior answers).
    train(synthetic_data, cfg, seed=1).save(tmp_path / "ck")
    bundle = export_checkpoint(tmp_path / "ck", tmp_path / "bundles", "edge")
    ids, scores = Predictor.load(bundle).predict_ids(["anything at all"], k=3)
    assert ids.shape == (1, 3) and np.isfinite(scores).all()


def test_config_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown training config keys: m9_epochs"):
        TrainConfig.from_dict({"m9_epochs": 3})
    for change, message in [
        ({"classifier_form": "magic"}, "classifier_form"),
        ({"serve_k_tok": 21, "token_shortlist_width": 20}, "serve_k_tok must be in"),
        ({"serve_k_w": 0, "serve_k_mu": 0, "serve_k_tok": 0}, "all 0"),
        ({"lexical_form": "softmax"}, "lexical_form must be one of"),
        # A value of another JSON type is refused, never coerced ("256" is not a dim, true not 1).
        ({"m3_min_gain": "1"}, "'m3_min_gain' must be a number or null, got a string"),
        ({"dim": "256"}, "'dim' must be an integer, got a string"),
        ({"seed": 1.5}, "'seed' must be an integer, got the number 1.5"),
        ({"threads": True}, "'threads' must be an integer, got true"),
        ({"progress": "no"}, "'progress' must be true or false, got a string"),
        ({"tune_objective": [1]}, "'tune_objective' must be an object, got a list"),
    ]:
        with pytest.raises(ValueError, match=message):
            TrainConfig.from_dict(change)
    assert TrainConfig.from_dict({"serve_k_head": 0}).serve_k_head == 0  # no head at all
    assert TrainConfig.from_dict({"dim": 64.0}).dim == 64  # a whole number is an integer, as in JSON Schema
    # Every field's kind is known to the check (a new kind of field would be a KeyError).
    assert TrainConfig.from_dict(dataclasses.asdict(TrainConfig.tiny())) == TrainConfig.tiny()
    for name in ("lexical_lr", "lexical_l2", "lexical_tol"):
        with pytest.raises(ValueError, match=f"'{name}' must be a number, got a string"):
            TrainConfig.from_dict({name: "0.1"})
    # the edge: only the token shortlist, at the table's full width
    TrainConfig.from_dict({"serve_k_w": 0, "serve_k_mu": 0, "serve_k_tok": 20, "token_shortlist_width": 20})
    bad = tmp_path / "cfg.json"
    bad.write_text("[1]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        TrainConfig.from_json(bad)
    # Python's json recursed on this one (a RecursionError traceback from `shortlist train`).
    bad.write_text('{"alpha": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(ValueError, match="cfg.json: cannot read training config: depth limit"):
        TrainConfig.from_json(bad)
    for preset in ('"nope"', "null", "1"):  # an unknown preset is refused, never a full-size run
        bad.write_text(f'{{"preset": {preset}}}')
        with pytest.raises(ValueError, match=r"cfg.json: training config 'preset' must be one of \['tiny'\]"):
            TrainConfig.from_json(bad)
    bad.write_text('{"alpha": NaN}')
    with pytest.raises(ValueError, match="cfg.json: cannot read training config"):
        TrainConfig.from_json(bad)


def test_cli_trains_picks_the_better_lexical_form_and_reports_bad_data(synthetic_data, tmp_path, capsys, caplog):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(
        {"preset": "tiny", "m1_epochs": 1, "m3_epochs": 1, "tree_enabled": False, "lexical_form": "auto"}
    ))
    with caplog.at_level(logging.INFO, logger="shortlist.training"):
        assert cli_main(["train", "--data", str(synthetic_data), "--out", str(tmp_path / "ck"),
                         "--config", str(cfg)]) == 0
    # "auto" tunes both lexical forms on validation and keeps the better one
    values = {m.group(1): float(m.group(2))
              for m in re.finditer(r"lexical form (\w+): validation .* = ([0-9.]+)", caplog.text)}
    assert set(values) == {"shares", "logistic"}
    chosen = Checkpoint.load(tmp_path / "ck")
    assert values[chosen.scoring.lexical_form] == max(values.values()) == values[chosen.token_table.form]
    assert json.loads(capsys.readouterr().out)["scoring"]["lexical_form"] == chosen.scoring.lexical_form
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "lbl.jsonl").write_text('{"uid": "a", "title": "x", "content": ""}\n')
    (bad / "trn.jsonl").write_text('{"uid": "d", "title": "x", "content": "", "target_ind": [3]}\n')
    assert cli_main(["train", "--data", str(bad), "--out", str(tmp_path / "ck2"), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "trn.jsonl:1: target_ind 3 out of range" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def tuning_inputs(ckpt, test_split):
    """The tuner's inputs on the test split (its own behaviour, not a quality claim)."""
    _, texts, q, truths = test_split
    w, b, mu = ckpt.classifiers.weights_, ckpt.classifiers.bias_, ckpt.centroids.vectors_
    sources = CandidateSources(ckpt.scoring.shortlist, b, index_w=ckpt.indices[0], index_mu=ckpt.indices[1],
                               table=ckpt.token_table, lexical=True)
    return q, texts.ids.numpy(), texts.weights.numpy(), truths, [sources], LabelScorer(w, b, mu, IDENTITY, IDENTITY)


def test_tuning_maximises_the_configured_objective(tuning_inputs):
    head = ScoringTuner(objective={"P@1": 1.0}).fit(*tuning_inputs)
    tail = ScoringTuner(objective={"PSP@5": 1.0}).fit(*tuning_inputs)
    assert head.scoring_ != tail.scoring_
    assert head.metrics_["P@1"] >= tail.metrics_["P@1"] and tail.metrics_["PSP@5"] >= head.metrics_["PSP@5"]
    assert head.metrics_["P@1"] > tail.metrics_["P@1"] or tail.metrics_["PSP@5"] > head.metrics_["PSP@5"]
    default = ScoringTuner().fit(*tuning_inputs)
    for other in (head, tail):
        assert objective_value(default.metrics_, DEFAULT_OBJECTIVE) >= objective_value(
            other.metrics_, DEFAULT_OBJECTIVE)


def test_the_tuning_log_states_the_objective_as_the_sum_it_maximises(tuning_inputs, caplog):
    assert objective_text({"P@1": 1.0, "P@5": 1.0, "PSP@5": 1.0}) == "P@1 + P@5 + PSP@5"
    assert objective_text({"P@1": 0.5, "PSP@5": 2.0}) == "0.5 P@1 + 2 PSP@5"
    with caplog.at_level("INFO", logger="shortlist.training"):
        ScoringTuner(objective={"P@1": 0.5, "PSP@5": 2.0}).fit(*tuning_inputs)
    lines = [r.getMessage() for r in caplog.records if "to the best" in r.getMessage()]
    assert lines and all("validation 0.5 P@1 + 2 PSP@5 = " in line for line in lines)


def test_tuning_serves_the_cheapest_sources_within_the_margin(ckpt, tuning_inputs):
    q, tokens, weights, truths, _, scorer = tuning_inputs
    b, (index_w, index_mu), table = ckpt.classifiers.bias_, ckpt.indices, ckpt.token_table
    cfg = TrainConfig.from_dict({"tune_sources": True, "serve_k_w": 0, "serve_k_mu": 0, "tune_k_hnsw": 30},
                                TrainConfig.tiny())
    choices = cfg.shortlist_choices(has_table=True)
    assert choices[0] == (0, 0, 10) and len(choices) == 8 and (30, 30, 20) in choices
    sources = [CandidateSources(Shortlist.served(w, mu, t, 32, True), b, index_w=index_w, index_mu=index_mu,
                                table=table if t else None, lexical=bool(t)) for w, mu, t in choices]
    best = ScoringTuner(margin=0.0).fit(q, tokens, weights, truths, sources, scorer)
    # each choice valued at its form's scoring tuned on the widest; the chosen one tuned in full
    assert best.value_ >= max(t["value"] for t in best.tried_) - 1e-3
    assert len(best.tried_) == 8
    cheapest = ScoringTuner(margin=1e9).fit(q, tokens, weights, truths, sources, scorer)
    spec = cheapest.sources_.spec
    assert (spec.k_w, spec.k_mu, spec.k_tok) == (0, 0, 10)
    assert source_cost(best.sources_) >= source_cost(cheapest.sources_)


def _two_sources(ckpt, tuning_inputs, docs: list[int]) -> tuple:
    """The tuner's inputs on `docs` only, with a cheap source (the closest centroid) and a costly
    one (both HNSW searches at 30, 20 labels per token and the head)."""
    q, tokens, weights, truths, _, scorer = tuning_inputs
    b, (index_w, index_mu), table = ckpt.classifiers.bias_, ckpt.indices, ckpt.token_table
    cheap = CandidateSources(Shortlist.served(0, 1, 0, 0, True), b, index_mu=index_mu)
    costly = CandidateSources(Shortlist.served(30, 30, 20, 32, True), b, index_w=index_w, index_mu=index_mu,
                              table=table)
    sub = Truths([_truth(truths, i) for i in docs], truths.inv_propensity)
    return q[docs], tokens[docs], weights[docs], sub, [cheap, costly], scorer


def _truth(truths: Truths, doc: int) -> list[int]:
    start = int(truths.sizes[:doc].sum())
    return [int(k % truths.span) for k in truths._keys[start:start + truths.sizes[doc]]]


def _fixed(**kwargs) -> ScoringTuner:
    """A tuner whose every scoring ranks alike (centroid similarity alone), so that a document's
    value does not depend on the others tuned with it."""
    return ScoringTuner(alphas=(0.0,), lexical_weights=(0.0,), **{"margin": 0.0, **kwargs})


def test_a_costlier_source_is_served_only_where_it_pays_beyond_the_validation_noise(ckpt, tuning_inputs):
    values = [[t["value"] for t in _fixed().fit(*_two_sources(ckpt, tuning_inputs, [i])).tried_]
              for i in range(100)]
    costly_ahead = [i for i, (cheap, costly) in enumerate(values) if costly > cheap]
    tie = [i for i, (cheap, costly) in enumerate(values) if costly == cheap]
    assert len(costly_ahead) >= 8 and tie
    # Two documents, the costly source ahead on one: far ahead, and noise (a quarter of the
    # resamples draw only the other document).
    noisy = _two_sources(ckpt, tuning_inputs, [costly_ahead[0], tie[0]])
    tuned = _fixed().fit(*noisy)
    assert tuned.tried_[1]["value"] > tuned.tried_[0]["value"] + 10
    assert tuned.tried_[0]["below_share"] == pytest.approx(0.75, abs=0.05)
    assert tuned.sources_.spec.k_tok == 0
    assert _fixed(level=0.0).fit(*noisy).sources_.spec.k_tok == 20  # the margin alone: the rule before
    # Ahead on eight of nine documents: below on all resamples but the few drawing only the ninth.
    paying = _two_sources(ckpt, tuning_inputs, [*costly_ahead[:8], tie[0]])
    tuned = _fixed().fit(*paying)
    assert tuned.sources_.spec.k_tok == 20 and tuned.tried_[0]["below_share"] >= 0.99
    assert _fixed(margin=1e9).fit(*paying).sources_.spec.k_tok == 0  # within the margin


def test_the_source_bootstrap_is_deterministic_given_a_seed(ckpt, tuning_inputs):
    inputs = _two_sources(ckpt, tuning_inputs, list(range(0, 120, 3)))
    first, again = _fixed(seed=3).fit(*inputs), _fixed(seed=3).fit(*inputs)
    assert first.tried_ == again.tried_ and first.scoring_ == again.scoring_
    shares = [t["below_share"] for t in first.tried_]
    assert min(shares) == 0.0 and 0.0 <= max(shares) <= 1.0
    with pytest.raises(ValueError, match=r"level must be in \[0, 1\]"):
        ScoringTuner(level=1.5)


def test_tuning_without_own_labels_scores_what_exclusion_serves(ckpt, tuning_inputs, test_split):
    q, tokens, weights, truths, candidates, scorer = tuning_inputs
    plain = ScoringTuner().fit(*tuning_inputs)
    # Pretend each document whose best label is wrong is that label (its own, never a target).
    cands, lexical = candidates[0](tokens, weights, q)
    served = LabelScorer.of(scorer.w, scorer.b, scorer.mu, plain.scoring_)
    top = cands[np.arange(len(q)), served.score(q, cands, plain.scoring_.alpha, lexical).argmax(axis=1)]
    own = np.array([t if t not in truth else -1 for t, truth in zip(top, test_split[0].targets, strict=True)])
    assert (own >= 0).sum() > 20
    tuned = ScoringTuner().fit(q, tokens, weights, truths, candidates, scorer, own=own)
    assert tuned.metrics_["P@1"] > plain.metrics_["P@1"]  # the wrong best labels are gone
    chosen = LabelScorer.of(scorer.w, scorer.b, scorer.mu, tuned.scoring_)
    scores = chosen.score(q, cands, tuned.scoring_.alpha, lexical)
    scores[cands == own[:, None]] = -np.inf
    ranked = cands[np.arange(len(q))[:, None], np.argsort(-scores, axis=1, kind="stable")[:, :5]]
    expected = ranking_metrics(ranked, truths, (1, 5))
    for name in ("P@1", "P@5", "PSP@5"):
        assert tuned.metrics_[name] == pytest.approx(expected[name], abs=1e-9)


@pytest.mark.parametrize(
    ("objective", "message"),
    [
        ({}, "non-empty"),
        ({"P@2": 1.0}, r"unknown metrics \['P@2'\]"),
        ({"P@1": -1.0}, r"'tune_objective.P@1' must be a finite number in \[0, 1000000\]"),
        ({"P@1": float("nan")}, r"'tune_objective.P@1' must be a finite number in \[0, 1000000\]"),
        ({"P@1": "1"}, r"'tune_objective.P@1' must be a finite number in \[0, 1000000\]"),
        ({"P@1": 0.0, "PSP@5": 0}, "all weights are 0"),
    ],
)
def test_tune_objective_is_validated(objective: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_dict({"tune_objective": objective})
    weights = {"P@1": 2, "PSP@5": 0.5}
    assert TrainConfig.from_dict({"tune_objective": weights}).tune_objective == weights


def test_progress_off_a_terminal_is_a_log_line_every_few_seconds(caplog, monkeypatch):
    clock = iter(range(0, 1000, 3))  # each step takes 3 "seconds"
    monkeypatch.setattr("training.progress.time.monotonic", lambda: next(clock))
    bar = Progress(range(10), "Module I epoch 1/1", every_s=10.0)
    with caplog.at_level(logging.INFO, logger="shortlist.training"):
        for i in bar:
            bar.postfix(loss=f"{i:.1f}")
    lines = [r.getMessage() for r in caplog.records]
    assert 2 <= len(lines) <= 3 and all("\r" not in line for line in lines)
    assert lines[0].startswith("Module I epoch 1/1: 4/10 (40%)") and "loss=" in lines[0]


def test_retune_chooses_the_sources_again_and_keeps_the_rest_of_the_checkpoint(checkpoints, synthetic_data,
                                                                              tmp_path, capsys):
    source = checkpoints["v1"]
    cfg = tmp_path / "tune.json"
    cfg.write_text(json.dumps({"tune_sources": True, "tune_source_margin": 1e9}))
    out = tmp_path / "retuned"
    assert cli_main(["train", "--data", str(synthetic_data), "--out", str(out), "--retune", str(source),
                     "--config", str(cfg)]) == 0
    before, after = Checkpoint.load(source), Checkpoint.load(out)
    assert before.scoring.shortlist.k_w == 20 and after.config["tune_sources"] and after.config["seed"] == 1
    spec = after.scoring.shortlist
    assert (spec.k_w, spec.k_mu, spec.k_tok) == (0, 0, 10)  # any source is within the margin: the cheapest
    choices = TrainConfig.from_dict(after.config).shortlist_choices(has_table=True)
    assert len(after.metrics["shortlists_tried"]) == len(choices) == 18
    assert after.metrics["module1"] == before.metrics["module1"]
    assert {"gap", "below_share"} <= set(after.metrics["shortlists_tried"][0])
    for name in ("classifiers.npy", "centroids.npy", "encoder.pt", "hnsw_w.bin", "token_shortlist.npz", "tree.npz"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    cfg.write_text(json.dumps({"m3_epochs": 1}))
    assert cli_main(["train", "--data", str(synthetic_data), "--out", str(out), "--retune", str(source),
                     "--config", str(cfg)]) == 2
    assert "a retune changes only" in capsys.readouterr().err


def test_refit_tree_keeps_the_rest_of_the_checkpoint_and_refuses_other_keys(checkpoints, synthetic_data, tmp_path,
                                                                            capsys):
    source = checkpoints["v1"]
    cfg = tmp_path / "tree.json"
    cfg.write_text(json.dumps({"tree": {"beam": 7, "epochs": 1}}))
    out = tmp_path / "refit"
    assert cli_main(["train", "--data", str(synthetic_data), "--out", str(out), "--refit-tree", str(source),
                     "--config", str(cfg)]) == 0
    before, after = Checkpoint.load(source), Checkpoint.load(out)
    assert int(after.tree.arrays_["default_beam"]) == 7 and after.config["tree"]["epochs"] == 1
    assert "lexical_bias" in after.tree.arrays_
    for name in ("classifiers.npy", "centroids.npy", "encoder.pt", "token_shortlist.npz", "tokenizer.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert after.scoring == before.scoring and after.metrics == before.metrics
    cfg.write_text(json.dumps({"tree": {}, "m3_epochs": 1}))
    assert cli_main(["train", "--data", str(synthetic_data), "--out", str(out), "--refit-tree", str(source),
                     "--config", str(cfg)]) == 2
    assert "may hold only a \"tree\" object" in capsys.readouterr().err
    # A tree setting of the wrong kind or range is named before anything is read or trained.
    for tree, message in (({"beam": "wide"}, "'tree.beam' must be an integer, got a string"),
                          ([1], "'tree' must be an object, got a list"),
                          ({"lr": 0}, "'tree.lr' must be a finite number in (0, 10], got 0")):
        cfg.write_text(json.dumps({"tree": tree}))
        for mode in (["--refit-tree", str(source)], []):
            fresh = tmp_path / "never"
            assert cli_main(["train", "--data", str(synthetic_data), "--out", str(fresh), *mode, "--config",
                             str(cfg)]) == 2
            err = capsys.readouterr().err
            assert f"tree.json: training config {message}" in err and "Traceback" not in err, err
            assert not fresh.exists()
    # The command line's settings are checked as the file's.
    for flag, value, message in (
            ("--seed", "-1", "'seed' must be an integer in [0, 4294967295], got -1"),
            ("--aggregated-rounds", "0", "'aggregated_rounds' must be an integer in [1, 1000000], got 0")):
        assert cli_main(["train", "--data", str(synthetic_data), "--out", str(fresh), flag, value]) == 2
        assert f"training config {message}" in capsys.readouterr().err and not fresh.exists()
    other = tmp_path / "other"
    other.mkdir()
    for name in ("lbl.json.gz", "trn.json.gz"):
        (other / name).write_bytes((synthetic_data / name).read_bytes())
    assert cli_main(["train", "--data", str(other), "--out", str(out), "--refit-tree", str(source)]) == 2
    assert "not the data" in capsys.readouterr().err


def test_a_save_that_fails_half_way_leaves_the_checkpoint_there_as_it_was(checkpoints, tmp_path):
    out = tmp_path / "ck"
    shutil.copytree(checkpoints["v1"], out)
    (out / "stale.npy").write_bytes(b"from an older run")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    ckpt = Checkpoint.load(checkpoints["v2"])
    ckpt.validation = [{"text": "x", "target_ind": [0]}, {"not json": object()}]  # fails after the arrays
    with pytest.raises(TypeError):
        ckpt.save(out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no staging left beside it
    ckpt.validation = Checkpoint.load(checkpoints["v2"]).validation
    ckpt.save(out)  # replaced as a whole: the older run's file is gone
    assert not (out / "stale.npy").exists() and Checkpoint.load(out).seed == Checkpoint.load(checkpoints["v2"]).seed
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a checkpoint"):
        ckpt.save(other)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


def test_train_out_a_symlink_replaces_the_checkpoint_it_leads_to_and_keeps_the_link(checkpoints, synthetic_data,
                                                                                    tmp_path, capsys):
    """Audit s14 L5: `train --out LINK` replaced the link with a new directory on the link's disk and
    left a .LINK.old-PID symlink beside it."""
    disk = tmp_path / "bigdisk"
    disk.mkdir()
    shutil.copytree(checkpoints["v2"], disk / "ck")
    link = tmp_path / "ck"
    link.symlink_to(disk / "ck")
    assert cli_main(["train", "--data", str(synthetic_data), "--out", str(link), "--retune",
                     str(checkpoints["v1"])]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == str(link)
    assert link.is_symlink() and os.readlink(link) == str(disk / "ck")
    assert Checkpoint.load(disk / "ck").seed == 1  # v2's replaced by v1's retune, where the link leads
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bigdisk", "ck"]  # nothing left beside either
    assert sorted(p.name for p in disk.iterdir()) == ["ck"]
    ckpt = Checkpoint.load(checkpoints["v2"])
    (tmp_path / "new").symlink_to(disk / "new")  # leads where nothing is yet: written there
    ckpt.save(tmp_path / "new")
    assert Checkpoint.load(disk / "new").seed == 2 and (tmp_path / "new").is_symlink()
    (disk / "notes").mkdir()
    (disk / "notes" / "mine.txt").write_text("mine")
    (tmp_path / "notes").symlink_to(disk / "notes")
    with pytest.raises(ValueError, match=re.escape(f"{disk / 'notes'}: exists and is not a checkpoint (no "
                                                   f"checkpoint.json) ({tmp_path / 'notes'} leads to it)")):
        ckpt.save(tmp_path / "notes")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(ValueError, match="loop: a symlink that leads to no folder"):
        ckpt.save(tmp_path / "loop")
    assert [p.name for p in (disk / "notes").iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bigdisk", "ck", "loop", "new", "notes"]
    assert sorted(p.name for p in disk.iterdir()) == ["ck", "new", "notes"]


def _dataset(folder: Path, source: Path, trn_rows: list[dict]) -> Path:
    """`source`'s labels with `trn_rows` as the training documents (no test split)."""
    folder.mkdir()
    shutil.copy(source / "lbl.json.gz", folder / "lbl.json.gz")
    (folder / "trn.jsonl").write_text("".join(json.dumps(row) + "\n" for row in trn_rows))
    return folder


def test_data_that_cannot_teach_exits_2_naming_the_file_before_training(synthetic_data, tmp_path, capsys, caplog):
    """Audit s13 G5: these trained to exit 0 and reported test metrics of nothing learnt."""
    rows = [json.loads(line) for line in gzip.open(synthetic_data / "trn.json.gz", "rt")][:200]
    unlabelled = _dataset(tmp_path / "unlabelled", synthetic_data, [{**r, "target_ind": [], "target_rel": []}
                                                                     for r in rows])
    emoji = _dataset(tmp_path / "emoji", synthetic_data, [{**r, "title": "\U0001F600 \U0001F680 \u2603"} for r in rows])
    two = _dataset(tmp_path / "two", synthetic_data, rows[:2])
    cases = [(unlabelled, "no training document has a label (target_ind is empty in all 190)"),
             (emoji, "no training document has a token of the vocabulary (all 190 texts are symbols, emoji or other "
                     "characters the tokenizer drops)"),
             (two, "1 training documents have both a label and a token of the vocabulary, fewer than "
                   "min_train_docs (10): too few to learn from")]
    cfg = tmp_path / "tiny.json"
    cfg.write_text('{"preset": "tiny"}')
    with caplog.at_level(logging.INFO, logger="shortlist.training"):
        for data, message in cases:
            assert cli_main(["train", "--data", str(data), "--out", str(tmp_path / "ck"), "--config", str(cfg)]) == 2
            err = capsys.readouterr().err
            assert err == f"shortlist train: error: {data / 'trn.jsonl'}: {message}\n"
    assert "Module I" not in caplog.text and not (tmp_path / "ck").exists()  # refused before the long part


def test_no_token_of_the_vocabulary_names_its_actual_cause(synthetic_data, tmp_path, capsys):
    """Audit 7 F6: every title empty, and a min_df that empties the vocabulary, were both refused as
    texts of "symbols, emoji or other characters the tokenizer drops": a user looked for an
    encoding problem that was not there."""
    rows = [json.loads(line) for line in gzip.open(synthetic_data / "trn.json.gz", "rt")][:200]
    untitled = _dataset(tmp_path / "untitled", synthetic_data, [{**r, "title": ""} for r in rows])
    tiny, min_df = tmp_path / "tiny.json", tmp_path / "min_df.json"
    tiny.write_text('{"preset": "tiny"}')
    min_df.write_text('{"preset": "tiny", "min_df": 1000000}')
    cases = [(untitled, tiny, "(all 190 texts are empty or blank: the text field is title; --text-field "
                              "title+content reads the content too)"),
             (_dataset(tmp_path / "words", synthetic_data, rows), min_df,
              "(min_df 1000000 left the vocabulary empty: the most frequent token, ")]
    for data, cfg, message in cases:
        assert cli_main(["train", "--data", str(data), "--out", str(tmp_path / "ck"), "--config", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert message in err and "symbols, emoji" not in err, err
    # Words in the texts, none kept by the vocabulary (its one token is only in the label texts).
    fitted_on = ["gamma delta", "gamma", "alpha beta"]
    fit = TokenizerFit(Tokenizer.fit(fitted_on, min_df=2), fitted_on, "title")
    cause = no_token_cause(["alpha beta"], fit, dataclasses.replace(TrainConfig.tiny(), min_df=2))
    assert cause == ("1 of the 1 texts have words, none among the vocabulary's 1 tokens (min_df 2, max_vocab "
                     f"{TrainConfig.tiny().max_vocab}): the most frequent token, 'gamma', is in 2 of the 3 texts "
                     "it was fitted on (training documents and labels)")
    assert "symbols, emoji" in no_token_cause(["\u2603 \U0001F600", ""], fit, TrainConfig.tiny())


def test_the_data_minimums_are_enforced_at_and_past_their_edges_and_small_data_is_recorded(synthetic_data, tmp_path):
    rows = [json.loads(line) for line in gzip.open(synthetic_data / "trn.json.gz", "rt")][:12]
    data = _dataset(tmp_path / "twelve", synthetic_data, rows)  # val_fraction 0.2: 10 train, 2 validation
    edge = {"val_fraction": 0.2, "min_train_docs": 10, "min_val_docs": 2, "small_train_docs": 10, "small_val_docs": 3,
            "m1_epochs": 1, "m3_epochs": 1, "lexical_epochs": 1, "tree_enabled": False}
    for past, message in (({"min_train_docs": 11}, r"trn\.jsonl: 10 training documents .* fewer than min_train_docs "
                                                   r"\(11\)"),
                          ({"min_val_docs": 3}, r"trn\.jsonl: the validation split carved from it \(val_fraction 0\.2, "
                                                r"val_max_docs 300\) has 2 documents with both a label and a "
                                                r"token of the vocabulary, fewer than min_val_docs \(3\)")):
        with pytest.raises(ValueError, match=message):
            train(data, TrainConfig.from_dict({**edge, **past}, TrainConfig.tiny()))
    # Without tuning (nor Module III's validation stop) the validation split decides nothing.
    train(data, TrainConfig.from_dict({**edge, "min_val_docs": 3, "tune": False}, TrainConfig.tiny()))
    ckpt = train(data, TrainConfig.from_dict(edge, TrainConfig.tiny()))
    # At small_train_docs no warning; below small_val_docs one, kept with the checkpoint.
    assert ckpt.metrics["data_warnings"] == [
        f"{data / 'trn.jsonl'}: the validation split carved from it (val_fraction 0.2, val_max_docs 300) has 2 "
        "documents with both a label and a token of the vocabulary (small_val_docs 3): the tuned scoring is noisy"]
    ckpt.save(tmp_path / "ck")
    assert Checkpoint.load(tmp_path / "ck").metrics["data_warnings"] == ckpt.metrics["data_warnings"]


def test_min_val_docs_counts_only_validation_documents_with_a_token(synthetic_data, tmp_path):
    """Audit s14 L8: 60% emoji-only documents, every one labelled: the validation split passed
    min_val_docs on documents only the prior can answer."""
    rows = [json.loads(line) for line in gzip.open(synthetic_data / "trn.json.gz", "rt")][:400]
    emoji = "\U0001F600 \U0001F680 \u2603"
    data = _dataset(tmp_path / "emoji60", synthetic_data, [{**r, "title": emoji} if i % 5 < 3 else r
                                                           for i, r in enumerate(rows)])
    assert all(r["target_ind"] for r in rows)
    cfg = {"min_val_docs": 1, "small_val_docs": 0}
    val = TrainingSet.load(data, TrainConfig.from_dict(cfg, TrainConfig.tiny()), "title",
                           np.random.default_rng(0)).val
    judged = sum(1 for text in val.texts if text != emoji)
    assert 0 < judged < len(val)  # all have a label: counting those, min_val_docs judged + 1 passed
    at_edge = TrainConfig.from_dict({**cfg, "min_val_docs": judged}, TrainConfig.tiny())
    assert TrainingSet.load(data, at_edge, "title", np.random.default_rng(0)).val.texts == val.texts
    past = TrainConfig.from_dict({**cfg, "min_val_docs": judged + 1}, TrainConfig.tiny())
    with pytest.raises(ValueError, match=rf"trn\.jsonl: the validation split carved from it .* has {judged} documents "
                                         rf"with both a label and a token of the vocabulary, fewer than min_val_docs "
                                         rf"\({judged + 1}\)"):
        TrainingSet.load(data, past, "title", np.random.default_rng(0))


def test_retune_and_refit_tree_refuse_a_checkpoint_whose_files_changed(checkpoints, synthetic_data, tmp_path, capsys):
    changed = tmp_path / "ck"
    shutil.copytree(checkpoints["v1"], changed)
    data = bytearray((changed / "centroids.npy").read_bytes())
    data[-1] ^= 0xFF  # one value of the last centroid
    (changed / "centroids.npy").write_bytes(bytes(data))
    for mode in ("--retune", "--refit-tree"):
        assert cli_main(["train", "--data", str(synthetic_data), "--out", str(tmp_path / "out"), mode,
                         str(changed)]) == 2
        assert capsys.readouterr().err == (
            f"shortlist train: error: {changed / 'centroids.npy'}: sha256 differs from checkpoint.json's: the file "
            "changed after the checkpoint was saved (edited, or written by another run)\n")
    assert not (tmp_path / "out").exists()


def test_module1_draws_a_soft_positive_by_its_weight() -> None:
    """Module I's positive is drawn in proportion to the label's weight: an imputed label at 0.25
    beside a sure one is drawn about a fifth of the time, not half; a zero weight never."""
    y = target_matrix([[3, 7], [1, 2, 5], [4]], 8, [[1.0, 0.25], [0.0, 0.5, 0.5], [0.3]])
    draw = PositiveDraw(y)
    picks = draw(np.repeat(np.arange(3), 20_000), np.random.default_rng(0)).reshape(3, -1)
    assert np.mean(picks[0] == 7) == pytest.approx(0.2, abs=0.01)
    assert set(picks[0]) == {3, 7} and set(picks[1]) == {2, 5} and set(picks[2]) == {4}
    assert np.mean(picks[1] == 2) == pytest.approx(0.5, abs=0.01)


def test_module1_draw_with_sure_labels_is_the_uniform_draw() -> None:
    """Labels all weighing 1 are drawn uniformly, the same ids as before weights were read; equal
    weights other than 1 (the weighted path) draw the same ids."""
    targets = [[0, 1, 2], [5], [3, 4, 6, 7]]
    rows = np.array([0, 2, 1, 2, 0, 2] * 500)
    got = PositiveDraw(target_matrix(targets, 8))(rows, np.random.default_rng(3))
    u = np.random.default_rng(3).random(len(rows))
    want = [targets[r][int(x * len(targets[r]))] for r, x in zip(rows, u, strict=True)]
    assert got.tolist() == want
    halves = PositiveDraw(target_matrix(targets, 8, [[0.5] * len(t) for t in targets]))
    assert halves.cumulative is not None and halves(rows, np.random.default_rng(3)).tolist() == want
