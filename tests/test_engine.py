"""Engine: every broken bundle is refused with a message naming the file; sources open on first
need; Predictor behaviour and its options."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from service.engine import BundleError, Predictor, PredictorOptions
from service.engine.manifests import newest_version
from service.engine.schema import MANIFEST, TREE, sha256_file
from service.engine.store import resolve_bundle_dir


def rewrite_manifest(bundle_dir: Path, **changes) -> dict:
    path = bundle_dir / MANIFEST
    manifest = json.loads(path.read_text())
    for key, value in changes.items():
        if isinstance(value, dict):
            manifest[key] = {**manifest[key], **value}
        else:
            manifest[key] = value
    path.write_text(json.dumps(manifest))
    return manifest


def refresh_checksum(bundle_dir: Path, name: str) -> None:
    rewrite_manifest(bundle_dir, files={name: sha256_file(bundle_dir / name)})


def drop_tree_arrays(bundle_dir: Path, *names: str) -> dict[str, np.ndarray]:
    """Rewrite the bundle's tree.npz without `names` (as a writer of an older format made it); the
    arrays kept."""
    with np.load(bundle_dir / TREE) as z:
        kept = {k: z[k] for k in z.files if k not in names}
    np.savez(bundle_dir / TREE, **kept)
    refresh_checksum(bundle_dir, TREE)
    return kept


def _mapped(arr: np.ndarray) -> bool:
    """Is the array a view of a memory map (numpy's own, or a memoryview of an mmap)?"""
    while isinstance(arr, np.ndarray) and not isinstance(arr, np.memmap):
        arr = arr.base
    return isinstance(arr, np.memmap | mmap.mmap) or (isinstance(arr, memoryview) and isinstance(arr.obj, mmap.mmap))


def test_valid_bundle_loads_and_memory_maps_its_arrays(bundle_root):
    predictor = Predictor.load(bundle_root / "v1")
    bundle = predictor.bundle
    assert predictor.version == "v1" and bundle.has_tree and bundle.manifest.vector_dtype == "int8"
    assert bundle.classifiers.dtype == bundle.centroids.dtype == np.int8
    assert bundle.classifier_scales.shape == bundle.centroid_scales.shape == (300,)
    assert _mapped(bundle.classifiers) and _mapped(bundle.centroids) and _mapped(bundle.classifier_bias)
    assert _mapped(bundle.tree.classifier_weights)  # a stored member of tree.npz, mapped where it lies


def test_flipped_byte_is_rejected_naming_the_file(bundle_root_copy):
    target = bundle_root_copy / "v1" / "classifiers.npy"
    data = bytearray(target.read_bytes())
    data[-7] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"classifiers\.npy: sha256 mismatch"):
        Predictor.load(bundle_root_copy / "v1")


def test_missing_or_unknown_files_are_rejected(bundle_root_copy):
    os.remove(bundle_root_copy / "v1" / "hnsw_mu.bin")
    with pytest.raises(BundleError, match=r"hnsw_mu\.bin: listed in the manifest but missing"):
        Predictor.load(bundle_root_copy / "v1")
    (bundle_root_copy / "v2" / "extra.bin").write_bytes(b"x")
    refresh_checksum(bundle_root_copy / "v2", "extra.bin")
    with pytest.raises(BundleError, match="unknown file extra.bin"):
        Predictor.load(bundle_root_copy / "v2")


@pytest.mark.parametrize(("change", "message"), [
    ({"format_version": 99}, "bundle format 99, this engine reads 1, 2, 3, 4, 5"),
    ({"new_field": 1}, "invalid manifest.*new_field"),
    ({"scoring": {"alpha": 1.5}}, "invalid manifest.*alpha"),
])
def test_manifests_this_engine_cannot_read_are_refused(bundle_root_copy, change, message):
    rewrite_manifest(bundle_root_copy / "v1", **change)
    with pytest.raises(BundleError, match=message):
        Predictor.load(bundle_root_copy / "v1")


