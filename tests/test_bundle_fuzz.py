"""The bundle fuzzer (shortlist/bundle_fuzz.py) over a real exported bundle: every structural
fault is refused naming its file, everything else serves sound answers, nothing crashes."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from service.engine.index import VectorIndex
from shortlist.bundle_fuzz import HNSW_FAULTS, catalogue, fuzz

# A few hundred in CI (each fault of the catalogue ~5 times at other places); bench/fuzz_bundles.py runs more.
VARIANTS = 400


@pytest.fixture(scope="module")
def fuzzed(bundle_root: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return fuzz(bundle_root / "v1", tmp_path_factory.mktemp("fuzz"), seed=11, count=VARIANTS)


def test_nothing_crashes_or_answers_out_of_range(fuzzed: list[dict]) -> None:
    outcomes = collections.Counter(r["outcome"] for r in fuzzed)
    assert len(fuzzed) == VARIANTS
    bad = [r for r in fuzzed if r["outcome"] in ("crash", "error")]
    assert not bad, bad[:5]
    # Both kinds occur: the blind faults are not all refused by luck of the checksum.
    assert outcomes["refused"] > VARIANTS // 2 and outcomes["served"] > 20, outcomes


def test_every_structural_fault_is_refused_naming_its_file(fuzzed: list[dict], bundle_root: Path) -> None:
    structural = [r for r in fuzzed if r["must_refuse"]]
    files = {p.name for p in (bundle_root / "v1").iterdir()}
    kinds = {(f, k) for f, k, _, must in catalogue(sorted(files)) if must}
    assert {(r["file"], r["kind"]) for r in structural} == kinds  # every fault of the catalogue was tried
    for r in structural:
        # A file the bundle's scoring never reads is checked when first opened (here every
        # source is searched, so all are read at load).
        assert r["outcome"] == "refused", r
        if r["file"] != "manifest.json":  # a field of the manifest may be refused by the file it disagrees with
            assert r["file"] in r["message"], r
        else:
            assert any(name in r["message"] for name in files), r


@pytest.mark.parametrize("kind", sorted(HNSW_FAULTS))
def test_each_graph_fault_is_refused_before_hnswlib_sees_it(kind: str, bundle_root: Path, tmp_path: Path) -> None:
    import numpy as np

    source = bundle_root / "v1" / "hnsw_mu.bin"
    dim = VectorIndex.load(source, dim=32, count=300, ef_search=10).dim
    for seed in range(20):  # each fault at 20 places
        bad = tmp_path / "hnsw_mu.bin"
        bad.write_bytes(source.read_bytes())
        HNSW_FAULTS[kind](bad, np.random.default_rng(seed))
        with pytest.raises(ValueError, match=r"hnsw_mu\.bin: cannot load hnsw index"):
            VectorIndex.load(bad, dim=dim, count=300, ef_search=10)
