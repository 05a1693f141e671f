"""Training from aggregated (group-level) labels: the grouped format, EAGLE's imputation, the CLI."""

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
from training.aggregate_data import aggregate, clustered_groups, random_groups
from training.aggregated import impute, tfidf_features, tfidf_spaces
from training.config import TrainConfig
from training.eagle import KEEP_RATIOS, EagleImputer
from training.eagle_space import normalize_rows
from training.grouped import load_grouped
from training.synthetic import generate


def _toy() -> tuple[np.ndarray, sp.csr_matrix, sp.csr_matrix, np.ndarray]:
    """Three groups of two documents, x and -x; labels 0 and 1 both tag all three groups."""
    x = np.array([3.0, 4.0, 0.0], dtype=np.float32)
    features = np.vstack([x, -x] * 3)
    members = sp.csr_matrix(np.kron(np.eye(3), np.ones((1, 2))))
    group_labels = sp.csr_matrix(np.ones((3, 2)))
    return features, members, group_labels, x / np.linalg.norm(x)


@pytest.mark.parametrize("sparse", [False, True])
def test_the_papers_toy_example(sparse: bool) -> None:
    features, members, group_labels, unit_x = _toy()
    naive = normalize_rows(np.asarray(group_labels.T @ members @ features))
    assert np.allclose(naive, 0.0)  # the union of the groups' members cancels out
    imputer = EagleImputer(iterations=10, step=0.5, seed=3, assignment="closest").fit(
        sp.csr_matrix(features) if sparse else features, members, group_labels)
    vectors = imputer.label_vectors_.toarray() if sparse else imputer.label_vectors_
    for v in vectors:  # a seeded member of one of the label's groups breaks the tie: +x or -x, unit norm
        assert np.isclose(np.linalg.norm(v), 1.0) and np.isclose(abs(float(v @ unit_x)), 1.0)
    imputed = imputer.impute()
    for group in range(3):
        first, second = imputed[2 * group], imputed[2 * group + 1]
        assert sorted(first + second) == [0, 1]  # each of the group's labels goes to exactly one member
        for label, v in enumerate(vectors):  # ... the member on its vector's side
            owner = 2 * group if float(v @ unit_x) > 0 else 2 * group + 1
            assert label in imputed[owner]


def _generic_heavy(seed: int = 0) -> tuple[sp.csr_matrix, sp.csr_matrix, sp.csr_matrix, np.ndarray]:
    """Random groups of 4 whose documents all share token 0 at weights from 0.2 to 3 (a word
    every title has); a document has one of 10 labels (token 1 + label) or none, and 2 of 50
    noise tokens. Returns features, members, group labels and each document's label (-1: none)."""
    rng = np.random.default_rng(seed)
    n, labels = 2000, 10
    label_of = np.where(rng.random(n) < 0.5, rng.integers(0, labels, n), -1)
    rows = np.repeat(np.arange(n), 4)
    cols = np.stack([np.zeros(n, int), 1 + np.maximum(label_of, 0), *(11 + rng.integers(0, 50, (2, n)))], 1).ravel()
    vals = np.stack([rng.uniform(0.2, 3.0, n), (label_of >= 0).astype(float), np.ones(n), np.ones(n)], 1).ravel()
    x = sp.csr_matrix((vals, (rows, cols)), shape=(n, 61))
    group_of = random_groups(n, 4, seed)
    members = sp.csr_matrix((np.ones(n), (group_of, np.arange(n))))
    has = label_of >= 0
    group_labels = sp.csr_matrix((np.ones(has.sum()), (group_of[has], label_of[has])), shape=(members.shape[0], labels))
    group_labels.data[:] = 1.0
    return x, members, group_labels, label_of


def _pick_precision(imputed: list[list[int]], label_of: np.ndarray) -> float:
    picks = [(doc, label) for doc, found in enumerate(imputed) for label in found]
    return float(np.mean([label_of[doc] == label for doc, label in picks]))


