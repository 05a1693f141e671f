"""Label vectors stored as int8 with row scales (format 4, the default) or float16 (format 2) answer
as the float32 values they stand for; format 1 stays readable; a source the scoring does not
search is checksummed when first opened."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from _api_helpers import sample_titles
from test_engine import drop_tree_arrays

from model_export.export import export_checkpoint
from service.engine import BundleError, Predictor, PredictorOptions, vectors
from service.engine.schema import (
    CENTROID_SCALES,
    CLASSIFIER_SCALES,
    CLASSIFIERS,
    ENCODER,
    ENCODER_DATA,
    MANIFEST,
    TREE,
    sha256_file,
)
from service.engine.tree import LEXICAL_ARRAYS, NODE_LEXICAL, TreeScorer


@pytest.fixture(scope="module")
def texts(synthetic_data: Path) -> list[str]:
    return sample_titles(synthetic_data, 40)


@pytest.fixture(scope="module")
def float32_bundle(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """v1's checkpoint exported with float32 label vectors."""
    return export_checkpoint(checkpoints["v1"], tmp_path_factory.mktemp("bundles32"), "v1", n_parity=50,
                             vector_dtype="float32")


def test_int8_vectors_answer_as_the_float32_values_they_hold(bundle_root: Path, float32_bundle: Path,
                                                             texts: list[str]) -> None:
    small, single = Predictor.load(bundle_root / "v1"), Predictor.load(float32_bundle)
    assert small.bundle.classifiers.dtype == np.int8 and single.bundle.classifiers.dtype == np.float32
    assert single.bundle.classifier_scales is None and not (float32_bundle / CLASSIFIER_SCALES).exists()
    assert (bundle_root / "v1" / CLASSIFIERS).stat().st_size < 0.3 * (float32_bundle / CLASSIFIERS).stat().st_size
    # training rounded the vectors to their int8 values before tuning (and the tree's to float16):
    # the same values, the same answers
    for call in ("predict_ids", "predict_exact_ids", "predict_tree_ids"):
        ids_8, scores_8 = getattr(small, call)(texts[:40], k=5)
        ids_s, scores_s = getattr(single, call)(texts[:40], k=5)
        np.testing.assert_array_equal(ids_8, ids_s)
        np.testing.assert_allclose(scores_8, scores_s, rtol=1e-5, atol=1e-6)


def test_float16_vectors_on_request_answer_as_their_values(checkpoints: dict[str, Path], float32_bundle: Path,
                                                          tmp_path: Path, texts: list[str]) -> None:
    half = Predictor.load(export_checkpoint(checkpoints["v1"], tmp_path, "v1", n_parity=50, vector_dtype="float16"))
    single = Predictor.load(float32_bundle)
    assert half.bundle.manifest.vector_dtype == "float16" and half.bundle.classifier_scales is None
    assert not (tmp_path / "v1" / CLASSIFIER_SCALES).exists()
    # float16 rounds each value by at most 2^-11 of it: scores move by ~1e-3 at most
    ids_h, scores_h = half.predict_exact_ids(texts[:40], k=5)
    ids_s, scores_s = single.predict_exact_ids(texts[:40], k=5)
    np.testing.assert_allclose(scores_h, scores_s, atol=5e-3)
    assert (ids_h[:, 0] == ids_s[:, 0]).mean() >= 0.9


def test_quantize_keeps_each_rows_sign_and_scale_and_is_exact_on_its_own_values() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 16)).astype(np.float32) * rng.uniform(0.01, 10, (50, 1)).astype(np.float32)
    x[3] = 0.0
    values, scales = vectors.quantize(x, "int8")
    assert values.dtype == np.int8 and scales.dtype == np.float32 and scales[3] == 0 and not values[3].any()
    assert np.abs(values).max(axis=1)[np.arange(50) != 3].min() == vectors.INT8_LEVELS
    served = vectors.dequantize(values, scales)
    assert (np.abs(served - x) <= scales[:, None] / 2 + 1e-6).all()
    again, again_scales = vectors.quantize(served, "int8")
    np.testing.assert_array_equal(again, values)
    np.testing.assert_allclose(again_scales, scales, rtol=1e-6)


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: np.where(np.arange(len(s)) == 3, -0.5, s).astype(np.float32), r"negative scale -0\.5 at row 3"),
    (lambda s: np.where(np.arange(len(s)) == 3, np.nan, s).astype(np.float32), r"non-finite value at flat index 3"),
    (lambda s: s[:-1], r"expected float32 \(300,\) .*found float32 \(299,\)"),
    (lambda s: s.astype(np.float64), r"expected float32 \(300,\)"),
])
def test_a_bad_scales_file_is_refused_naming_it(bundle_root: Path, tmp_path: Path, change, message: str) -> None:
    bundle = tmp_path / "v1"
    shutil.copytree(bundle_root / "v1", bundle)
    np.save(bundle / CENTROID_SCALES, change(np.load(bundle / CENTROID_SCALES)))
    manifest = json.loads((bundle / MANIFEST).read_text())
    manifest["files"][CENTROID_SCALES] = sha256_file(bundle / CENTROID_SCALES)
    (bundle / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=rf"centroid_scales\.npy: {message}"):
        Predictor.load(bundle)


