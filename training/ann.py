"""Approximate nearest labels during training (hard negatives in Modules I and II), on the
serving engine's index (rows centred, which HNSW needs for embeddings that share a direction)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.engine.index import VectorIndex


@dataclass(frozen=True)
class AnnParams:
    M: int
    ef_construction: int
    ef_search: int
    threads: int  # query threads

    def build(self, vectors: np.ndarray, seed: int) -> VectorIndex:
        # One insertion thread: a multi-threaded build breaks determinism by seed.
        return VectorIndex.build(vectors, M=self.M, ef_construction=self.ef_construction,
                                 ef_search=max(self.ef_search, 1), seed=seed, threads=1)

    def nearest(self, index: VectorIndex, queries: np.ndarray, k: int) -> np.ndarray:
        """Ids [N, min(k, count)] of each query's nearest rows by inner product."""
        return index.search(np.ascontiguousarray(queries, dtype=np.float32), k, threads=self.threads)