def test_centring_stops_frequent_labels_going_to_the_most_generic_member() -> None:
    x, members, group_labels, label_of = _generic_heavy()
    precision = {center: _pick_precision(EagleImputer(assignment="closest", center=center).fit(
        x, members, group_labels).impute(), label_of) for center in (False, True)}
    # Uncentred, each label's vector is mostly the shared token: the member heaviest in it wins.
    assert precision[True] > 0.9 and precision[False] < 0.6, precision


def test_a_label_text_anchors_a_label_carried_by_a_single_group() -> None:
    """Eight groups of 4 (features: one-hot tokens), each carrying one label no other group has:
    the members alone cannot say which holds it; the label's text (its holder's token) can."""
    n = 32
    x = sp.identity(n, format="csr", dtype=np.float32)
    members = sp.csr_matrix((np.ones(n), (np.arange(n) // 4, np.arange(n))))
    holder = np.arange(8) * 4 + np.array([3, 1, 2, 0, 3, 2, 1, 0])
    group_labels = sp.identity(8, format="csr", dtype=np.float32)
    texts = x[holder]
    with_text = EagleImputer(assignment="closest", center=True).fit(x, members, group_labels, texts).impute()
    assert all(with_text[d] == [label] for label, d in enumerate(holder))
    assert sum(map(len, with_text)) == 8  # the texts shaped the vectors; only documents get labels
    alone = EagleImputer(assignment="closest", center=True).fit(x, members, group_labels).impute()
    assert sum(label in alone[d] for label, d in enumerate(holder)) < 8


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("aggregated")
    generate(root / "data", num_labels=200, train_docs=1200, test_docs=200, seed=5)
    return {g: aggregate(root / "data", root / g, 4, g, seed=1) and root / g for g in ("random", "clustered")} | {
        "data": root / "data"}


@pytest.mark.parametrize("grouping", ["random", "clustered"])
def test_imputation_recovers_planted_labels_far_above_chance(planted: dict[str, Path], grouping: str) -> None:
    labels = xc_data.load_labels(planted["data"])
    truth = xc_data.load_split(planted["data"], "trn", "title", len(labels)).targets
    grouped = load_grouped(planted[grouping], "title", len(labels))
    x, z = tfidf_spaces(grouped.texts, labels.texts, TrainConfig())
    imputed = impute(grouped, x, len(labels), TrainConfig(), z)
    naive = [grouped.group_targets[g] for g in grouped.group_of]

    def precision(guess: list[list[int]]) -> float:
        return sum(len(set(a) & set(b)) for a, b in zip(guess, truth, strict=True)) / sum(map(len, guess))

    # Chance is the naive precision: a group label belongs to ~1 of its 4 members.
    assert precision(imputed) >= max(0.7, 2 * precision(naive)), (precision(imputed), precision(naive))
    # Dense features (a second round's embeddings) take the same path to the same answer, but
    # for near-ties that float32 sums in another order break the other way.
    for cfg in (TrainConfig(), TrainConfig(aggregated_center=False, aggregated_label_texts=False)):
        dense = impute(grouped, x.toarray(), len(labels), cfg, z.toarray())
        assert np.mean([a == b for a, b in zip(dense, impute(grouped, x, len(labels), cfg, z), strict=True)]) > 0.98


def test_label_scores_agree_between_sparse_and_dense_centred_features(planted: dict[str, Path]) -> None:
    labels = xc_data.load_labels(planted["data"])
    grouped = load_grouped(planted["random"], "title", len(labels))
    x, z = tfidf_spaces(grouped.texts, labels.texts, TrainConfig())
    members, group_labels = grouped.members(), grouped.group_labels(len(labels))
    docs = np.arange(0, len(grouped), 7)
    sparse_scores = EagleImputer(iterations=2, center=True).fit(x, members, group_labels, z).scores(docs)
    dense_scores = EagleImputer(iterations=2, center=True).fit(x.toarray(), members, group_labels,
                                                               z.toarray()).scores(docs)
    assert sparse_scores.shape == (len(docs), len(labels))
    assert np.allclose(sparse_scores, dense_scores, atol=1e-4)


def test_iterations_are_chosen_on_held_out_groups(planted: dict[str, Path]) -> None:
    labels = xc_data.load_labels(planted["data"])
    grouped = load_grouped(planted["clustered"], "title", len(labels))
    x, z = tfidf_spaces(grouped.texts, labels.texts, TrainConfig())
    members, group_labels = grouped.members(), grouped.group_labels(len(labels))
    imputer = EagleImputer(iterations=3, center=True, validation=0.2).fit(x, members, group_labels, z)
    scores = imputer.validation_scores_
    assert 1 <= len(scores) <= 4 and imputer.iterations_ == int(np.argmax(scores))
    assert min(scores) > 0.2  # held-out groups' labels found far above chance (1 in 200)
    imputed = imputer.impute()  # ... and then every group's labels go to its members, none held out
    assert sum(map(len, imputed)) >= group_labels.nnz
    assert set().union(*map(set, imputed)) == set(group_labels.indices.tolist())
    paper = EagleImputer(iterations=3).fit(x, members, group_labels)
    assert paper.iterations_ == 3 and paper.validation_scores_ == []
    with pytest.raises(ValueError, match="validation must be in"):
        EagleImputer(validation=1.0)


def test_expected_counts_give_frequent_labels_to_more_members(planted: dict[str, Path]) -> None:
    labels = xc_data.load_labels(planted["data"])
    truth = xc_data.load_split(planted["data"], "trn", "title", len(labels)).targets
    grouped = load_grouped(planted["random"], "title", len(labels))
    x = tfidf_features(grouped.texts, labels.texts, TrainConfig())
    found = {}
    for assignment in ("closest", "expected"):
        imputer = EagleImputer(assignment=assignment).fit(x, grouped.members(), grouped.group_labels(len(labels)))
        imputed = imputer.impute()
        found[assignment] = sum(len(set(a) & set(b)) for a, b in zip(imputed, truth, strict=True))
        if assignment == "expected":  # never fewer than one member, never more than the group
            pairs = grouped.group_labels(len(labels)).nnz
            assert pairs <= sum(map(len, imputed)) <= 4 * pairs
    assert found["expected"] > found["closest"], found


def test_relative_assignment_keeps_a_label_on_the_members_close_to_the_closest() -> None:
    """Label 0 tags a homogeneous group (four copies of e1) and a mixed one (e1, e2, e3, e4):
    every member of the first keeps it, only the e1 member of the second."""
    features = np.vstack([np.tile([1.0, 0, 0, 0], (4, 1)), np.eye(4)]).astype(np.float32)
    members = sp.csr_matrix(np.kron(np.eye(2), np.ones((1, 4))))
    imputer = EagleImputer(iterations=0, assignment="relative", keep_ratio=0.5).fit(
        features, members, sp.csr_matrix(np.ones((2, 1))))
    assert [d for d, found in enumerate(imputer.impute()) if found] == [0, 1, 2, 3, 4]
    everyone = EagleImputer(iterations=0, assignment="relative", keep_ratio=0.0).fit(
        features, members, sp.csr_matrix(np.ones((2, 1))))
    assert all(found == [0] for found in everyone.impute())  # ratio 0: the naive group labels
    with pytest.raises(ValueError, match="needs a keep_ratio or a validation share"):
        EagleImputer(assignment="relative")
    with pytest.raises(ValueError, match="keep_ratio must be in"):
        EagleImputer(assignment="relative", keep_ratio=1.5)
    with pytest.raises(ValueError, match=r"'aggregated_keep_ratio' must be a finite number in \[0, 1\]"):
        TrainConfig(aggregated_keep_ratio=-0.1).validate()
    with pytest.raises(ValueError, match="needs aggregated_keep_ratio or aggregated_validation"):
        TrainConfig(aggregated_validation=0.0).validate()


def test_soft_labels_weigh_each_member_by_its_score_over_the_closest_members() -> None:
    """The same two groups at keep ratio 0: every member keeps label 0; the homogeneous group's
    members weigh 1, the mixed group's e1 member 1 and the others their score over its (1/5: the
    label vector is the normalised sum 5 e1 + e2 + e3 + e4). The closest member alone weighs 1."""
    features = np.vstack([np.tile([1.0, 0, 0, 0], (4, 1)), np.eye(4)]).astype(np.float32)
    members = sp.csr_matrix(np.kron(np.eye(2), np.ones((1, 4))))
    imputer = EagleImputer(iterations=0, assignment="relative", keep_ratio=0.0).fit(
        features, members, sp.csr_matrix(np.ones((2, 1))))
    assert imputer.impute() == [[0]] * 8
    np.testing.assert_allclose(np.ravel(imputer.impute_weights()), [1, 1, 1, 1, 1, 0.2, 0.2, 0.2], rtol=1e-5)
    closest = EagleImputer(iterations=0, assignment="closest").fit(features, members, sp.csr_matrix(np.ones((2, 1))))
    assert closest.impute_weights() == [[1.0], [], [], [], [1.0], [], [], []]


def test_module3_takes_a_soft_label_as_its_target() -> None:
    """A positive's weight is its binary cross-entropy target, on both of Module III's paths."""
    import torch
    import torch.nn.functional as F

    from training.classifiers import _all_labels_bce, _positives_and_negatives
    from training.dataset import target_matrix

    y = target_matrix([[1, 3], [0]], 5, [[0.25, 1.0], [0.5]])
    np.testing.assert_allclose(y.toarray(), [[0, 0.25, 0, 1, 0], [0.5, 0, 0, 0, 0]])
    logits = torch.linspace(-2, 2, 10).reshape(2, 5)
    dense = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(y.toarray()), reduction="sum") / 2
    torch.testing.assert_close(_all_labels_bce(logits, y, torch.device("cpu")), dense)
    cols, targets = _positives_and_negatives(y, np.array([[2, 3], [4, -1]]))
    assert cols.tolist() == [[1, 3, 2, -1], [0, -1, 4, -1]]
    assert targets.tolist() == [[0.25, 1.0, 0, 0], [0.5, 0, 0, 0]]


def test_validation_weighs_a_soft_label_by_how_sure_it_is(planted: dict[str, Path]) -> None:
    """Training chooses the served scoring on validation documents carved from the imputed labels:
    a label spread over a group's members at weight w is a hit worth w there and counts w towards
    its label's frequency (the propensities), not a sure label on each member."""
    from service.engine.metrics import ranking_metrics
    from training.dataset import TrainingSet

    labels = xc_data.load_labels(planted["data"])
    trn = xc_data.load_split(planted["data"], "trn", "title", len(labels))
    soft = replace(trn, weights=[[0.25] * len(t) for t in trn.targets])
    sure, spread = (TrainingSet.load(planted["data"], TrainConfig.tiny(), "title", np.random.default_rng(0), trn=s)
                    for s in (trn, soft))
    first = np.array([[t[0] if t else -1] for t in sure.val.targets])  # each document's first label

    def p1(data: TrainingSet) -> float:
        return ranking_metrics(first, data.truths(data.val), ks=(1,))["P@1"]

    assert p1(sure) > 90
    assert p1(spread) == pytest.approx(0.25 * p1(sure))
    carried = np.diff(sure.y.tocsc().indptr) > 0
    assert np.all(spread.inv_propensity[carried] > sure.inv_propensity[carried])
    np.testing.assert_array_equal(spread.inv_propensity[~carried], sure.inv_propensity[~carried])


def test_the_quality_gates_rows_carry_the_weights_and_leave_a_weight_of_zero_out(planted: dict[str, Path],
                                                                                 tmp_path: Path) -> None:
    """The validation rows a checkpoint stores for the quality gate keep each imputed label's
    weight; a label of weight 0 is no truth (a member scoring 0 kept at keep ratio 0) and a row
    left without one is not stored, so the bundle's reader, which refuses a weight of 0, reads
    them all."""
    from service.engine.validation_rows import read_validation_rows
    from training.dataset import TrainingSet

    labels = xc_data.load_labels(planted["data"])
    trn = xc_data.load_split(planted["data"], "trn", "title", len(labels))
    weights = [[0.0] + [0.5] * (len(t) - 1) if i % 2 else [0.0] * len(t) for i, t in enumerate(trn.targets)]
    data = TrainingSet.load(planted["data"], TrainConfig.tiny(), "title", np.random.default_rng(0),
                            trn=replace(trn, weights=weights))
    rows = data.validation_rows(10_000)
    pairs = [[(label, x) for label, x in zip(t, w, strict=True) if x > 0]
             for t, w in zip(data.val.targets, data.val.weights, strict=True)]
    want = [([label for label, _ in p], [x for _, x in p]) for p in pairs if p]
    assert [(r["target_ind"], r["target_weight"]) for r in rows] == want
    assert 5 < len(rows) < sum(1 for t in data.val.targets if t)  # rows of only zero weights not stored
    assert {x for r in rows for x in r["target_weight"]} == {0.5}
    path = tmp_path / "validation.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_validation_rows(path, len(labels)) == rows


@pytest.mark.parametrize("grouping", ["random", "clustered"])
def test_the_keep_ratio_chosen_on_held_out_groups_recovers_labels_the_closest_member_drops(
        planted: dict[str, Path], grouping: str) -> None:
    labels = xc_data.load_labels(planted["data"])
    truth = xc_data.load_split(planted["data"], "trn", "title", len(labels)).targets
    grouped = load_grouped(planted[grouping], "title", len(labels))
    x, z = tfidf_spaces(grouped.texts, labels.texts, TrainConfig())
    found = {}
    for assignment in ("closest", "relative"):
        imputer = EagleImputer(assignment=assignment, center=True, validation=0.3).fit(
            x, grouped.members(), grouped.group_labels(len(labels)), z)
        imputed = imputer.impute()
        hits = sum(len(set(a) & set(b)) for a, b in zip(imputed, truth, strict=True))
        found[assignment] = (hits / sum(map(len, imputed)), hits / sum(map(len, truth)))
    assert len(imputer.keep_ratio_scores_) == len(KEEP_RATIOS)
    assert imputer.keep_ratio_ == KEEP_RATIOS[int(np.argmax(imputer.keep_ratio_scores_))] < 1.0
    # More members keep a label than the closest alone: recall rises, precision stays far above
    # chance (the naive precision, about 0.35-0.45 here).
    (precision, recall), (_, closest_recall) = found["relative"], found["closest"]
    assert recall > closest_recall + 0.05 and precision > 0.85, found


def test_groupings_cover_every_document_once_and_clustered_groups_are_alike(planted: dict[str, Path]) -> None:
    labels = xc_data.load_labels(planted["data"])
    trn = xc_data.load_split(planted["data"], "trn", "title", len(labels))
    x = tfidf_features(trn.texts, labels.texts, TrainConfig())
    similarity = {}
    for name, group_of in (("random", random_groups(len(trn), 4, 0)), ("clustered", clustered_groups(x, 4, 0))):
        sizes = np.bincount(group_of)
        assert sizes.sum() == len(trn) and sizes.max() <= 4 and (sizes > 0).all()
        centroid = sp.csr_matrix((np.ones(len(trn)), (group_of, np.arange(len(trn))))) @ x
        similarity[name] = float(np.mean(np.asarray(x.multiply(centroid[group_of]).sum(axis=1))))
    assert similarity["clustered"] > 1.3 * similarity["random"], similarity


def _write(path: Path, rows: list[dict]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


LBL = [{"uid": f"l{i}", "title": f"label {i}", "content": ""} for i in range(3)]
DOCS = [{"uid": "d0", "title": "a b", "content": "", "group": "g0"},
        {"uid": "d1", "title": "c", "content": "", "group": 7}]
GROUPS = [{"uid": "g0", "target_ind": [0, 1]}, {"uid": "7", "target_ind": [2]}]


@pytest.mark.parametrize(("docs", "groups", "message"), [
    ([{**DOCS[0], "group": None}, DOCS[1]], GROUPS,
     r"trn\.json\.gz:1: field 'group' must be a non-empty string or an integer, got null"),
    ([{**DOCS[0], "uid": None}, DOCS[1]], GROUPS, r"trn\.json\.gz:1: field 'uid' must be a non-empty string, got null"),
    (DOCS, [GROUPS[0], {"uid": {"id": 7}, "target_ind": [2]}], r"groups\.json\.gz:2: field 'uid' must be a non-empty "
     r"string or an integer, got an object"),
    ([{k: v for k, v in DOCS[0].items() if k != "group"}, DOCS[1]], GROUPS, r"trn\.json\.gz:1: missing field 'group'"),
    ([DOCS[0], {**DOCS[1], "group": "g9"}], GROUPS, r"trn\.json\.gz:2: group 'g9' is not in groups\.json\.gz"),
    ([DOCS[0]], GROUPS, r"groups\.json\.gz:2: group '7' has no document"),
    (DOCS, [GROUPS[0], {"uid": "7", "target_ind": [3]}], r"groups\.json\.gz:2: target_ind 3 out of range"),
    (DOCS, [GROUPS[0], {"uid": "7", "target_ind": ["2"]}], r"groups\.json\.gz:2: target_ind\[0\] must be an integer"),
    (DOCS, [GROUPS[0], GROUPS[1], {"uid": "g0", "target_ind": []}], r"groups\.json\.gz:3: group 'g0' listed twice"),
    (DOCS, [GROUPS[0], {"target_ind": [1]}], r"groups\.json\.gz:2: missing field 'uid'"),
])
def test_bad_grouped_data_is_refused_naming_file_and_line(tmp_path: Path, docs, groups, message) -> None:
    _write(tmp_path / "lbl.json.gz", LBL)
    _write(tmp_path / "trn.json.gz", docs)
    _write(tmp_path / "groups.json.gz", groups)
    with pytest.raises(ValueError, match=message):
        load_grouped(tmp_path, "title", len(LBL))


def test_good_grouped_data_loads_and_a_missing_groups_file_is_named(tmp_path: Path) -> None:
    _write(tmp_path / "lbl.json.gz", LBL)
    _write(tmp_path / "trn.json.gz", DOCS)
    with pytest.raises(FileNotFoundError, match="no groups file"):
        load_grouped(tmp_path, "title", len(LBL))
    _write(tmp_path / "groups.json.gz", GROUPS)
    grouped = load_grouped(tmp_path, "title", len(LBL))
    assert grouped.group_of.tolist() == [0, 1] and grouped.group_targets == [[0, 1], [2]]


def test_cli_aggregates_then_trains_two_rounds(planted: dict[str, Path], tmp_path: Path, capsys) -> None:
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"preset": "tiny", "tree_enabled": False}))
    assert cli(["data", "aggregate", "--data", str(planted["data"]), "--out", str(tmp_path / "g"),
                "--group-size", "4", "--grouping", "random"]) == 0
    assert cli(["train", "--data", str(tmp_path / "g"), "--out", str(tmp_path / "ckpt"), "--config", str(config),
                "--aggregated", "--aggregated-rounds", "2"]) == 0
    report = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    info = report["metrics"]["aggregated"]
    assert info["rounds"] == 2 and len(info["imputation_s"]) == 2 and info["groups"] == 300
    # Far above chance (1/200) on the per-document test split.
    assert report["metrics"]["module3"]["combined"]["P@1"] > 10
    # The quality gate's rows carry the imputed labels' weights, the second round's posteriors.
    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "validation.jsonl").read_text().splitlines()]
    weights = [w for r in rows for w in r["target_weight"]]
    assert all(len(r["target_weight"]) == len(r["target_ind"]) for r in rows)
    assert all(0 < w <= 1 for w in weights) and min(weights) < 1
    # Without --aggregated, grouped data is not mistaken for ordinary data.
    assert cli(["train", "--data", str(tmp_path / "g"), "--out", str(tmp_path / "c2"), "--config", str(config)]) == 2
    assert "grouped data (it has a groups file): train it with --aggregated" in capsys.readouterr().err


