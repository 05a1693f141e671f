"""`shortlist shard` and the sharded engine in one process: each shard a bundle of its own, and the
shards' merged answers the parent's (service.engine.sharding; the Ray Serve application that
distributes the same objects is tested in test_ray_serve.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from sharding_helpers import assert_same_answers, held_out, p_at_5
from test_engine import refresh_checksum

from model_export.shard import shard_bundle
from service.api.activation import ActivationFailed
from service.api.quality_gate import check_quality, require_quality
from service.engine import BundleError, Predictor, PredictorOptions
from service.engine.schema import VALIDATION
from service.engine.sharding import GateRows, ShardedPredictor, check_shard_set, merge_gate_rows, shard_dirs
from shortlist.cli import main


@pytest.fixture(scope="module")
def sharded_root(bundle_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sharded")
    assert main(["shard", str(bundle_root / "v1"), "--shards", "3", "--out", str(root)]) == 0
    return root


def test_each_shard_is_a_bundle_over_its_labels(bundle_root: Path, sharded_root: Path):
    parent = Predictor.load(bundle_root / "v1")
    dirs = shard_dirs(sharded_root / "v1")
    assert [d.name for d in dirs] == ["shard-0-of-3", "shard-1-of-3", "shard-2-of-3"]
    held = []
    for index, d in enumerate(dirs):
        shard = Predictor.load(d)  # independently loadable: every check, its own canaries
        m = shard.bundle.manifest
        assert (m.shard.index, m.shard.count, m.shard.parent_version) == (index, 3, "v1")
        assert m.shard.parent_num_labels == parent.num_labels
        assert not m.has_tree and "validation.jsonl" in m.files  # the parent's rows, its own truths
        ids = shard.bundle.shard_labels
        held.append(ids)
        assert [shard.bundle.labels.uids[i] for i in range(3)] == [parent.bundle.labels.uids[j] for j in ids[:3]]
        np.testing.assert_array_equal(shard.bundle.classifiers, parent.bundle.classifiers[ids])
        np.testing.assert_array_equal(shard.bundle.classifier_scales, parent.bundle.classifier_scales[ids])
        np.testing.assert_array_equal(shard.bundle.centroid_scales, parent.bundle.centroid_scales[ids])
        for name in ("encoder.onnx", "encoder.onnx.data", "tokenizer.json"):
            assert (d / name).read_bytes() == (bundle_root / "v1" / name).read_bytes()
    assert np.array_equal(np.sort(np.concatenate(held)), np.arange(parent.num_labels))
    assert len({Predictor.load(d).bundle.manifest.shard.parent_fingerprint for d in dirs}) == 1


def test_shards_answer_as_their_parent(bundle_root: Path, sharded_root: Path, synthetic_data: Path):
    texts, truths = held_out(synthetic_data)
    texts += ["qqqq zzzz", texts[0]]  # words no token row knows: the head's fallback
    L = Predictor.load(bundle_root / "v1").num_labels
    # Every label a candidate; then each source of the bundle's own shortlist but HNSW (token rows, head,
    # lexical score), which a shard keeps exactly; then the bundle's defaults.
    for options in (PredictorOptions(k_head=L, head="always"), PredictorOptions(k_w=0, k_mu=0), None):
        parent = Predictor.load(bundle_root / "v1", options)
        sharded = ShardedPredictor.load(sharded_root / "v1", options)
        for alpha in (None, 0.0, 1.0):
            want = parent.predict(texts, k=10, alpha=alpha)
            got = sharded.predict(texts, k=10, alpha=alpha)
            if options is None:  # HNSW searches one graph per shard: approximately the parent's
                n = len(truths)
                assert abs(p_at_5(got[:n], truths) - p_at_5(want[:n], truths)) <= 0.5
                continue
            assert_same_answers([[(p.id, p.uid, p.score) for p in row] for row in got], want)


def test_a_shard_holds_its_own_token_slots_only(bundle_root: Path, sharded_root: Path):
    parent = Predictor.load(bundle_root / "v1")
    k_tok = parent.scoring.shortlist.k_tok
    rows = np.asarray(parent.bundle.token_table().labels[:, :k_tok])
    for d in shard_dirs(sharded_root / "v1"):
        shard = Predictor.load(d).bundle
        table, ids = np.asarray(shard.token_table().labels), shard.shard_labels
        assert table.shape[1] == shard.manifest.scoring.shortlist.k_tok < k_tok  # packed, not the parent's width
        got = np.where(table >= 0, ids[np.maximum(table, 0)], -1)
        want = [[x for x in row if x >= 0 and x in set(ids.tolist())] for row in rows.tolist()]
        assert [[x for x in row if x >= 0] for row in got.tolist()] == want


def test_a_parent_with_labels_added_and_retired_shards_into_its_answers(bundle_root: Path, synthetic_data: Path,
                                                                        tmp_path: Path):
    from service.engine.bundle import Bundle
    from service.engine.label_changes import LabelChange, LabelEditor, NewLabel

    texts, _ = held_out(synthetic_data)
    base = Predictor.load(bundle_root / "v1")
    retire = sorted({p.uid for row in base.predict(texts[:30], k=2) for p in row})
    words = [t.split() for t in base.bundle.labels.titles]
    added = [NewLabel(f"new-{i}", f"{words[i][0]} {words[-1 - i][-1]}") for i in range(20)]
    opened = Bundle.open(bundle_root / "v1")
    try:
        LabelEditor().derive(opened, LabelChange(add=added, retire=retire), tmp_path / "parents", "changed")
    finally:
        opened.close()
    root = shard_bundle(tmp_path / "parents" / "changed", 3, tmp_path / "sharded")
    queries = texts[:100] + [label.title for label in added]
    for options in (PredictorOptions(k_w=0, k_mu=0), PredictorOptions(k_head=base.num_labels + 20, head="always")):
        parent = Predictor.load(tmp_path / "parents" / "changed", options)
        got = ShardedPredictor.load(root, options).predict(queries, k=10)
        assert_same_answers([[(p.id, p.uid, p.score) for p in row] for row in got], parent.predict(queries, k=10))
        assert not set(retire) & {p.uid for row in got for p in row}
        assert {label.uid for label in added} & {p.uid for row in got for p in row}
    # The quality gate of the sharded version scores what the parent's does, retired truths left out alike.
    exact = PredictorOptions(k_head=base.num_labels + 20, head="always")
    parent = Predictor.load(tmp_path / "parents" / "changed", exact)
    want = check_quality(parent, 0.0)
    assert want["retired_truths_left_out"] > 0
    assert _sharded_gate(ShardedPredictor.load(root, exact), 0.0) == want


def _sharded_gate(sharded: ShardedPredictor, floor: float) -> dict[str, float]:
    """The sharded service's quality gate (service.api.ray_app), on the shards in this process."""
    rows = merge_gate_rows([s.gate_rows() for s in sharded.shards], sharded.parent)

    def top5(batch: list[str]) -> np.ndarray:
        return np.array([[p.id for p in row] + [-1] * (5 - len(row)) for row in sharded.predict(batch, k=5)])

    return require_quality("sharded", rows.texts, rows.truths, rows.retired, top5, floor, rows.weights)


