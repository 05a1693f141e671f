"""Approximate inner-product search over label vectors (hnswlib), the bundle's index format."""

from __future__ import annotations

from pathlib import Path

import hnswlib
import numpy as np


class VectorIndex:
    """Maximum-inner-product search over L rows of dimension `dim`; row i is label i.

    Rows of very different norms (classifiers with a bias coordinate) make a poor HNSW
    graph under a raw inner product, so each row x is stored as the unit vector
    [x, sqrt(M^2 - |x|^2)] / M (M = the largest row norm) and each query as [q, 0]:
    the inner product then ranks rows exactly as <x, q> does, on a well-behaved graph.

    Searches never modify the index, so concurrent `search` calls from several threads
    are safe (hnswlib releases the GIL while it searches).
    """

    def __init__(self, index: hnswlib.Index, ef_search: int) -> None:
        self._index = index
        self.dim = index.dim - 1
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
        sq = np.einsum("ij,ij->i", vectors, vectors)
        max_sq = max(float(sq.max()), 1e-12)
        lifted = np.hstack([vectors, np.sqrt(np.maximum(max_sq - sq, 0.0))[:, None]]) / np.sqrt(max_sq)
        index = hnswlib.Index(space="ip", dim=lifted.shape[1])
        index.init_index(max_elements=len(vectors), M=M, ef_construction=ef_construction, random_seed=seed)
        index.add_items(lifted.astype(np.float32), np.arange(len(vectors)), num_threads=threads)
        return cls(index, ef_search)

    @classmethod
    def load(cls, path: str | Path, dim: int, count: int, ef_search: int) -> VectorIndex:
        index = hnswlib.Index(space="ip", dim=dim + 1)
        try:
            index.load_index(str(path), max_elements=count)
        except (RuntimeError, ValueError, OSError) as exc:
            raise ValueError(f"{path}: cannot load hnsw index of dim {dim}: {exc}") from exc
        if index.get_current_count() != count:
            raise ValueError(f"{path}: index holds {index.get_current_count()} vectors, expected {count}")
        return cls(index, ef_search)

    def save(self, path: str | Path) -> None:
        self._index.save_index(str(path))

    def set_ef(self, ef_search: int) -> None:
        """Change the search breadth; not safe while other threads search this index."""
        self.ef_search = int(ef_search)
        self._index.set_ef(self.ef_search)

    def search(self, queries: np.ndarray, k: int) -> np.ndarray:
        """Ids [B, k] of the rows with the largest inner product with each query, best first."""
        k = min(k, self.count)
        if k > self.ef_search:
            raise ValueError(f"k={k} exceeds ef_search={self.ef_search}")
        lifted = np.hstack([queries, np.zeros((len(queries), 1), dtype=np.float32)])
        labels, _ = self._index.knn_query(lifted, k=k, num_threads=1)
        return labels.astype(np.int64)