def test_carrier_posteriors_share_a_group_label_by_the_models_probabilities() -> None:
    """Group 0 (documents 0, 1) carries label 0, group 1 (document 2) labels 0 and 1. A member's
    weight is q / (1 - prod(1 - q)) over its group: a member the model finds likelier weighs more,
    a group's only member carries its labels surely, and no member gets a label its group lacks."""
    from training.eagle import carrier_posteriors

    members = sp.csr_matrix(np.array([[1, 1, 0], [0, 0, 1]], np.float32))
    group_labels = sp.csr_matrix(np.array([[1, 0], [1, 1]], np.float32))
    q = np.array([[0.6, 0.9], [0.2, 0.9], [0.1, 0.3]])
    posteriors = carrier_posteriors(members, group_labels, lambda docs, labels: q[docs, labels]).toarray()
    either = 1 - 0.4 * 0.8
    np.testing.assert_allclose(posteriors, [[0.6 / either, 0], [0.2 / either, 0], [1, 1]], rtol=1e-5)


def test_posteriors_under_the_floor_are_left_out_but_each_pair_keeps_a_member() -> None:
    """aggregated_min_posterior: group 0 (documents 0-2) carries labels 0 and 1. Label 0: the model
    finds document 0 likely, 1 and 2 not (posteriors 0.9/0.9 and 0.005/0.9, 0.001/0.9 by the
    formula): only document 0 keeps it. Label 1: every member at 1e-4, so every posterior ~1/3
    (kept at floor 0.3, none at 0.34 but the first of the tied best)."""
    from training.eagle import carrier_posteriors

    members = sp.csr_matrix(np.array([[1, 1, 1]], np.float32))
    group_labels = sp.csr_matrix(np.array([[1, 1]], np.float32))
    q = np.array([[0.9, 1e-4], [0.005, 1e-4], [0.001, 1e-4]])
    full = carrier_posteriors(members, group_labels, lambda docs, labels: q[docs, labels]).toarray()
    floored = carrier_posteriors(members, group_labels, lambda docs, labels: q[docs, labels], floor=0.01).toarray()
    assert (full > 0).all() and floored[1:, 0].tolist() == [0, 0] and floored[0, 0] == full[0, 0]
    np.testing.assert_array_equal(floored[:, 1], full[:, 1])  # ~1/3 each: above the floor
    alone = carrier_posteriors(members, group_labels, lambda docs, labels: q[docs, labels], floor=0.34).toarray()
    assert alone[:, 1].tolist() == [full[0, 1], 0, 0]  # tied: the first member keeps the label
    with pytest.raises(ValueError, match="aggregated_min_posterior"):
        replace(TrainConfig(), aggregated_min_posterior=1.0).validate()


