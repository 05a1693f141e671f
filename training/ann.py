"""Approximate nearest labels during training (hard negatives in Modules I and II), on the
serving engine's index (rows centred, which HNSW needs for embeddings that share a direction).

Unprojected (no projection_dim): the bundle's indices are projected to shrink what a serving
process holds for its whole life, and their candidates are scored in full after; these indices
live for one training stage, and their neighbours are the negatives themselves, so the ranking
the projection approximates would change what is trained (not measured: left as it was)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.engine.index import VectorIndex
from training.progress import Progress

# Queries searched per call: a progress line between calls (10^6 documents take minutes).
_QUERIES_AT_ONCE = 1 << 14


@dataclass(frozen=True)
class AnnParams:
    M: int
    ef_construction: int
    ef_search: int
    threads: int  # query threads
    progress: bool = True
    deterministic: bool = True  # one insertion thread: the same graph for the same seed

    def build(self, vectors: np.ndarray, seed: int, what: str = "labels") -> VectorIndex:
        # Several insertion threads build ~threads x faster (10^6 labels: minutes per index),
        # but the graph then depends on their timing: only when training need not be deterministic.
        rows = len(vectors)
        return VectorIndex.build(vectors, M=self.M, ef_construction=self.ef_construction,
                                 ef_search=max(self.ef_search, 1), seed=seed,
                                 threads=1 if self.deterministic else self.threads,
                                 progress=lambda starts: Progress(starts, f"ANN index of {rows} {what}",
                                                                  enabled=self.progress))

    def nearest(self, index: VectorIndex, queries: np.ndarray, k: int) -> np.ndarray:
        """Ids [N, min(k, count)] of each query's nearest rows by inner product."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        blocks = [index.search(queries[start : start + _QUERIES_AT_ONCE], k, threads=self.threads)
                  for start in Progress(range(0, len(queries), _QUERIES_AT_ONCE),
                                        f"ANN search of {len(queries)} queries", enabled=self.progress)]
        return np.concatenate(blocks) if blocks else np.zeros((0, min(k, index.count)), dtype=np.int64)
