"""VectorIndex: the bundle's HNSW files, read without hnswlib's GIL-holding load_index."""

from __future__ import annotations

from pathlib import Path

import hnswlib
import numpy as np
import pytest

from service.engine.index import VectorIndex


@pytest.fixture(scope="module")
def saved_index(tmp_path_factory) -> tuple[Path, np.ndarray]:
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((3000, 33)).astype(np.float32)
    path = tmp_path_factory.mktemp("index") / "hnsw.bin"
    VectorIndex.build(vectors, M=8, ef_construction=64, ef_search=40, seed=1).save(path)
    return path, vectors


def test_load_answers_exactly_as_hnswlibs_own_loader(saved_index) -> None:
    path, vectors = saved_index
    ours = VectorIndex.load(path, dim=33, count=len(vectors), ef_search=40)
    theirs = hnswlib.Index(space="ip", dim=33)
    theirs.load_index(str(path), max_elements=len(vectors))
    theirs.set_ef(40)
    queries = np.random.default_rng(4).standard_normal((200, 33)).astype(np.float32)
    expected, _ = theirs.knn_query(queries, k=20)
    assert np.array_equal(ours.search(queries, 20), expected.astype(np.int64))
    # Upper-level links were carried over too: a graph without them still answers, but
    # differently, so compare the graph's size as hnswlib reports it as well.
    assert ours._index.index_file_size() == theirs.index_file_size()


@pytest.mark.parametrize(("damage", "message"), [
    (lambda b: b[:-3], "truncated"),
    (lambda b: b[:-4], "truncated|corrupted"),
    (lambda b: b[:-4000], "truncated|corrupted"),
    (lambda b: b[: len(b) - (len(b) - 96) // 3], "truncated|header disagrees"),
    (lambda b: b + b"\0\0\0\0", "trailing bytes"),
    (lambda b: b[:50], "shorter than an hnswlib header"),
])
def test_damaged_file_is_refused_naming_it(saved_index, tmp_path: Path, damage, message) -> None:
    path, vectors = saved_index
    bad = tmp_path / "bad.bin"
    bad.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=rf"bad\.bin: cannot load hnsw index of dim 33: .*({message})"):
        VectorIndex.load(bad, dim=33, count=len(vectors), ef_search=40)


def test_wrong_dimension_or_count_is_refused(saved_index) -> None:
    path, vectors = saved_index
    with pytest.raises(ValueError, match="header disagrees"):
        VectorIndex.load(path, dim=32, count=len(vectors), ef_search=40)
    with pytest.raises(ValueError, match="holds 3000 vectors, expected 2999"):
        VectorIndex.load(path, dim=33, count=2999, ef_search=40)


_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_LOAD_AND_COUNT = """
import sys
from pathlib import Path
from service.engine import heap
from service.engine.index import VectorIndex
heap.use_huge_pages(sys.argv[2] == "on")
index = VectorIndex.load(sys.argv[1], dim=256, count=6000, ef_search=40)
line = next(l for l in Path("/proc/self/smaps_rollup").read_text().splitlines() if l.startswith("AnonHugePages:"))
print(int(line.split()[1]))
"""


@pytest.mark.skipif(not _THP.exists() or "[never]" in _THP.read_text(), reason="no transparent huge pages here")
def test_an_index_gets_huge_pages_unless_turned_off(tmp_path: Path) -> None:
    import subprocess
    import sys

    rng = np.random.default_rng(5)
    vectors = rng.standard_normal((6000, 256)).astype(np.float32)  # a 6.6 MB graph block
    path = tmp_path / "hnsw.bin"
    VectorIndex.build(vectors, M=8, ef_construction=32, ef_search=40, seed=1).save(path)
    huge_kib = {mode: int(subprocess.run([sys.executable, "-c", _LOAD_AND_COUNT, str(path), mode], check=True,
                                         capture_output=True, text=True, timeout=120).stdout)
                for mode in ("on", "off")}
    assert huge_kib["on"] - huge_kib["off"] >= 2048  # at least one 2 MiB page of the block
    queries = rng.standard_normal((100, 256)).astype(np.float32)
    with_pages = VectorIndex.load(path, dim=256, count=6000, ef_search=40).search(queries, 10)
    theirs = hnswlib.Index(space="ip", dim=256)
    theirs.load_index(str(path), max_elements=6000)
    theirs.set_ef(40)
    assert np.array_equal(with_pages, theirs.knn_query(queries, k=10)[0].astype(np.int64))