def test_a_round_from_the_models_posteriors_beats_the_first_on_clustered_groups(planted: dict[str, Path]) -> None:
    """Clustered groups' members are alike: models trained on many groups tell them apart better
    than the TF-IDF imputation did, and a round trained on their posteriors predicts the
    per-document test labels better (deterministic given the seed)."""
    from training.aggregated import train_aggregated

    cfg = replace(TrainConfig.tiny(), tree_enabled=False, seed=0, aggregated_rounds=1)
    first = train_aggregated(planted["clustered"], cfg)
    second = train_aggregated(planted["clustered"], replace(cfg, aggregated_rounds=2))
    info = second.metrics["aggregated"]
    assert info["rounds"] == 2 and info["keep_ratio"][1] is None and len(info["training_s"]) == 2
    p1 = [ckpt.metrics["module3"]["combined"]["P@1"] for ckpt in (first, second)]
    assert p1[1] > p1[0] + 3, p1
    again = train_aggregated(planted["clustered"], replace(cfg, aggregated_rounds=2))
    assert again.metrics["module3"]["combined"] == second.metrics["module3"]["combined"]


def test_posterior_folds_deal_whole_groups_and_train_each_fold_on_the_others(caplog) -> None:
    from training.aggregated import posterior_folds
    from training.grouped import GroupedSplit

    group_of = np.repeat(np.arange(10), 3)
    grouped = GroupedSplit([f"d{i}" for i in range(30)], ["t"] * 30, group_of, [f"g{g}" for g in range(10)],
                           [[0]] * 10)
    folds = posterior_folds(grouped, 4, seed=3)
    assert folds.count == 4 and sorted(np.bincount(folds.of_document).tolist()) == [6, 6, 9, 9]
    assert all(len(set(folds.of_document[group_of == g])) == 1 for g in range(10))  # a group in one fold
    for fold in range(4):
        assert folds.trained_on(fold) == np.flatnonzero(folds.of_document != fold).tolist()
    np.testing.assert_array_equal(posterior_folds(grouped, 4, seed=3).of_document, folds.of_document)
    assert posterior_folds(grouped, 1, seed=3).trained_on(0) == list(range(30))
    assert posterior_folds(grouped, 10, seed=3).count == 10 and not caplog.records
    assert posterior_folds(grouped, 11, seed=3).count == 10
    assert "aggregated_posterior_folds 11: only 10 groups, 10 folds" in caplog.text