def test_each_shard_stores_the_parents_validation_rows_with_its_own_truths(bundle_root: Path, sharded_root: Path):
    parent = Predictor.load(bundle_root / "v1")
    rows = parent.bundle.validation_rows()
    shards = [Predictor.load(d).bundle for d in shard_dirs(sharded_root / "v1")]
    for shard in shards:
        own = shard.validation_rows()  # checked as any bundle's: ids among the shard's labels
        assert [r["text"] for r in own] == [r["text"] for r in rows]
        ids = set(shard.shard_labels.tolist())
        assert [sorted(shard.shard_labels[r["target_ind"]].tolist()) for r in own] == [
            sorted(t for t in r["target_ind"] if t in ids) for r in rows]
    sharded = ShardedPredictor.load(sharded_root / "v1", PredictorOptions(k_head=parent.num_labels, head="always"))
    merged = merge_gate_rows([s.gate_rows() for s in sharded.shards], sharded.parent)
    want = ([r["text"] for r in rows], [sorted(r["target_ind"]) for r in rows], None, None)
    assert tuple(merged) == want
    exact = Predictor.load(bundle_root / "v1", PredictorOptions(k_head=parent.num_labels, head="always"))
    scores = _sharded_gate(sharded, 0.0)
    assert scores == check_quality(exact, 0.0) and scores["P@1"] > 30
    with pytest.raises(ActivationFailed, match=r"^sharded: quality gate failed: P@1 [0-9.]+ on \d+ validation rows, "
                                               r"the floor is 100\.00$"):
        _sharded_gate(sharded, 100.0)
    other = ShardedPredictor.load(sharded_root / "v1")
    other.shards[1].gate_rows = lambda: GateRows(["another text"], [[1]], [])  # shards not written together
    with pytest.raises(BundleError, match="shard 1 of v1: its validation rows are not shard 0's"):
        merge_gate_rows([s.gate_rows() for s in other.shards], other.parent)