def test_tree_arrays_of_unknown_names_or_dtypes_are_refused(bundle_root_copy):
    """Unknown tree arrays and other dtypes are refused as unknown files are (format 1's lexical
    arrays: tests/test_vectors_and_maps.py)."""
    bundle_dir = bundle_root_copy / "v1"
    with np.load(bundle_dir / "tree.npz") as z:
        arrays = {k: z[k] for k in z.files}
    for bad, message in (({**arrays, "extra": np.zeros(2, np.float32)}, "unknown array 'extra'"),
                         ({**arrays, "node_bias": arrays["node_bias"].astype(np.float64)},
                          "node_bias is float64, expected float32")):
        np.savez(bundle_dir / "tree.npz", **bad)
        refresh_checksum(bundle_dir, "tree.npz")
        with pytest.raises(BundleError, match=message):
            Predictor.load(bundle_dir)


def test_a_retired_manifest_field_is_still_read(bundle_root_copy):
    rewrite_manifest(bundle_root_copy / "v1", tree_default_beam=128)
    assert Predictor.load(bundle_root_copy / "v1").version == "v1"


def test_array_shape_disagreeing_with_manifest_is_rejected(bundle_root_copy):
    bundle_dir = bundle_root_copy / "v1"
    mu = np.load(bundle_dir / "centroids.npy")
    np.save(bundle_dir / "centroids.npy", mu[:, :-1])
    refresh_checksum(bundle_dir, "centroids.npy")
    with pytest.raises(BundleError, match=r"centroids\.npy: expected int8 \(300, 32\)"):
        Predictor.load(bundle_dir)


def test_canary_catches_arrays_that_disagree_with_export(bundle_root_copy):
    """Consistent checksums but permuted classifier rows: only the canary query can notice."""
    bundle_dir = bundle_root_copy / "v1"
    for name in ("classifiers.npy", "centroids.npy"):
        arr = np.load(bundle_dir / name)
        np.save(bundle_dir / name, arr[::-1].copy())
        refresh_checksum(bundle_dir, name)
    with pytest.raises(BundleError, match="canary"):
        Predictor.load(bundle_dir)


def test_manifest_version_must_match_directory(bundle_root_copy):
    os.rename(bundle_root_copy / "v1", bundle_root_copy / "v9")
    with pytest.raises(BundleError, match="does not match directory name"):
        Predictor.load(bundle_root_copy / "v9")


def test_bundle_dirs_cannot_escape_the_root(bundle_root_copy, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, bundle_root_copy / "escape")
    with pytest.raises(BundleError, match="outside the bundle root"):
        resolve_bundle_dir(bundle_root_copy, "escape")
    for bad in ("../outside", "..", "v1/../v2", "/etc", "v1\n"):
        with pytest.raises(BundleError):
            resolve_bundle_dir(bundle_root_copy, bad)
    with pytest.raises(BundleError, match="no bundle"):
        resolve_bundle_dir(bundle_root_copy, "v7")
    assert resolve_bundle_dir(bundle_root_copy, "v2") == (bundle_root_copy / "v2").resolve()


def test_newest_version_is_the_last_created(bundle_root):
    assert newest_version(bundle_root) == "v2"


def test_an_index_the_scoring_does_not_search_is_never_read_and_is_checked_before_first_use(bundle_root_copy):
    bundle_dir = bundle_root_copy / "v1"
    for name in ("hnsw_w.bin", "hnsw_mu.bin"):
        (bundle_dir / name).write_bytes(b"not an index")
        refresh_checksum(bundle_dir, name)
    # A canary whose text found no label at export: this test changes the sources, so their answers.
    rewrite_manifest(bundle_dir, canary=[{"text": "anything", "top_ids": [], "top_scores": []}])
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    manifest["scoring"]["shortlist"].update(k_w=0, k_mu=0)
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    predictor = Predictor.load(bundle_dir)  # token table and head only: the broken indices are not read
    assert (predictor.predict_ids(["anything"], k=3)[0] >= 0).any()
    with pytest.raises(BundleError, match=r"hnsw_w\.bin: cannot load hnsw index"):
        Predictor(predictor.bundle, PredictorOptions(k_w=5))
    with pytest.raises(BundleError, match=r"hnsw_mu\.bin: cannot load hnsw index"):
        Predictor(predictor.bundle, PredictorOptions(k_mu=5))