def test_a_members_posteriors_come_from_a_model_that_did_not_see_its_groups_labels(planted: dict[str, Path]) -> None:
    """Cross-fitted: the labels the round before gave a fold's documents change the other folds'
    posteriors, never their own (a model trained on a document echoes its labels back)."""
    from training.aggregated import fit_imputer, posterior_folds, reimpute

    cfg = replace(TrainConfig.tiny(), tree_enabled=False, seed=0, aggregated_posterior_folds=2)
    labels = xc_data.load_labels(planted["clustered"])
    grouped = load_grouped(planted["clustered"], "title", len(labels))
    x, z = tfidf_spaces(grouped.texts, labels.texts, cfg)
    imputed = fit_imputer(grouped, x, len(labels), cfg, z).impute()
    fold = posterior_folds(grouped, 2, cfg.seed).of_document
    mine = np.flatnonzero(fold == 0)
    moved = list(imputed)
    for a, b in zip(mine, np.roll(mine, 1), strict=True):  # fold 0's labels dealt to other documents of it
        moved[a] = imputed[b]
    before, _ = reimpute(planted["clustered"], grouped, labels.texts,
                         xc_data.Split(grouped.uids, grouped.texts, imputed), cfg, "title")
    after, _ = reimpute(planted["clustered"], grouped, labels.texts,
                        xc_data.Split(grouped.uids, grouped.texts, moved), cfg, "title")
    def labels_of(split: xc_data.Split, rows: np.ndarray) -> list[tuple[list[int], list[float]]]:
        return [(split.targets[i], split.weights[i]) for i in rows]

    assert labels_of(before, mine) == labels_of(after, mine)
    assert labels_of(before, np.flatnonzero(fold == 1)) != labels_of(after, np.flatnonzero(fold == 1))


def test_a_member_model_is_the_model_training_fits_up_to_module3(planted: dict[str, Path]) -> None:
    """One fold (aggregated_posterior_folds 1) re-imputes with the model a round would train."""
    import torch

    from training.pipeline import fit_member_model, train

    cfg = replace(TrainConfig.tiny(), tree_enabled=False, seed=0)
    trn = xc_data.load_split(planted["data"], "trn", "title", len(xc_data.load_labels(planted["data"])))
    member, ckpt = fit_member_model(planted["data"], cfg, "title", trn), train(planted["data"], cfg, trn=trn)
    np.testing.assert_array_equal(member.classifiers.weights_, ckpt.classifiers.weights_)
    np.testing.assert_array_equal(member.classifiers.bias_, ckpt.classifiers.bias_)
    for name, value in ckpt.encoder.state_dict().items():
        assert torch.equal(member.encoder.state_dict()[name], value), name
    assert member.tokenizer.vocab_size == ckpt.tokenizer.vocab_size