def test_exclude_by_uid_across_shards(bundle_root: Path, sharded_root: Path):
    parent = Predictor.load(bundle_root / "v1")
    sharded = ShardedPredictor.load(sharded_root / "v1")
    text = parent.bundle.labels.titles[7]
    top = [p.uid for p in parent.predict([text], k=3)[0]]
    want = parent.predict([text], k=5, exclude=[parent.bundle.labels.ids_of(top)])[0]
    got = sharded.predict([text], k=5, exclude=top)[0]
    assert [p.id for p in got] == [p.id for p in want] and not set(top) & {p.uid for p in got}
    with pytest.raises(KeyError, match="no-such-label"):
        sharded.predict([text], exclude=["no-such-label"])


def test_shards_of_other_parents_or_counts_are_refused(bundle_root: Path, sharded_root: Path, tmp_path: Path):
    other = shard_bundle(bundle_root / "v2", 3, tmp_path / "other")
    mixed = [ShardedPredictor.load(sharded_root / "v1").shards[i].info() for i in range(3)]
    mixed[1] = ShardedPredictor.load(other).shards[1].info()
    with pytest.raises(BundleError, match="not of v1"):
        check_shard_set(mixed)
    with pytest.raises(BundleError, match="shard 0 of 3, expected 0 of 2"):
        check_shard_set(mixed[:1] + mixed[2:])
    partial = tmp_path / "partial" / "v1"
    shutil.copytree(sharded_root / "v1", partial)
    shutil.rmtree(partial / "shard-1-of-3")
    with pytest.raises(BundleError, match="expected shard-0-of-N"):
        shard_dirs(partial)


def test_a_shard_holds_no_encoder_and_its_canaries_are_checked_on_the_routers_encoding(sharded_root: Path,
                                                                                        tmp_path: Path):
    from service.engine.sharding import ShardPredictor

    shard = ShardPredictor.load(shard_dirs(sharded_root / "v1")[1])
    assert shard.predictor.encoder is None
    with pytest.raises(LookupError, match="no encoder"):
        shard.predictor.predict(["x"])
    copy = tmp_path / "v1"
    shutil.copytree(sharded_root / "v1", copy)
    manifest_path = copy / "shard-1-of-3" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    first = next(c for c in manifest["canary"] if c["top_ids"])
    first["top_scores"][0] += 0.5  # what export saw differs from what the shard answers
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="shard-1-of-3.*canary"):
        ShardedPredictor.load(copy)


def test_a_shard_without_its_label_ids_or_in_format_1_is_refused(sharded_root: Path, tmp_path: Path):
    shard = tmp_path / "shard-0-of-3"
    shutil.copytree(sharded_root / "v1" / "shard-0-of-3", shard)
    manifest = json.loads((shard / "manifest.json").read_text())
    (shard / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1}))
    with pytest.raises(BundleError, match="a shard is a format 2 bundle"):
        Predictor.load(shard)
    del manifest["files"]["shard_labels.npy"]
    (shard / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="both `shard` and shard_labels.npy"):
        Predictor.load(shard)


def test_sharding_refuses_bad_requests(bundle_root: Path, sharded_root: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="shards must be >= 1"):
        shard_bundle(bundle_root / "v1", 0, tmp_path)
    with pytest.raises(BundleError, match="already exists"):
        shard_bundle(bundle_root / "v1", 2, sharded_root)
    with pytest.raises(ValueError, match="is a shard already"):
        shard_bundle(sharded_root / "v1" / "shard-0-of-3", 2, tmp_path)