def test_label_vectors_are_served_from_memory_with_huge_pages_and_from_the_maps_without(bundle_root):
    from service.engine import heap

    texts = ["alpha beta", "", "completely unknown zzqx", "gamma"]
    resident = Predictor.load(bundle_root / "v1")
    heap.use_huge_pages(False)
    try:
        mapped = Predictor.load(bundle_root / "v1")
    finally:
        heap.use_huge_pages(True)
    assert not _mapped(resident.scorer.w) and not _mapped(resident.scorer.mu)  # copies, made once per bundle
    assert resident.scorer.w is Predictor(resident.bundle).scorer.w
    assert _mapped(mapped.scorer.w) and _mapped(mapped.scorer.mu)
    for a, b in zip(resident.predict_ids(texts, k=10), mapped.predict_ids(texts, k=10), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def predictor(bundle_root) -> Predictor:
    return Predictor.load(bundle_root / "v1")


def test_options_override_the_bundles_scoring_and_are_checked(predictor):
    bundle = predictor.bundle
    assert predictor.scoring == bundle.manifest.scoring and predictor.answers_as_exported
    narrow = Predictor(bundle, PredictorOptions(k_w=3, k_mu=0, k_tok=0, k_head=0))
    assert narrow.scoring.shortlist.k_w == 3 and narrow.scoring.lexical_weight == 0.0  # no token rows: no lexical
    assert all(len(s) <= 3 for s in narrow.shortlist(["alpha beta", bundle.labels.titles[3]]))
    for options, message in [
        (PredictorOptions(k_w=0, k_mu=0, k_tok=0), "all 0"),
        (PredictorOptions(k_tok=-1), "greater than or equal to 0"),
        (PredictorOptions(head="sometimes"), "head"),
        (PredictorOptions(lexical_weight=float("nan")), "lexical_weight"),
        (PredictorOptions(k_tok=bundle.token_table().width + 1), "labels per token"),
        (PredictorOptions(k_tok=0, lexical_weight=0.2), "lexical_weight > 0 needs"),
    ]:
        with pytest.raises(ValueError, match=message):
            Predictor(bundle, options)


def test_another_search_breadth_never_changes_other_predictors_answers(predictor):
    texts = [predictor.bundle.labels.titles[i] for i in range(20)]
    before = predictor.predict_ids(texts, k=10)
    Predictor(predictor.bundle, PredictorOptions(ef_search=1)).predict_ids(texts, k=10)
    after = predictor.predict_ids(texts, k=10)
    np.testing.assert_array_equal(before[0], after[0])


def test_batch_results_equal_single_results(predictor):
    texts = ["alpha beta", "", "completely unknown zzqx", predictor.bundle.labels.titles[3]]
    batch_ids, batch_scores = predictor.predict_ids(texts, k=7)
    for row, text in enumerate(texts):
        ids, scores = predictor.predict_ids([text], k=7)
        assert ids[0].tolist() == batch_ids[row].tolist()
        assert np.allclose(scores[0], batch_scores[row], atol=1e-6)


def test_a_batch_longer_than_a_pass_answers_as_its_texts_alone(predictor):
    """Batches are scored QUERIES_PER_PASS queries at a time (a bounded working set): the
    passes' answers join in order, each text with its own exclusions."""
    from service.engine.predictor import QUERIES_PER_PASS

    titles = predictor.bundle.labels.titles
    texts = [titles[i % predictor.num_labels] for i in range(QUERIES_PER_PASS + 5)]
    plain, _ = predictor.predict_ids(texts, k=5)
    exclude = [[]] * (len(texts) - 1) + [[int(plain[-1, 0])]]
    ids, scores = predictor.predict_ids(texts, k=5, exclude=exclude)
    assert ids.shape == (len(texts), 5) and plain[-1, 0] not in ids[-1]
    for row in (0, QUERIES_PER_PASS - 1, QUERIES_PER_PASS, len(texts) - 1):
        alone_ids, alone_scores = predictor.predict_ids([texts[row]], k=5, exclude=[exclude[row]])
        assert alone_ids[0].tolist() == ids[row].tolist()
        np.testing.assert_allclose(alone_scores[0], scores[row], atol=1e-6)


def test_results_are_sorted_unique_and_k_long(predictor):
    ids, scores = predictor.predict_ids([predictor.bundle.labels.titles[0], ""], k=10)
    for row_ids, row_scores in zip(ids, scores, strict=True):
        valid = row_ids[row_ids >= 0]
        assert len(valid) == len(set(valid.tolist()))
        assert np.all(np.diff(row_scores[: len(valid)]) <= 1e-7)
    assert ids.shape == (2, 10)


def test_k_larger_than_the_shortlist_pads_with_minus_one(predictor):
    k = predictor.num_labels + 5
    ids, _ = predictor.predict_ids(["anything"], k=k)
    assert ids.shape == (1, k)
    assert (ids[0] == -1).sum() >= 5
    named = predictor.predict(["anything"], k=k)[0]
    assert all(p.id >= 0 for p in named)


def test_alpha_changes_the_ranking_and_is_bounded(predictor):
    text = predictor.bundle.labels.titles[5]
    classifier_only = predictor.predict_ids([text], k=5, alpha=1.0)
    centroid_only = predictor.predict_ids([text], k=5, alpha=0.0)
    assert not np.allclose(classifier_only[1], centroid_only[1])
    for bad in (-0.01, 1.01):
        with pytest.raises(ValueError, match="alpha"):
            predictor.predict_ids([text], k=5, alpha=bad)
    with pytest.raises(ValueError, match="k must be"):
        predictor.predict_ids([text], k=0)


@pytest.mark.parametrize("scorer", ["shortlist", "exact", "tree"])
def test_excluded_labels_are_left_out_and_the_next_best_move_up(predictor, scorer):
    predict = {"shortlist": predictor.predict_ids, "exact": predictor.predict_exact_ids,
               "tree": predictor.predict_tree_ids}[scorer]
    texts = [predictor.bundle.labels.titles[4], predictor.bundle.labels.titles[9], "alpha beta"]
    plain_ids, plain_scores = predict(texts, 8)
    assert (plain_ids[:, :3] >= 0).all()
    # row 0 drops its best label, row 1 its second and third, row 2 nothing
    exclude = [[int(plain_ids[0, 0])], [int(plain_ids[1, 2]), int(plain_ids[1, 1])], []]
    ids, scores = predict(texts, 6, exclude=exclude)
    assert ids[0].tolist() == plain_ids[0, 1:7].tolist()
    assert ids[1].tolist() == [plain_ids[1, 0], *plain_ids[1, 3:8]]
    assert ids[2].tolist() == plain_ids[2, :6].tolist()
    np.testing.assert_allclose(scores[0], plain_scores[0, 1:7], atol=1e-6)
    for row, text in enumerate(texts):  # alone as in the batch
        alone, _ = predict([text], 6, exclude=[exclude[row]])
        assert alone[0].tolist() == ids[row].tolist()
    assert predict(texts[:1], 6, exclude=[np.array(exclude[0])])[0][0].tolist() == ids[0].tolist()


def test_exclusions_are_checked(predictor):
    text = predictor.bundle.labels.titles[4]
    L = predictor.num_labels
    cases = [("rows for 1 texts", [[1], [2]]), (rf"in \[0, {L}\)", [[L]]), (rf"in \[0, {L}\)", [[-1]]),
             ("integer label ids", [[1.5]]), ("integer label ids", [["3"]])]
    for message, bad in cases:
        with pytest.raises(ValueError, match=message):
            predictor.predict_ids([text], 5, exclude=bad)
    # every label excluded: nothing left to return, no error
    ids, _ = predictor.predict_ids([text], 3, exclude=[range(L)])
    assert ids.tolist() == [[-1, -1, -1]]
    assert predictor.predict([text], 3, exclude=[range(L)]) == [[]]
    predictor.predict_ids([text], 3, exclude=[[L - 1]])  # the last id is allowed


def test_named_predictions_carry_uid_and_title(predictor):
    (preds,) = predictor.predict([predictor.bundle.labels.titles[2]], k=3)
    labels = predictor.bundle.labels
    for p in preds:
        assert p.uid == labels.uids[p.id] and p.title == labels.titles[p.id]


def test_a_shortlist_of_every_label_scores_exactly_as_brute_force(predictor):
    everything = Predictor(predictor.bundle, PredictorOptions(k_head=predictor.num_labels, head="always"))
    texts = [*predictor.bundle.labels.titles[:40], "", "zzqx unknown"]
    ann_ids, ann_scores = everything.predict_ids(texts, k=5)
    exact_ids, exact_scores = everything.predict_exact_ids(texts, k=5)
    np.testing.assert_allclose(ann_scores, exact_scores, atol=1e-6)
    assert np.mean(ann_ids == exact_ids) > 0.97  # only exact ties may order differently


def test_the_prior_head_is_shortlisted_when_classifiers_have_a_bias(predictor):
    bundle = predictor.bundle
    k_head = bundle.manifest.scoring.shortlist.k_head
    assert k_head == (32 if np.any(np.asarray(bundle.classifier_bias) != 0) else 0)
    head = set(np.argsort(-np.asarray(bundle.classifier_bias), kind="stable")[:k_head].tolist())
    assert head <= set(predictor.shortlist(["zzqx unknown"])[0].tolist())


def test_label_table_round_trips_and_names_the_bad_line(tmp_path: Path) -> None:
    from service.engine.labels import LabelTable

    uids = [f"u{i}" for i in range(4500)]  # spans several GIL hand-over chunks
    titles = [f"title {i} \u00e9\r" for i in range(4500)]
    path = tmp_path / "labels.jsonl"
    LabelTable(uids, titles).save(path)
    loaded = LabelTable.load(path)
    assert list(loaded.uids) == uids and list(loaded.titles) == titles
    assert loaded.ids_of(["u4499", "nope", "u0", ""]) == [4499, None, 0, None]
    assert LabelTable(["a", "b", "a"], ["x", "y", "z"]).ids_of(["a", "b"]) == [0, 1]  # first occurrence
    LabelTable(["a", "b", "a"], ["x", "y", "z"]).save(tmp_path / "repeated.jsonl")
    with pytest.raises(ValueError, match=r"repeated\.jsonl:3: uid 'a' is also the uid of line 1"):
        LabelTable.load(tmp_path / "repeated.jsonl")  # a bundle's uids are unique (retire, exclude)

    lines = path.read_text(encoding="utf-8").splitlines()
    lines[2999] = '{"uid": "u2999"}'
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"labels\.jsonl:3000: bad label row"):
        LabelTable.load(path)


