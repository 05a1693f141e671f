"""HNSW indices over the label vectors projected onto their top principal directions (bundle format 3,
hnsw.projection_dim): they find what exact search finds, round-trip through their files, refuse
damaged projections naming the file, take labels added live; bundles without them read as before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import PROJECTION_DIM
from test_engine import drop_tree_arrays, refresh_checksum, rewrite_manifest

from model_export.export import export_checkpoint
from service.engine import BundleError, Predictor, PredictorOptions
from service.engine.bundle import Bundle
from service.engine.index import VectorIndex
from service.engine.label_changes import LabelChange, LabelEditor, NewLabel
from service.engine.schema import HNSW_MU, HNSW_MU_PROJECTION, HNSW_W_PROJECTION, MANIFEST
from service.engine.tree import NODE_LEXICAL


def _clustered(rng: np.random.Generator, n: int, dim: int = 64, rank: int = 8) -> np.ndarray:
    """Rows near a rank-`rank` subspace (label vectors are: the top half of debian-deps' 256
    dimensions holds 86% of its centroids' variance), around a shared offset."""
    basis = rng.standard_normal((rank, dim))
    return (rng.standard_normal((n, rank)) @ basis + 0.1 * rng.standard_normal((n, dim)) + 1.0).astype(np.float32)


@pytest.fixture(scope="module")
def rows_and_queries() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows, queries (without the offset) and rows to add later, all of one distribution."""
    rng = np.random.default_rng(7)
    both = _clustered(rng, 3220)
    return both[:3000], both[3000:3200] - 1.0, both[3200:]


def _recall(found: np.ndarray, rows: np.ndarray, queries: np.ndarray, k: int) -> float:
    exact = np.argsort(-(queries @ rows.T), axis=1)[:, :k]
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(found, exact, strict=True)]))


def test_a_projected_index_finds_what_exact_search_over_the_full_rows_finds(rows_and_queries) -> None:
    rows, queries, _ = rows_and_queries
    full = VectorIndex.build(rows, M=12, ef_construction=100, ef_search=50, seed=0)
    projected = VectorIndex.build(rows, M=12, ef_construction=100, ef_search=50, seed=0, projection_dim=16)
    assert projected.dim == 64 and projected.projection.dim == 16
    baseline, recall = _recall(full.search(queries, 10), rows, queries, 10), _recall(
        projected.search(queries, 10), rows, queries, 10)
    # A quarter of the dimensions holds the rows' structure: the candidates are nearly all found.
    assert recall >= 0.9 and recall >= baseline - 0.05, (recall, baseline)


def test_a_projected_index_round_trips_through_its_files_and_takes_added_rows(rows_and_queries, tmp_path) -> None:
    rows, queries, extra = rows_and_queries
    built = VectorIndex.build(rows, M=12, ef_construction=100, ef_search=50, seed=0, projection_dim=16)
    written = built.save(tmp_path / "hnsw_mu.bin")
    assert [p.name for p in written] == ["hnsw_mu.bin", "hnsw_mu_projection.npy"]
    loaded = VectorIndex.load(tmp_path / "hnsw_mu.bin", dim=64, count=len(rows), ef_search=50, projection_dim=16)
    assert np.array_equal(loaded.search(queries, 10), built.search(queries, 10))
    # Rows added later are projected as the indexed ones were: searches find them as exact search does.
    loaded.add(extra, rows[:256])
    assert loaded.count == len(rows) + len(extra)
    probes = extra - 1.0
    assert _recall(loaded.search(probes, 10), np.vstack((rows, extra)), probes, 10) >= 0.9


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: p[:-1], r"expected float32 \(65, 16\).*found float32 \(64, 16\)"),
    (lambda p: p.astype(np.float64), "expected float32.*found float64"),
    (lambda p: np.where(np.arange(p.size).reshape(p.shape) == 5, np.nan, p).astype(np.float32), "non-finite"),
    (lambda p: (p * 2).astype(np.float32), "not orthonormal"),
])
def test_a_damaged_projection_is_refused_naming_its_file(rows_and_queries, tmp_path, damage, message) -> None:
    rows = rows_and_queries[0]
    VectorIndex.build(rows, M=8, ef_construction=40, ef_search=20, seed=0, projection_dim=16).save(tmp_path / "i.bin")
    path = tmp_path / "i_projection.npy"
    np.save(path, damage(np.load(path)))
    with pytest.raises(ValueError, match=rf"i_projection\.npy: .*{message}"):
        VectorIndex.load(tmp_path / "i.bin", dim=64, count=len(rows), ef_search=20, projection_dim=16)


def test_an_unreadable_projection_is_refused_naming_its_file(rows_and_queries, tmp_path) -> None:
    rows = rows_and_queries[0]
    VectorIndex.build(rows, M=8, ef_construction=40, ef_search=20, seed=0, projection_dim=16).save(tmp_path / "i.bin")
    path = tmp_path / "i_projection.npy"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"i_projection\.npy: unreadable projection"):
        VectorIndex.load(tmp_path / "i.bin", dim=64, count=len(rows), ef_search=20, projection_dim=16)


def test_retune_builds_projected_indices_and_export_serves_them(projected_bundle, bundle_root) -> None:
    predictor = Predictor.load(projected_bundle)  # checksums, shapes, canaries
    manifest = predictor.bundle.manifest
    assert manifest.format_version >= 3 and manifest.hnsw.projection_dim == PROJECTION_DIM
    assert {HNSW_W_PROJECTION, HNSW_MU_PROJECTION} <= set(manifest.files)
    searching = Predictor(predictor.bundle, PredictorOptions(k_w=20, k_mu=20))
    for name in ("w", "mu"):
        index = predictor.bundle.index(name)
        assert index.projection.dim == PROJECTION_DIM and index._index.dim == PROJECTION_DIM
    # The candidates differ only by what the projection misses: answers mostly agree with the
    # unprojected bundle of the same checkpoint.
    texts = list(predictor.bundle.labels.titles[:100])
    full = Predictor(Bundle.open(bundle_root / "v1"), PredictorOptions(k_w=20, k_mu=20))
    agree = np.mean(searching.predict_ids(texts, k=1)[0] == full.predict_ids(texts, k=1)[0])
    assert agree >= 0.8, agree
    # An unprojected bundle's manifest still says nothing of a projection.
    assert "projection_dim" not in json.loads((bundle_root / "v1" / MANIFEST).read_text())["hnsw"]


def _copy(bundle: Path, tmp_path: Path) -> Path:
    out = tmp_path / bundle.name
    shutil.copytree(bundle, out)
    return out


@pytest.mark.parametrize(("damage", "message"), [
    (lambda b: np.save(b / HNSW_MU_PROJECTION, np.load(b / HNSW_MU_PROJECTION)[:, :-1]),
     rf"{HNSW_MU_PROJECTION}: expected float32 \(33, {PROJECTION_DIM}\)"),
    (lambda b: np.save(b / HNSW_MU_PROJECTION, np.zeros_like(np.load(b / HNSW_MU_PROJECTION))), "not orthonormal"),
])
def test_a_bundle_with_a_damaged_projection_is_refused_naming_it(projected_bundle, tmp_path, damage, message) -> None:
    bundle = _copy(projected_bundle, tmp_path)
    damage(bundle)
    refresh_checksum(bundle, HNSW_MU_PROJECTION)  # past the checksum: the checks of the file itself
    with pytest.raises(BundleError, match=message):
        Predictor.load(bundle, PredictorOptions(k_mu=10))
    (bundle / HNSW_MU_PROJECTION).write_bytes(b"not a projection")
    with pytest.raises(BundleError, match=rf"{HNSW_MU_PROJECTION}: sha256 mismatch"):
        Predictor.load(bundle, PredictorOptions(k_mu=10))


@pytest.mark.parametrize(("change", "message"), [
    ({"format_version": 2}, "projection_dim 16 needs format_version 3"),
    ({"hnsw": {"projection_dim": 0}}, f"{HNSW_W_PROJECTION} is listed but hnsw.projection_dim is 0"),
    ({"hnsw": {"projection_dim": 32}}, "projection_dim 32 must be below dim 32"),
])
def test_a_manifest_whose_projection_disagrees_with_its_files_is_refused(projected_bundle, tmp_path, change,
                                                                         message) -> None:
    bundle = _copy(projected_bundle, tmp_path)
    rewrite_manifest(bundle, **change)
    with pytest.raises(BundleError, match=message):
        Predictor.load(bundle)


def test_a_projection_whose_files_are_not_listed_is_refused(projected_bundle, tmp_path) -> None:
    bundle = _copy(projected_bundle, tmp_path)
    manifest = json.loads((bundle / MANIFEST).read_text())
    del manifest["files"][HNSW_MU_PROJECTION]
    (bundle / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=f"projection_dim is 16 but {HNSW_MU_PROJECTION} is not listed"):
        Predictor.load(bundle)


def test_a_format_2_bundle_reads_and_answers_as_before(checkpoints, tmp_path) -> None:
    half = export_checkpoint(checkpoints["v1"], tmp_path / "new", "v1", n_parity=50, vector_dtype="float16")
    bundle = _copy(half, tmp_path)
    drop_tree_arrays(bundle, NODE_LEXICAL)  # format 5's
    rewrite_manifest(bundle, format_version=2)
    texts = list(Bundle.open(bundle).labels.titles[:50])
    options = PredictorOptions(k_w=10, k_mu=10)
    old, new = Predictor.load(bundle, options), Predictor.load(half, options)
    assert old.bundle.index("mu").projection is None
    assert np.array_equal(old.predict_ids(texts, k=5)[0], new.predict_ids(texts, k=5)[0])


def test_labels_added_live_are_found_through_a_projected_index(projected_bundle, tmp_path) -> None:
    parent = Bundle.open(projected_bundle)
    titles = [f"{a.split()[0]} {b.split()[-1]}" for a, b in zip(parent.labels.titles[:8], parent.labels.titles[-8:],
                                                                strict=True)]
    LabelEditor().derive(parent, LabelChange(add=[NewLabel(f"new-{i}", t) for i, t in enumerate(titles)]), tmp_path,
                         "d1")
    parent.close()
    derived = Bundle.open(tmp_path / "d1")
    assert (derived.path / HNSW_MU_PROJECTION).read_bytes() == (projected_bundle / HNSW_MU_PROJECTION).read_bytes()
    L = derived.manifest.num_labels
    q = Predictor(derived, PredictorOptions(k_mu=5)).encode(titles)
    index = derived.index("mu")
    assert index.count == L and index.projection is not None
    hits = index.search(np.ascontiguousarray(q, dtype=np.float32), 5)
    # An added label's centroid is its text's embedding: its own text finds it.
    assert sum(i in row for i, row in zip(range(L - 8, L), hits, strict=True)) >= 7
    assert (tmp_path / "d1" / HNSW_MU).stat().st_size > (projected_bundle / HNSW_MU).stat().st_size