def test_int8_vectors_need_their_scales_and_format_4(bundle_root: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "v1"
    shutil.copytree(bundle_root / "v1", bundle)
    manifest = json.loads((bundle / MANIFEST).read_text())
    (bundle / MANIFEST).write_text(json.dumps({**manifest, "format_version": 3}))
    with pytest.raises(BundleError, match="vector_dtype 'int8' needs format_version 4"):
        Predictor.load(bundle)
    del manifest["files"][CLASSIFIER_SCALES]
    (bundle / CLASSIFIER_SCALES).unlink()
    (bundle / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"vector_dtype is int8 but classifier_scales\.npy is not listed"):
        Predictor.load(bundle)


def _set_manifest(bundle: Path, **fields) -> None:
    manifest = json.loads((bundle / MANIFEST).read_text())
    manifest.update(fields)
    (bundle / MANIFEST).write_text(json.dumps(manifest))


def test_a_format_1_bundle_still_serves_as_its_format_2_export_and_float16_needs_format_2(
        float32_bundle: Path, tmp_path: Path, texts: list[str]) -> None:
    """Format 2 keeps the embedding table in encoder.onnx.data, which onnxruntime maps (pages
    shared by every process serving the bundle), and may hold float16 vectors; a format 1 bundle
    keeps the table inside encoder.onnx and float32 vectors, and answers the same."""
    import onnx  # the train extra's: the service itself never imports it

    old = tmp_path / "v1"
    shutil.copytree(float32_bundle, old)
    embedding = max(onnx.load(str(old / ENCODER), load_external_data=False).graph.initializer,
                    key=lambda t: int(np.prod(t.dims)))
    assert {e.key: e.value for e in embedding.external_data}["location"] == ENCODER_DATA
    predictor = Predictor.load(old)
    assert str(old / ENCODER_DATA) in Path("/proc/self/maps").read_text()
    want = predictor.predict_ids(texts[:5], k=5)
    predictor.bundle.close()
    onnx.save(onnx.load(str(old / ENCODER)), str(old / ENCODER))  # inline again
    (old / ENCODER_DATA).unlink()
    with np.load(old / TREE) as z:  # format 1's tree: no lexical terms
        format1_tree = {k: z[k] for k in z.files if k not in (*LEXICAL_ARRAYS, NODE_LEXICAL)}
    np.savez(old / TREE, **format1_tree)
    manifest = json.loads((old / MANIFEST).read_text())
    del manifest["vector_dtype"], manifest["files"][ENCODER_DATA]
    for name in (ENCODER, TREE):
        manifest["files"][name] = sha256_file(old / name)
    (old / MANIFEST).write_text(json.dumps({**manifest, "format_version": 1}))
    got = Predictor.load(old)
    assert got.bundle.classifiers.dtype == np.float32
    ids, scores = got.predict_ids(texts[:5], k=5)
    assert np.array_equal(ids, want[0]) and np.allclose(scores, want[1], atol=1e-6)
    # The tree route of format 1: xi without its lexical term, as a format-1 engine served it.
    want_tree = TreeScorer.from_arrays(format1_tree).search(got.encode(texts[:5]), 5)
    got_tree = got.predict_tree_ids(texts[:5], k=5)
    assert np.array_equal(got_tree[0], want_tree[0]) and np.allclose(got_tree[1], want_tree[1], atol=1e-5)
    assert (got_tree[0] >= 0).all() and np.isfinite(got_tree[1]).all()
    _set_manifest(old, vector_dtype="float16")
    with pytest.raises(BundleError, match="vector_dtype 'float16' needs format_version 2"):
        Predictor.load(old)


def test_a_format_1_bundle_with_the_trees_lexical_arrays_is_refused(float32_bundle: Path, tmp_path: Path) -> None:
    """Format 1 bundles have no lexical tree arrays: an engine of that format would serve the
    tree without them."""
    bundle = tmp_path / "v1"
    shutil.copytree(float32_bundle, bundle)
    assert "lexical_weights" in drop_tree_arrays(bundle, NODE_LEXICAL)  # trained bundles carry xi's token part
    manifest = json.loads((bundle / MANIFEST).read_text())
    del manifest["vector_dtype"]
    (bundle / MANIFEST).write_text(json.dumps({**manifest, "format_version": 1}))
    with pytest.raises(BundleError, match=r"tree\.npz: array lexical_\w+ needs bundle format >= 2"):
        Predictor.load(bundle)


def test_the_lexical_node_term_needs_format_5_and_float16(bundle_root: Path, tmp_path: Path) -> None:
    """A format-4 engine would search p_n without its node term: a bundle of format 4 or older
    holding it is refused; so is the table in another dtype than float16."""
    bundle = tmp_path / "v1"
    shutil.copytree(bundle_root / "v1", bundle)
    with np.load(bundle / TREE) as z:
        assert z[NODE_LEXICAL].dtype == np.float16  # trained bundles carry p_n's token part
        tree = {k: z[k] for k in z.files}
    _set_manifest(bundle, format_version=4)
    with pytest.raises(BundleError, match=r"tree\.npz: array node_lexical needs bundle format >= 5, the manifest "
                                          r"says 4"):
        Predictor.load(bundle)
    np.savez(bundle / TREE, **{**tree, NODE_LEXICAL: tree[NODE_LEXICAL].astype(np.float32)})
    manifest = json.loads((bundle / MANIFEST).read_text())
    manifest["files"][TREE] = sha256_file(bundle / TREE)
    (bundle / MANIFEST).write_text(json.dumps({**manifest, "format_version": 5}))
    with pytest.raises(BundleError, match=r"tree\.npz: array node_lexical is float32, expected float16"):
        Predictor.load(bundle)


def test_vectors_of_another_dtype_than_the_manifest_says_are_refused(float32_bundle: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "v1"
    shutil.copytree(float32_bundle, bundle)
    _set_manifest(bundle, vector_dtype="float16")  # the files hold float32
    with pytest.raises(BundleError, match=r"classifiers\.npy: expected float16"):
        Predictor.load(bundle)


def test_an_index_the_scoring_does_not_search_is_checksummed_when_first_opened(
        checkpoints: dict[str, Path], tmp_path: Path, texts: list[str]) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints["v1"], ckpt)
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    meta["scoring"]["shortlist"].update(k_w=0, k_mu=0)  # served: the token rows and the head
    (ckpt / "checkpoint.json").write_text(json.dumps(meta))
    bundle = export_checkpoint(ckpt, tmp_path / "bundles", "v1", n_parity=50)
    data = bytearray((bundle / "hnsw_w.bin").read_bytes())
    data[-5] ^= 0xFF
    (bundle / "hnsw_w.bin").write_bytes(bytes(data))
    predictor = Predictor.load(bundle)  # never reads hnsw_w.bin
    assert predictor.predict_ids(texts[:3], k=3)[0].shape == (3, 3)
    with pytest.raises(BundleError, match=r"hnsw_w\.bin: sha256 mismatch"):
        Predictor(predictor.bundle, PredictorOptions(k_w=10))


def _resident_pages(path: Path) -> int:
    """Pages of `path` in the page cache (mincore over a private map of it)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    with path.open("rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    buf = (ctypes.c_char * size).from_buffer(mm)
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec) == 0
    del buf
    mm.close()
    return sum(v & 1 for v in vec)


def test_a_refused_bundle_leaves_no_page_cache_behind(bundle_root: Path, tmp_path: Path) -> None:
    """Checking a bundle reads it in full; once refused, its pages are dropped (in a container
    they would count as the service's memory), while files linked into other bundles stay."""
    from service.api.registry import ActivationFailed, BundleRegistry
    from service.engine.store import BundleStore
    from shortlist.bundle_fuzz import index_of, make_variant

    root = tmp_path / "bundles"
    root.mkdir()
    shutil.copytree(bundle_root / "v1", root / "v1")
    make_variant(root / "v1", root, 0, index_of(root / "v1", "centroids.npy", "nan"), version="bad")
    (root / "bad" / "tokenizer.json").unlink()
    (root / "bad" / "tokenizer.json").hardlink_to(root / "v1" / "tokenizer.json")
    os.sync()
    probe = root / "bad" / "classifiers.npy"
    os.posix_fadvise(os.open(probe, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
    if _resident_pages(probe):
        pytest.skip("this filesystem keeps every page in memory (tmpfs)")
    registry = BundleRegistry(BundleStore(root, tmp_path / "state"), check_timeout_s=None)
    try:
        registry.activate("v1")
        with pytest.raises(ActivationFailed, match="centroids"):
            registry.activate("bad")
        assert registry.active_version == "v1"
        for name in ("classifiers.npy", "centroids.npy", "manifest.json", "encoder.onnx"):
            assert _resident_pages(root / "bad" / name) == 0, name
        assert _resident_pages(root / "bad" / "tokenizer.json") > 0  # shared with v1
    finally:
        registry.close()