def test_a_projected_bundle_shards_into_projected_shards_that_answer_as_it(projected_bundle: Path,
                                                                           synthetic_data: Path, tmp_path: Path):
    """Each shard builds its HNSW indices over a projection of its own rows (the parent's
    projection_dim), files and manifest consistent, and the shards together answer as the parent."""
    assert main(["shard", str(projected_bundle), "--shards", "2", "--out", str(tmp_path)]) == 0
    parent = Predictor.load(projected_bundle)
    dim = parent.bundle.manifest.hnsw.projection_dim
    assert dim > 0
    for d in shard_dirs(tmp_path / "p1"):
        shard = Predictor.load(d)  # every check of a projected bundle, its own canaries
        assert shard.bundle.manifest.hnsw.projection_dim == dim
        assert {"hnsw_w_projection.npy", "hnsw_mu_projection.npy"} <= set(shard.bundle.manifest.files)
    texts, truths = held_out(synthetic_data)
    exact = PredictorOptions(k_w=0, k_mu=0)
    sharded = ShardedPredictor.load(tmp_path / "p1", exact).predict(texts, k=10)
    assert_same_answers([[(p.id, p.uid, p.score) for p in row] for row in sharded],
                        Predictor.load(projected_bundle, exact).predict(texts, k=10))
    got = ShardedPredictor.load(tmp_path / "p1").predict(texts, k=10)
    assert abs(p_at_5(got, truths) - p_at_5(parent.predict(texts, k=10), truths)) <= 0.5


def test_a_sharded_bundle_reads_its_manifests_under_the_limit_it_is_given(sharded_root: Path, tmp_path: Path):
    """SHORTLIST_MAX_MANIFEST_BYTES reaches every manifest a sharded bundle's loads read (the router's
    query side reads shard 0's, each shard its own); they read under the default limit before."""
    copy = tmp_path / "v1"
    shutil.copytree(sharded_root / "v1", copy)
    size = 50_000
    for shard in ("shard-0-of-3", "shard-2-of-3"):
        path = copy / shard / "manifest.json"
        data = path.read_bytes()
        path.write_bytes(data + b" " * (size - len(data)))
    assert len(ShardedPredictor.load(copy, max_manifest_bytes=size).shards) == 3
    too_big = rf"shard-0-of-3/manifest\.json: {size} bytes, more than the limit of {size - 1}"
    with pytest.raises(BundleError, match=too_big):
        ShardedPredictor.load(copy, max_manifest_bytes=size - 1)
    from service.engine.sharding import ShardPredictor

    with pytest.raises(BundleError, match=rf"shard-2-of-3/manifest\.json: {size} bytes, more than the limit"):
        ShardPredictor.load(copy / "shard-2-of-3", max_manifest_bytes=size - 1)


def test_a_sharded_gate_counts_each_truth_at_its_weight(bundle_root: Path, tmp_path: Path):
    """Validation rows whose labels were imputed carry their weights through sharding: each shard
    keeps its own labels' weights and the merged gate scores what the parent's gate scores."""
    parent_dir = tmp_path / "parents" / "v1"
    shutil.copytree(bundle_root / "v1", parent_dir)
    rows = Predictor.load(parent_dir).bundle.validation_rows()
    for i, row in enumerate(rows):
        row["target_weight"] = [1.0 / (1 + (i + j) % 4) for j in range(len(row["target_ind"]))]
    (parent_dir / VALIDATION).write_text("".join(json.dumps(r) + "\n" for r in rows))
    refresh_checksum(parent_dir, VALIDATION)
    root = shard_bundle(parent_dir, 3, tmp_path / "sharded")
    for d in shard_dirs(root):
        shard = Predictor.load(d).bundle
        weight_of = [dict(zip(r["target_ind"], r["target_weight"], strict=True)) for r in rows]
        assert [r["target_weight"] for r in shard.validation_rows()] == [
            [weight_of[i][int(t)] for t in shard.shard_labels[r["target_ind"]]]
            for i, r in enumerate(shard.validation_rows())]
    exact = PredictorOptions(k_head=Predictor.load(parent_dir).num_labels, head="always")
    want = check_quality(Predictor.load(parent_dir, exact), 0.0)
    assert want["P@1"] < check_quality(Predictor.load(bundle_root / "v1", exact), 0.0)["P@1"]
    assert _sharded_gate(ShardedPredictor.load(root, exact), 0.0) == want
