"""Approximate inner-product search over label vectors (hnswlib), the bundle's index format."""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import hnswlib
import numpy as np

from service.engine import heap
from service.engine.schema import HnswParams, projection_file
from service.engine.small_files import save_array

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

    With a `Projection` the graph holds the centred rows projected onto their top principal
    directions and is searched with the queries projected the same way: an index that only
    finds candidates (their scores are computed from the stored rows afterwards) needs far
    fewer dimensions than the rows have, and hnswlib keeps a float32 copy of every vector it
    indexes (debian-deps, 42K centroids, D = 256: 52 MiB of the serving process's heap).

    Searches never modify the index, so concurrent `search` calls from several threads
    are safe (hnswlib releases the GIL while it searches).
    """

    def __init__(self, index: hnswlib.Index, ef_search: int, projection: Projection | None = None) -> None:
        self._index = index
        self.projection = projection
        self.dim = index.dim if projection is None else projection.input_dim  # of the rows and queries
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
        progress: Callable[[range], Iterable[int]] | None = None,
        projection_dim: int = 0,
    ) -> VectorIndex:
        """An index of `vectors`' rows, projected onto their top `projection_dim` principal
        directions when > 0. `progress` wraps the starts of the row blocks inserted in turn (a
        training bar); one block at a time with one thread makes the graph one call would."""
        projection = None
        if projection_dim:
            projection = Projection.fit(vectors, projection_dim)
            centred = projection.rows(vectors)
        else:
            centred = centred_rows(vectors)
        index = hnswlib.Index(space="ip", dim=centred.shape[1])
        index.init_index(max_elements=len(vectors), M=M, ef_construction=ef_construction, random_seed=seed)
        starts = range(0, len(centred), _INSERT_ROWS_AT_ONCE)
        for start in progress(starts) if progress is not None else starts:
            block = centred[start : start + _INSERT_ROWS_AT_ONCE]
            index.add_items(block, np.arange(start, start + len(block)), num_threads=threads)
        return cls(index, ef_search, projection)

    @classmethod
    def load(cls, path: str | Path, dim: int, count: int, ef_search: int, projection_dim: int = 0) -> VectorIndex:
        """The index saved at `path` over `count` rows of dimension `dim`; with `projection_dim`
        > 0 its projection too (schema.projection_file names the file beside it)."""
        path = Path(path)
        projection = None
        if projection_dim:
            projection = Projection.load(path.with_name(projection_file(path.name)), dim, projection_dim)
            dim = projection_dim
        try:
            state = _read_saved_index(path, dim)
        except (OSError, ValueError, struct.error) as exc:
            raise ValueError(f"{path}: cannot load hnsw index of dim {dim}: {exc}") from exc
        if state["cur_element_count"] != count:
            raise ValueError(f"{path}: index holds {state['cur_element_count']} vectors, expected {count}")
        # The level-0 block hnswlib is about to allocate, at exactly its size: glibc's best fit
        # then picks the same free chunk for both calls, the one the prefault made resident.
        nbytes = state["max_elements"] * state["size_data_per_element"]
        index = hnswlib.Index.__new__(hnswlib.Index)

        def copy_in() -> None:
            heap.prefault(nbytes)
            index.__setstate__((state,))

        try:
            heap.in_huge_pages(copy_in, nbytes)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}: cannot load hnsw index of dim {dim}: {exc}") from exc
        return cls(index, ef_search, projection)

    def add(self, vectors: np.ndarray, reference: np.ndarray) -> None:
        """Append rows as ids count, count + 1, ... (labels added after training), centred (and
        projected) as the rows already indexed were. A projected index stores the mean it
        subtracts; an unprojected one keeps only centred rows, so that mean is recovered from
        `reference`, the uncentred vectors of its first rows.
        Never call this on an index that serves: searches may not run beside an insertion."""
        if self.projection is not None:
            centred = self.projection.rows(vectors)
        else:
            n = min(len(reference), self.count, 256)
            stored = np.asarray(self._index.get_items(np.arange(n)), dtype=np.float64)
            mean = (np.asarray(reference[:n], dtype=np.float64) - stored).mean(axis=0)
            centred = (np.asarray(vectors, dtype=np.float64) - mean).astype(np.float32)
        self._index.resize_index(self.count + len(centred))
        # One insertion thread: the same additions make the same graph.
        self._index.add_items(centred, np.arange(self.count, self.count + len(centred)), num_threads=1)
        self.count += len(centred)

    def save(self, path: str | Path) -> list[Path]:
        """Write the index to `path` (and its projection beside it); returns the files written."""
        path = Path(path)
        self._index.save_index(str(path))
        _check_written(path, self._index.index_file_size())
        if self.projection is None:
            return [path]
        return [path, self.projection.save(path.with_name(projection_file(path.name)))]

    def search(self, queries: np.ndarray, k: int, threads: int = 1) -> np.ndarray:
        """Ids [B, k] of the rows with the largest inner product with each query, best first
        (in the projection, if the index has one).

        hnswlib searches max(ef_search, k) candidates. `threads` > 1 splits a large batch of
        queries (offline use); serving calls use one.
        """
        k = min(k, self.count)
        if self.projection is not None:
            queries = self.projection.queries(queries)
        try:
            labels, _ = self._index.knn_query(queries, k=k, num_threads=threads)
        except RuntimeError:
            return self._search_each(queries, k)
        return labels.astype(np.int64)

    def _search_each(self, queries: np.ndarray, k: int) -> np.ndarray:
        """hnswlib refuses a batch when one query reaches fewer than k elements (a graph whose
        entry point's component is small): answer each query with what it reaches, -1 padded."""
        out = np.full((len(queries), k), -1, dtype=np.int64)
        for row in range(len(queries)):
            width = k
            while width:
                try:
                    labels, _ = self._index.knn_query(queries[row : row + 1], k=width, num_threads=1)
                except RuntimeError:
                    width //= 2
                    continue
                out[row, :width] = labels[0]
                break
        return out


_CENTRE_ROWS_AT_ONCE = 1 << 16
_INSERT_ROWS_AT_ONCE = 1 << 14
# How far a stored projection's columns may be from orthonormal (float32 rounding is ~1e-6).
_ORTHONORMAL_TOLERANCE = 1e-3


class Projection:
    """Rows and queries onto the top-d principal directions of an index's centred rows.

    components [D, d] (orthonormal columns, each column's largest entry positive, so a fit is
    the same on any LAPACK) and offset [d], the rows' mean projected: a row x is stored as
    x @ components - offset, its centred row projected, and a query q searched as q @ components
    (the offset shifts every row's inner product with q by the same amount). Inner products in
    the projection rank rows as the full ones do up to the variance the dropped directions hold:
    the index's candidates are scored in full afterwards, so it only has to find them.
    """

    def __init__(self, components: np.ndarray, offset: np.ndarray) -> None:
        self.components = np.ascontiguousarray(components, dtype=np.float32)
        self.offset = np.ascontiguousarray(offset, dtype=np.float32)
        self.input_dim, self.dim = self.components.shape

    @classmethod
    def fit(cls, vectors: np.ndarray, dim: int) -> Projection:
        """The top-`dim` principal directions of `vectors`' rows (covariance summed in float64 a
        block of rows at a time: no centred copy of all rows)."""
        rows, width = np.shape(vectors)
        if not 1 <= dim < width:
            raise ValueError(f"projection_dim {dim} must be in [1, {width}) for rows of dimension {width}")
        mean = np.asarray(vectors).mean(axis=0, dtype=np.float64)
        cov = np.zeros((width, width))
        for start in range(0, rows, _CENTRE_ROWS_AT_ONCE):
            block = np.asarray(vectors[start : start + _CENTRE_ROWS_AT_ONCE], dtype=np.float64) - mean
            cov += block.T @ block
        _, vectors_by_variance = np.linalg.eigh(cov)  # ascending
        components = vectors_by_variance[:, ::-1][:, :dim]
        components *= np.sign(components[np.abs(components).argmax(axis=0), np.arange(dim)])
        return cls(components, mean @ components)

    def rows(self, vectors: np.ndarray) -> np.ndarray:
        """float32 [n, d]: rows centred and projected as the indexed rows were."""
        out = np.empty((len(vectors), self.dim), dtype=np.float32)
        for start in range(0, len(out), _CENTRE_ROWS_AT_ONCE):
            block = np.asarray(vectors[start : start + _CENTRE_ROWS_AT_ONCE], dtype=np.float32)
            out[start : start + len(block)] = block @ self.components - self.offset
        return out

    def queries(self, queries: np.ndarray) -> np.ndarray:
        return np.asarray(queries, dtype=np.float32) @ self.components

    def save(self, path: Path) -> Path:
        """float32 [D + 1, d]: the components, then the offset as the last row."""
        save_array(path, np.vstack((self.components, self.offset[None, :])))
        return path

    @classmethod
    def load(cls, path: Path, input_dim: int, dim: int) -> Projection:
        """The projection saved at `path`, checked: ValueError naming the file and what is wrong."""
        try:
            stored = np.load(path, allow_pickle=False)
        except Exception as exc:  # numpy parses a header with Python's tokenizer: any error type
            raise ValueError(f"{path}: unreadable projection: {type(exc).__name__}: {exc}") from exc
        want = (input_dim + 1, dim)
        if stored.dtype != np.float32 or stored.shape != want:
            raise ValueError(f"{path}: expected float32 {want} (rows of dimension {input_dim} onto {dim}), "
                             f"found {stored.dtype} {stored.shape}")
        if not np.isfinite(stored).all():
            raise ValueError(f"{path}: non-finite values")
        components = stored[:-1]
        gram = components.T.astype(np.float64) @ components
        if np.abs(gram - np.eye(dim)).max() > _ORTHONORMAL_TOLERANCE:
            raise ValueError(f"{path}: the components are not orthonormal (not a projection export wrote)")
        return cls(components, stored[-1])


def _check_written(path: Path, expected: int) -> None:
    """hnswlib writes through a C++ stream that ignores failures: a full disk (or a file that
    cannot be opened) leaves a cut index, or none, without a word. An OSError naming the file
    when it is not the whole index (ENOSPC when the filesystem has no room left for the rest)."""
    written = path.stat().st_size
    if written == expected:
        return
    fs = os.statvfs(path.parent)
    code = errno.ENOSPC if fs.f_bavail * fs.f_frsize < expected - written else errno.EIO
    raise OSError(code, f"{os.strerror(code)} (hnswlib wrote {written} of the index's {expected} bytes)", str(path))


def centred_rows(vectors: np.ndarray) -> np.ndarray:
    """float32 rows minus their mean, computed in float64 a block of rows at a time (a float64
    copy of 10^6 x 257 values is 2 GB)."""
    mean = np.asarray(vectors).mean(axis=0, dtype=np.float64)
    out = np.empty(np.shape(vectors), dtype=np.float32)
    for start in range(0, len(out), _CENTRE_ROWS_AT_ONCE):
        block = np.asarray(vectors[start : start + _CENTRE_ROWS_AT_ONCE], dtype=np.float64)
        out[start : start + len(block)] = block - mean
    return out


def build_label_indices(
    w: np.ndarray, b: np.ndarray, mu: np.ndarray, params: HnswParams, seed: int, threads: int = 1,
    progress: Callable[[str], Callable[[range], Iterable[int]]] | None = None,
) -> tuple[VectorIndex, VectorIndex]:
    """A bundle's two indices: over [w_l, b_l] (the bias rides along as one more coordinate,
    matched by a constant 1 in the query) and over mu_l. One insertion thread makes the same
    graphs for the same seed; more are faster (10^6 labels: tens of minutes on one) and make
    graphs that depend on their timing. `progress(name)` wraps each build's row blocks."""
    wb = np.hstack([np.asarray(w, dtype=np.float32), np.asarray(b, dtype=np.float32)[:, None]])
    return tuple(VectorIndex.build(x, params.M, params.ef_construction, params.ef_search, seed, threads=threads,
                                   progress=progress(name) if progress is not None else None,
                                   projection_dim=params.projection_dim)
                 for name, x in (("classifiers", wb), ("centroids", mu)))  # type: ignore[return-value]


def _read_saved_index(path: Path, dim: int) -> dict[str, Any]:
    """An index file as the state `hnswlib.Index.__setstate__` takes (its pickle format),
    checked so that hnswlib can neither read nor write outside its memory (`_check_graph`).

    Why not `Index.load_index`: it holds the GIL for its whole run (~40 ms for 42K x 257
    floats, longer while another core is busy), and bundles are loaded on a background
    thread of a serving process, so every in-flight request stalled that long during a hot
    swap. Here the file is read with the GIL released and parsed with numpy; only the final
    copy into hnswlib's memory holds it (~28 ms).
    """
    # np.empty, not bytearray: no zero-filling pass (with the GIL held) before the read.
    raw = np.empty(path.stat().st_size, dtype=np.uint8)
    with path.open("rb", buffering=0) as f:
        if f.readinto(memoryview(raw)) != len(raw):
            raise ValueError("file changed size while being read")
    if len(raw) < _HEADER.size:
        raise ValueError(f"{len(raw)} bytes, shorter than an hnswlib header")
    names = ("offset_level0", "max_elements", "cur_element_count", "size_data_per_element", "label_offset",
             "offset_data", "max_level", "enterpoint_node", "max_M", "max_M0", "M", "mult", "ef_construction")
    header = dict(zip(names, _HEADER.unpack_from(raw, 0), strict=True))
    _check_header(header, dim, len(raw))
    count, size_per_element = header["cur_element_count"], header["size_data_per_element"]
    level0_end = _HEADER.size + count * size_per_element
    levels, link_lists = _upper_links(raw[level0_end:], count, header["max_M"] * 4 + 4)
    level0 = raw[_HEADER.size : level0_end]
    labels = np.ndarray((count,), dtype="<u8", buffer=memoryview(raw), offset=_HEADER.size + header["label_offset"],
                        strides=(size_per_element,)).copy()
    _check_graph(header, dim, level0, levels, link_lists, labels)
    return {
        **header, "ser_version": _PICKLE_VERSION, "space": "ip", "dim": dim, "index_inited": True,
        "ep_added": True, "normalize": False, "num_threads": 1, "seed": 100,
        "ef": 10, "has_deletions": False, "size_links_per_element": header["max_M"] * 4 + 4,
        "allow_replace_deleted": False,
        "label_lookup_external": labels,
        "label_lookup_internal": np.arange(count, dtype=np.uint32),
        "element_levels": levels,
        "data_level0": level0.view(np.int8),
        "link_lists": link_lists.view(np.int8),
    }


def _check_header(h: dict[str, Any], dim: int, file_size: int) -> None:
    """The geometry hnswlib would compute for this M and dim, and sizes the file can hold.

    hnswlib allocates max_elements blocks (and a visited list as long) before it copies
    anything: a header may not ask for more than the file holds.
    """
    count, m = h["cur_element_count"], h["M"]
    if not 2 <= m <= 10_000 or h["max_M"] != m or h["max_M0"] != 2 * m:
        raise ValueError(f"header: M={m}, maxM={h['max_M']}, maxM0={h['max_M0']} (hnswlib writes maxM0 = 2 maxM = 2M)")
    offset_data = h["max_M0"] * 4 + 4
    if (h["offset_level0"] != 0 or h["offset_data"] != offset_data or h["label_offset"] != offset_data + dim * 4
            or h["size_data_per_element"] != offset_data + dim * 4 + 8):
        raise ValueError("not an hnswlib index of this dimension (header disagrees)")
    if count < 1 or h["max_elements"] != count:
        raise ValueError(f"header: {count} elements of capacity {h['max_elements']} (export writes a full index)")
    if _HEADER.size + count * h["size_data_per_element"] > file_size:
        raise ValueError(f"file truncated: the header promises {count} elements")
    if not 0 <= h["enterpoint_node"] < count:
        raise ValueError(f"entry point {h['enterpoint_node']} outside the index's {count} elements")
    if h["max_level"] < 0:
        raise ValueError(f"header: max level {h['max_level']}")


def _upper_links(tail: np.ndarray, count: int, size_links: int) -> tuple[np.ndarray, np.ndarray]:
    """Each element's level (int32 [count]) and the upper-level link lists of all elements in
    order (uint32 words), from the file's tail: per element a byte count, then its lists."""
    # The tail is 4-byte words. ~1/M of the elements have upper levels, so the walk jumps over
    # each run of zero headers instead of visiting every element in Python.
    if len(tail) % 4:
        raise ValueError("file truncated (link lists end mid-word)")
    words = tail.view("<u4")
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
    return levels, np.concatenate(links) if links else np.zeros(0, dtype="<u4")


def _check_graph(h: dict[str, Any], dim: int, level0: np.ndarray, levels: np.ndarray, link_lists: np.ndarray,
                 labels: np.ndarray) -> None:
    """Everything a search reads is inside the index: every link count within its list, every
    neighbour id an element, every level-l neighbour an element with level >= l, the entry
    point on the top level; labels are each element's row, once; vectors are finite.

    hnswlib trusts all of it (a neighbour id past the end is read as a vector; a level past an
    element's own reads past its link lists), so a damaged graph would crash the process or
    answer from stray memory.
    """
    count, max_m0, max_m = h["cur_element_count"], h["max_M0"], h["max_M"]
    top = int(levels.max())
    if h["max_level"] != top or levels[h["enterpoint_node"]] != top:
        raise ValueError(f"header: max level {h['max_level']} and entry point {h['enterpoint_node']} "
                         f"(level {levels[h['enterpoint_node']]}) disagree with the elements' levels (top {top})")
    blocks = level0.view("<u4").reshape(count, -1)
    _check_links(blocks[:, : 1 + max_m0], None, levels, "level 0")
    if link_lists.size:
        # Element i's lists are for levels 1..levels[i], in that order.
        level_of = np.arange(int(levels.sum())) - np.repeat(np.cumsum(levels) - levels, levels) + 1
        _check_links(link_lists.reshape(-1, 1 + max_m), level_of, levels, "upper levels")
    offset = h["offset_data"] // 4
    vectors = blocks[:, offset : offset + dim].view("<f4")
    if not np.isfinite(vectors).all():
        raise ValueError(f"vector {int(np.flatnonzero(~np.isfinite(vectors).all(axis=1))[0])} is not finite")
    if labels.max() >= count or np.bincount(labels.astype(np.int64), minlength=count).max() != 1:
        raise ValueError(f"element labels are not the rows 0..{count - 1}, each once")


def _check_links(lists: np.ndarray, level_of: np.ndarray | None, levels: np.ndarray, where: str) -> None:
    """lists: uint32 [n, 1 + max links], each a link count (low 16 bits, as hnswlib reads it)
    then ids; level_of [n]: the level each list links on (None: level 0, which every element has)."""
    sizes = lists[:, 0] & 0xFFFF
    width = lists.shape[1] - 1
    if (sizes > width).any():
        raise ValueError(f"{where}: a link list holds {int(sizes.max())} links, at most {width} fit")
    used = np.arange(width) < sizes[:, None]
    ids = lists[:, 1:][used]
    if ids.size and ids.max() >= len(levels):
        raise ValueError(f"{where}: neighbour id {int(ids.max())} outside the index's {len(levels)} elements")
    if level_of is not None and ids.size and (levels[ids] < np.repeat(level_of, sizes)).any():
        raise ValueError(f"{where}: a link to an element that has no list on that level")
