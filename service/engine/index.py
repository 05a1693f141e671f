"""Approximate inner-product search over label vectors (hnswlib), the bundle's index format."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import hnswlib
import numpy as np

from service.engine import heap
from service.engine.schema import HnswParams

# hnswlib's saved-index layout (HierarchicalNSW::saveIndex, unchanged since 0.6): offsetLevel0,
# max_elements, cur_element_count, size_data_per_element, label_offset, offsetData (size_t),
# maxlevel (int), enterpoint_node (uint32), maxM, maxM0, M (size_t), mult (double),
# ef_construction (size_t); then every element's level-0 block; then per element a uint32
# byte count and its upper-level links.
_HEADER = struct.Struct("<QQQQQQiIQQQdQ")
_PICKLE_VERSION = 1  # the state layout hnswlib.Index.__setstate__ reads (hnswlib 0.8)


class VectorIndex:
    """Maximum-inner-product search over L rows of dimension `dim`; row i is label i.

    Rows are stored centred: <x - mean, q> ranks rows exactly as <x, q> does (mean.q is
    the same for every row), and removing the component that all rows share is what lets
    HNSW's graph tell them apart. Trained classifier rows point almost the same way (the
    mean of their unit directions has norm ~0.9 on debian-deps): uncentred, recall@50 at
    ef 50 was 0.21; centred, 0.83. (Lifting rows onto a sphere, the textbook MIPS-to-NN
    reduction, did worse still: 0.09, every query being near-orthogonal to every row.)

    Searches never modify the index, so concurrent `search` calls from several threads
    are safe (hnswlib releases the GIL while it searches).
    """

    def __init__(self, index: hnswlib.Index, ef_search: int) -> None:
        self._index = index
        self.dim = index.dim
        self.count = index.get_current_count()
        self.ef_search = int(ef_search)
        index.set_ef(self.ef_search)

    @classmethod
    def build(
        cls,
        vectors: np.ndarray,
        M: int = 16,
        ef_construction: int = 200,
        ef_search: int = 100,
        seed: int = 0,
        threads: int = -1,
    ) -> VectorIndex:
        vectors = np.asarray(vectors, dtype=np.float64)
        centred = (vectors - vectors.mean(axis=0)).astype(np.float32)
        index = hnswlib.Index(space="ip", dim=centred.shape[1])
        index.init_index(max_elements=len(vectors), M=M, ef_construction=ef_construction, random_seed=seed)
        index.add_items(centred, np.arange(len(vectors)), num_threads=threads)
        return cls(index, ef_search)

    @classmethod
    def load(cls, path: str | Path, dim: int, count: int, ef_search: int) -> VectorIndex:
        path = Path(path)
        try:
            state = _read_saved_index(path, dim)
        except (OSError, ValueError, struct.error) as exc:
            raise ValueError(f"{path}: cannot load hnsw index of dim {dim}: {exc}") from exc
        if state["cur_element_count"] != count:
            raise ValueError(f"{path}: index holds {state['cur_element_count']} vectors, expected {count}")
        # The level-0 block hnswlib is about to allocate, at exactly its size: glibc's best fit
        # then picks the same free chunk for both calls, the one the prefault made resident.
        heap.prefault(state["max_elements"] * state["size_data_per_element"])
        index = hnswlib.Index.__new__(hnswlib.Index)
        try:
            index.__setstate__((state,))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}: cannot load hnsw index of dim {dim}: {exc}") from exc
        return cls(index, ef_search)

    def save(self, path: str | Path) -> None:
        self._index.save_index(str(path))

    def search(self, queries: np.ndarray, k: int, threads: int = 1) -> np.ndarray:
        """Ids [B, k] of the rows with the largest inner product with each query, best first.

        hnswlib searches max(ef_search, k) candidates. `threads` > 1 splits a large batch of
        queries (offline use); serving calls use one.
        """
        k = min(k, self.count)
        labels, _ = self._index.knn_query(queries, k=k, num_threads=threads)
        return labels.astype(np.int64)


def build_label_indices(
    w: np.ndarray, b: np.ndarray, mu: np.ndarray, params: HnswParams, seed: int
) -> tuple[VectorIndex, VectorIndex]:
    """A bundle's two indices: over [w_l, b_l] (the bias rides along as one more coordinate,
    matched by a constant 1 in the query) and over mu_l. One insertion thread, so the graphs
    are the same for the same seed."""
    wb = np.hstack([np.asarray(w, dtype=np.float32), np.asarray(b, dtype=np.float32)[:, None]])
    return (VectorIndex.build(wb, params.M, params.ef_construction, params.ef_search, seed, threads=1),
            VectorIndex.build(mu, params.M, params.ef_construction, params.ef_search, seed, threads=1))


def _read_saved_index(path: Path, dim: int) -> dict[str, Any]:
    """An index file as the state `hnswlib.Index.__setstate__` takes (its pickle format).

    Why not `Index.load_index`: it holds the GIL for its whole run (~40 ms for 42K x 257
    floats, longer while another core is busy), and bundles are loaded on a background
    thread of a serving process, so every in-flight request stalled that long during a hot
    swap. Here the file is read with the GIL released and parsed with numpy; only the final
    copy into hnswlib's memory holds it (~28 ms).
    hnswlib re-checks the geometry (M, dims, offsets) against the header when it takes the
    state, so a file from another layout is refused, not misread.
    """
    # np.empty, not bytearray: no zero-filling pass (with the GIL held) before the read.
    raw = np.empty(path.stat().st_size, dtype=np.uint8)
    with path.open("rb", buffering=0) as f:
        if f.readinto(memoryview(raw)) != len(raw):
            raise ValueError("file changed size while being read")
    if len(raw) < _HEADER.size:
        raise ValueError(f"{len(raw)} bytes, shorter than an hnswlib header")
    (offset_level0, max_elements, count, size_per_element, label_offset, offset_data, max_level,
     enterpoint, max_m, max_m0, m, mult, ef_construction) = _HEADER.unpack_from(raw, 0)
    size_links = max_m * 4 + 4
    level0_end = _HEADER.size + count * size_per_element
    if (size_per_element != offset_data + dim * 4 + 8 or label_offset + 8 > size_per_element
            or level0_end > len(raw) or count > max_elements):
        raise ValueError("not an hnswlib index of this dimension (header disagrees)")
    # The tail is 4-byte words: a header per element (its link bytes, a multiple of 4) and
    # the links. ~1/M of the elements have upper levels, so the walk jumps over each run of
    # zero headers instead of visiting every element in Python.
    if (len(raw) - level0_end) % 4:
        raise ValueError("file truncated (link lists end mid-word)")
    words = raw[level0_end:].view("<u4")
    nonzero = np.flatnonzero(words)
    levels = np.zeros(count, dtype=np.int32)
    links: list[np.ndarray] = []
    i = j = 0
    while i < count:
        at = np.searchsorted(nonzero, j)
        k = int(nonzero[at]) if at < len(nonzero) else len(words)
        if i + (k - j) >= count:  # the remaining elements have no upper levels
            j += count - i
            break
        if k == len(words):
            raise ValueError(f"file truncated: link headers for {i + (k - j)} of {count} elements")
        i, j = i + (k - j), k
        size = int(words[j])
        end = j + 1 + size // 4
        if size % size_links or end > len(words):
            raise ValueError(f"element {i}: corrupted link list (file truncated or damaged)")
        levels[i] = size // size_links
        links.append(words[j + 1 : end])
        i, j = i + 1, end
    if j != len(words):
        raise ValueError(f"{4 * (len(words) - j)} trailing bytes: file truncated or corrupted")
    link_lists = np.concatenate(links).view(np.int8) if links else np.zeros(0, dtype=np.int8)
    level0 = raw[_HEADER.size : level0_end].view(np.int8)
    labels = np.ndarray((count,), dtype="<u8", buffer=memoryview(raw), offset=_HEADER.size + label_offset,
                        strides=(size_per_element,)).copy()
    return {
        "ser_version": _PICKLE_VERSION, "space": "ip", "dim": dim, "index_inited": True,
        "ep_added": True, "normalize": False, "num_threads": 1, "seed": 100,
        "offset_level0": offset_level0, "max_elements": max_elements, "cur_element_count": count,
        "size_data_per_element": size_per_element, "label_offset": label_offset,
        "offset_data": offset_data, "max_level": max_level, "enterpoint_node": enterpoint,
        "max_M": max_m, "max_M0": max_m0, "M": m, "mult": mult, "ef_construction": ef_construction,
        "ef": 10, "has_deletions": False, "size_links_per_element": size_links,
        "allow_replace_deleted": False,
        "label_lookup_external": labels,
        "label_lookup_internal": np.arange(count, dtype=np.uint32),
        "element_levels": levels,
        "data_level0": level0,
        "link_lists": link_lists,
    }