def test_a_mapped_label_table_reads_every_row_shape_and_refuses_empty_rows(tmp_path: Path) -> None:
    from service.engine.labels import LabelTable

    path = tmp_path / "labels.jsonl"
    path.write_bytes(b'{"uid": 7, "title": "a\\nb"}\n{"uid": "x", "title": "last, no newline"}')
    table = LabelTable.load(path)
    assert len(table) == 2 and table.row(0) == ("7", "a\nb") and table.row(1) == ("x", "last, no newline")
    assert table.uids[-1] == "x" and table.titles[0:2] == ("a\nb", "last, no newline")
    assert table.uids == ("7", "x") and LabelTable(["7", "x"], ["", ""]).uids == table.uids
    assert table.ids_of(["x", "7", "y"]) == [1, 0, None]
    with pytest.raises(IndexError):
        table.uids[2]
    path.write_bytes(b"")
    assert len(LabelTable.load(path)) == 0 and LabelTable.load(path).ids_of(["x"]) == [None]
    path.write_bytes(b'{"uid": "a", "title": "t"}\n\n{"uid": "b", "title": "t"}\n')
    with pytest.raises(ValueError, match=r"labels\.jsonl:2: bad label row"):
        LabelTable.load(path)


def test_calibrations_stay_finite_and_silent_at_extreme_scores():
    import warnings

    from service.engine.scorers import Calibration

    x = np.array([-1e30, -100.0, -1.0, 0.0, 1.0, 100.0, 1e30], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow in exp would raise here
        sig = Calibration("sigmoid", 5.0, -5.0)(x)
        plain = Calibration("sigmoid")(x)
        capped = Calibration("exp", 1.0, 0.0)(x)
    assert sig.dtype == np.float32 and np.all(np.isfinite(sig)) and np.all((sig >= 0) & (sig <= 1))
    assert np.all(np.diff(plain) >= 0) and plain[3] == 0.5 and plain[0] < 1e-25 and plain[-1] == 1.0
    np.testing.assert_allclose(sig[2:5], 1 / (1 + np.exp(-(5 * x[2:5] - 5))), rtol=1e-6)
    assert np.all(np.isfinite(capped)) and capped[-1] == pytest.approx(np.exp(60.0), rel=1e-6)
    np.testing.assert_array_equal(Calibration("identity", 2.0, 1.0)(x[2:5]), 2 * x[2:5] + 1)


@pytest.mark.parametrize("width", [7, 256, 257, 3000])
def test_top_k_matches_a_full_sort_on_short_and_long_rows(width):
    from service.engine.scorers import top_k

    rng = np.random.default_rng(width)
    scores = rng.standard_normal((5, width)).astype(np.float32)
    scores[1, :] = 0.25  # all tied: the lowest indices, in order
    scores[2, ::2] = -np.inf
    for k in (1, 5, width, width + 3):
        idx, best = top_k(scores, k)
        kk = min(k, width)
        assert idx.shape == best.shape == (5, kk)
        np.testing.assert_array_equal(best, -np.sort(-scores, axis=1)[:, :kk])
        np.testing.assert_array_equal(np.take_along_axis(scores, idx, 1), best)
        assert all(len(set(row)) == kk for row in idx.tolist())
        if width <= 256:  # sorted outright: ties keep index order (a partition makes no such promise)
            assert idx[1].tolist() == list(range(kk))


def test_importing_a_submodule_loads_no_native_engine():
    import subprocess
    import sys

    code = ("import sys; import service.engine.tokenizer, service.engine.schema; "
            "print(sorted(m for m in ('onnxruntime', 'hnswlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_loading_the_encoder_sends_no_onnxruntime_telemetry(bundle_root, tmp_path):
    """onnxruntime's Linux telemetry (on by default since 1.29) keeps a device id under the home
    directory before it uploads: with the service's default there is none."""
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    env["HOME"] = str(tmp_path)
    code = f"from service.engine import Predictor; Predictor.load({str(bundle_root / 'v1')!r})"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert not list(tmp_path.rglob("*")), list(tmp_path.rglob("*"))


def _encoder_load_log(bundle_dir: Path, extra_path: Path) -> str:
    """What a fresh process logs when it loads the bundle's encoder with `extra_path` importable."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(extra_path), str(repo)])}
    code = ("import sys; from service.engine.encoder import OnnxEncoder; "
            "OnnxEncoder(sys.argv[1])")
    out = subprocess.run([sys.executable, "-c", code, str(bundle_dir / "encoder.onnx")], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stderr


def test_a_mixed_onnxruntime_install_is_said_when_the_encoder_loads(bundle_root, tmp_path):
    """`pip install '.[gpu]'` leaves onnxruntime and onnxruntime-gpu sharing one module, the CPU
    build's files winning: the operator who asked for the GPU is told, not left on CPU unawares."""
    quiet = _encoder_load_log(bundle_root / "v1", tmp_path)
    assert "onnxruntime-gpu" not in quiet
    # A second distribution's metadata, as pip leaves it beside the first build's.
    dist = tmp_path / "onnxruntime_gpu-1.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: onnxruntime-gpu\nVersion: 1.0.0\n")
    said = _encoder_load_log(bundle_root / "v1", tmp_path)
    assert "onnxruntime and onnxruntime-gpu are both installed" in said
    assert "serving on CPU" in said
