"""Degenerate but well-formed grouped data (audit 5 B5): each gets a refusal naming the file and the
setting, or the documented behaviour, never a traceback (`shortlist data aggregate`,
`shortlist train --aggregated`)."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from shortlist.cli import main as cli
from training import data as xc_data
from training.aggregated import fit_imputer, tfidf_spaces
from training.config import TrainConfig
from training.eagle import CLOSEST_ONLY, EagleImputer, SkippedChoice, held_out_groups
from training.grouped import load_grouped

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
NUM_LABELS = 6
LBL = [{"uid": f"l{i}", "title": WORDS[i], "content": ""} for i in range(NUM_LABELS)]


def _write(path: Path, rows: list[dict]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _read(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _grouped(root: Path, num_groups: int = 40, labelled: int | None = None, members: int = 3) -> Path:
    """Groups of `members` documents; group g carries label g % 6 (none from `labelled` on) and its
    first member's title holds the label's word."""
    root.mkdir(parents=True, exist_ok=True)
    labelled = num_groups if labelled is None else labelled
    groups = [{"uid": f"g{g}", "target_ind": [g % NUM_LABELS] if g < labelled else []} for g in range(num_groups)]
    docs = [{"uid": f"d{g}_{m}", "title": f"{WORDS[g % NUM_LABELS] if m == 0 else WORDS[6 + m % 4]} x{g}",
             "content": "", "group": f"g{g}"} for g in range(num_groups) for m in range(members)]
    _write(root / "lbl.json.gz", LBL)
    _write(root / "trn.json.gz", docs)
    _write(root / "groups.json.gz", groups)
    return root


def _ordinary(root: Path, num_docs: int = 12, labelled: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    _write(root / "lbl.json.gz", LBL)
    _write(root / "trn.json.gz", [{"uid": f"d{i}", "title": f"{WORDS[i % NUM_LABELS]} x{i}", "content": "",
                                   "target_ind": [i % NUM_LABELS] if labelled else []} for i in range(num_docs)])
    return root


def _train(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], **config: object) -> tuple[int, str]:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"preset": "tiny", "tree_enabled": False, **config}))
    code = cli(["train", "--data", str(data), "--out", str(tmp_path / "ckpt"), "--config", str(path), "--aggregated"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def _fit(data: Path, **config: object) -> tuple[EagleImputer, list[list[int]]]:
    cfg = replace(TrainConfig.tiny(), **config)
    labels = xc_data.load_labels(data)
    grouped = load_grouped(data, "title", len(labels))
    x, z = tfidf_spaces(grouped.texts, labels.texts, cfg)
    imputer = fit_imputer(grouped, x, len(labels), cfg, z)
    return imputer, imputer.impute()


def test_no_group_with_a_label_is_refused_naming_the_groups_file(tmp_path: Path, capsys) -> None:
    data = _grouped(tmp_path / "g", labelled=0)
    code, err = _train(data, tmp_path, capsys)
    assert code == 2
    assert f"{data / 'groups.json.gz'}: no group has a label (target_ind is empty in all 40)" in err


def test_one_group_of_every_document_chooses_nothing_and_imputes_by_the_papers_method(tmp_path: Path, caplog) -> None:
    data = _grouped(tmp_path / "g")
    groups = _read(data / "groups.json.gz")
    union = sorted({t for g in groups for t in g["target_ind"]})
    _write(data / "groups.json.gz", [{"uid": "all", "target_ind": union}])
    _write(data / "trn.json.gz", [dict(d, group="all") for d in _read(data / "trn.json.gz")])
    # One group with a label cannot be split into one to learn from and one to choose on: none is
    # held out, fewer than any minimum; the paper's method is used and a warning says why.
    for minimum in (10, 1):
        caplog.clear()
        imputer, imputed = _fit(data, aggregated_min_val_groups=minimum)
        assert imputer.choice_skipped_ == SkippedChoice(0, 1, minimum)
        assert (imputer.iterations_, imputer.keep_ratio_) == (TrainConfig.tiny().aggregated_iterations, CLOSEST_ONLY)
        assert imputer.validation_scores_ == [] and imputer.keep_ratio_scores_ == []
        assert (f"{data / 'groups.json.gz'}: aggregated_validation 0.1 holds out 0 of its 1 groups with a label, "
                f"fewer than aggregated_min_val_groups ({minimum}): nothing chosen on them") in caplog.text
        assert set().union(*map(set, imputed)) == set(range(NUM_LABELS))


@pytest.mark.parametrize(("minimum", "chosen"), [(10, True), (11, False)])
def test_aggregated_min_val_groups_at_and_past_its_edge(tmp_path: Path, minimum: int, chosen: bool) -> None:
    """40 groups with a label at aggregated_validation 0.25: 10 held out."""
    data = _grouped(tmp_path / "g")
    imputer, _ = _fit(data, aggregated_validation=0.25, aggregated_min_val_groups=minimum)
    if chosen:
        assert imputer.choice_skipped_ is None and imputer.keep_ratio_scores_ and imputer.validation_scores_
    else:
        assert imputer.choice_skipped_ == SkippedChoice(10, 40, 11)
        assert imputer.keep_ratio_scores_ == [] and imputer.validation_scores_ == []
        assert imputer.keep_ratio_ == CLOSEST_ONLY


def test_held_out_groups_are_drawn_among_the_groups_with_a_label() -> None:
    labelled = sp.csr_matrix(np.ones((50, 3), np.float32))
    # Every group labelled: the draw that holding out among all groups made (results stay reproducible).
    old = np.sort(np.random.default_rng(4).choice(50, 5, replace=False))
    assert held_out_groups(labelled, 0.1, 4).tolist() == old.tolist()
    some = sp.csr_matrix(np.r_[np.ones((30, 3)), np.zeros((20, 3))].astype(np.float32))
    held = held_out_groups(some, 0.25, 0)
    assert len(held) == 8 and held.max() < 30  # round(0.25 * 30), none of the 20 unlabelled groups
    assert len(held_out_groups(some, 0.999, 0)) == 29  # one group with a label is left to learn from
    assert len(held_out_groups(some, 0.0, 0)) == 0


def test_a_choice_on_too_few_groups_is_not_made_and_a_given_keep_ratio_is_kept(tmp_path: Path, capsys,
                                                                               caplog) -> None:
    """Unlabelled groups do not count: 20 of 60 groups carry a label, 2 held out at 0.1."""
    data = _grouped(tmp_path / "g", num_groups=60, labelled=20)
    # Imputed with a warning (training then needs more labelled documents than this tiny set has).
    _train(data, tmp_path, capsys, aggregated_min_val_groups=3)
    assert "holds out 2 of its 20 groups with a label, fewer than aggregated_min_val_groups (3): nothing chosen" in \
        caplog.text
    # Nothing is chosen without a validation share, or with the ratio given and no iterations;
    # too few groups keep a given ratio.
    for config in ({"aggregated_validation": 0.0, "aggregated_keep_ratio": 0.7},
                   {"aggregated_iterations": 0, "aggregated_keep_ratio": 0.7, "aggregated_min_val_groups": 3},
                   {"aggregated_keep_ratio": 0.7, "aggregated_min_val_groups": 3}):
        imputer, _ = _fit(data, **config)
        assert imputer.keep_ratio_ == 0.7 and imputer.keep_ratio_scores_ == []


def test_one_member_groups_unlabelled_groups_and_tokenless_groups_impute_as_documented(tmp_path: Path) -> None:
    """A group of one gives its labels to its member; a group without labels gives its members
    none; a group whose members have no token of the vocabulary gives its labels to all of them
    (they score alike; training counts none of them: they have no token)."""
    data = _grouped(tmp_path / "g", num_groups=40, labelled=39)
    docs = _read(data / "trn.json.gz")
    docs = [d for d in docs if d["group"] != "g2" or d["uid"] == "d2_0"]  # g2: one member
    docs = [dict(d, title="!!! ???") if d["group"] == "g0" else d for d in docs]  # g0: no tokens
    _write(data / "trn.json.gz", docs)
    imputer, imputed = _fit(data, aggregated_min_val_groups=1)
    by_uid = dict(zip((d["uid"] for d in docs), imputed, strict=True))
    assert by_uid["d2_0"] == [2]
    assert [by_uid[f"d39_{m}"] for m in range(3)] == [[], [], []]
    assert [by_uid[f"d0_{m}"] for m in range(3)] == [[0], [0], [0]]


def test_held_out_members_without_a_neighbour_score_every_keep_ratio_zero() -> None:
    """Held-out members with no features have no similar document to read labels off: every keep
    ratio finds none of their labels, and the highest ratio (the closest member alone) is kept."""
    features = np.r_[np.eye(3)[[0, 1, 2, 0, 1, 2]], np.zeros((2, 3))].astype(np.float32)
    members = sp.csr_matrix(np.kron(np.eye(4), np.ones((1, 2))))
    group_labels = sp.csr_matrix(np.ones((4, 2), np.float32))
    imputer = EagleImputer(iterations=0, assignment="relative", validation=0.1, seed=0)
    held = held_out_groups(group_labels, 0.1, 0)
    assert held.tolist() == [3]  # seed 0 holds out group 3, the featureless one
    imputer.fit(features, members, group_labels)
    assert imputer.keep_ratio_scores_ == [0.0] * 11 and imputer.keep_ratio_ == 1.0


def test_data_aggregate_at_its_edges(tmp_path: Path, capsys, caplog) -> None:
    data = _ordinary(tmp_path / "d")
    for grouping in ("random", "clustered"):
        assert cli(["data", "aggregate", "--data", str(data), "--out", str(tmp_path / f"one_{grouping}"),
                    "--group-size", "1", "--grouping", grouping]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["groups"] == out["documents"] == 12
        groups = {g["uid"]: g["target_ind"] for g in _read(tmp_path / f"one_{grouping}" / "groups.json.gz")}
        assert all(groups[d["group"]] == [int(d["uid"][1:]) % NUM_LABELS]
                   for d in _read(tmp_path / f"one_{grouping}" / "trn.json.gz"))
        # A group size past the data: one group of every document: nothing chosen on held-out groups,
        # each label to its closest member, too few labelled documents for training.
        big = tmp_path / f"big_{grouping}"
        assert cli(["data", "aggregate", "--data", str(data), "--out", str(big), "--group-size", "1000",
                    "--grouping", grouping]) == 0
        assert json.loads(capsys.readouterr().out)["groups"] == 1
        code, err = _train(big, tmp_path, capsys)
        assert code == 2 and "holds out 0 of its 1 groups with a label" in caplog.text and "min_train_docs (10)" in err


def test_data_aggregate_refuses_a_dataset_without_labels(tmp_path: Path, capsys) -> None:
    data = _ordinary(tmp_path / "d", labelled=False)
    assert cli(["data", "aggregate", "--data", str(data), "--out", str(tmp_path / "g"), "--group-size", "4",
                "--grouping", "random"]) == 2
    err = capsys.readouterr().err
    assert f"{data / 'trn.json.gz'}: no training document has a label (target_ind is empty in all 12)" in err
    assert "Traceback" not in err and not (tmp_path / "g" / "groups.json.gz").exists()


def test_data_aggregate_refuses_to_write_over_the_data_it_reads(tmp_path: Path, capsys) -> None:
    data = _ordinary(tmp_path / "d")
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    (tmp_path / "link").symlink_to(data)
    for out in (data, tmp_path / "link", data / ".." / "d"):
        assert cli(["data", "aggregate", "--data", str(data), "--out", str(out), "--group-size", "4",
                    "--grouping", "random"]) == 2
        assert f"--out {out}: is the --data folder" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before  # the documents' own labels kept


def test_documents_without_tokens_are_refused_after_imputation_not_crashed(tmp_path: Path, capsys) -> None:
    """With every document tokenless the choice of keep ratio finds no neighbour (it crashed with an
    IndexError); with the held-out groups' documents tokenless and uncentred features it scores them
    0 and imputation goes on (training then stops at min_train_docs, set past the data to be quick)."""
    data = _grouped(tmp_path / "all")
    _write(data / "trn.json.gz", [dict(d, title="!!!") for d in _read(data / "trn.json.gz")])
    code, err = _train(data, tmp_path, capsys, aggregated_validation=0.25)
    assert code == 2 and "no training document has a token of the vocabulary" in err
    data = _grouped(tmp_path / "held")
    held = {f"g{g}" for g in held_out_groups(sp.csr_matrix(np.ones((40, 1))), 0.25, TrainConfig.tiny().seed)}
    _write(data / "trn.json.gz", [dict(d, title="!!!") if d["group"] in held else d
                                  for d in _read(data / "trn.json.gz")])
    code, err = _train(data, tmp_path, capsys, aggregated_validation=0.25, aggregated_center=False,
                       min_train_docs=10**6)
    assert code == 2 and "fewer than min_train_docs (1000000)" in err


@pytest.mark.parametrize(("minimum", "refused"), [(5, False), (6, True)])
def test_a_posterior_fold_with_too_few_documents_is_refused_naming_the_folds(
        tmp_path: Path, capsys, minimum: int, refused: bool) -> None:
    data = _grouped(tmp_path / "g", num_groups=12, members=1)  # two folds of 6 groups of one document
    code, err = _train(data, tmp_path, capsys, aggregated_rounds=2, aggregated_posterior_folds=2,
                       min_train_docs=minimum, tune=False, m3_min_gain=None)
    assert code == (2 if refused else 0), err
    if refused:  # 6 documents a fold's model, one of them carved for validation
        assert "aggregated_posterior_folds 2: posterior model 1 of 2 (trained on 6 of 12 documents): " in err
        assert f"5 training documents have both a label and a token of the vocabulary, fewer than " \
               f"min_train_docs ({minimum})" in err and err.rstrip().endswith("use fewer folds (1: one model on " \
                                                                             "every group)"), err
