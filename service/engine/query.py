"""Texts -> encoded queries: the tokens and their tf-idf weights (which the token shortlist and the
lexical score read) and the unit embedding q (which the vectors score). One definition, used by
the Predictor and by a router that encodes a query once for every shard of a sharded bundle."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from service.engine.bundle import Bundle
from service.engine.encoder import OnnxEncoder
from service.engine.schema import MAX_MANIFEST_BYTES
from service.engine.tokenizer import Tokenizer

# Token slots (rows x the batch's longest text) the encoder runs at once. Its graph gathers a
# [rows, T, D] array, its float32 cast and a weighted copy, and onnxruntime's arena keeps the
# largest run's buffers for the session's life: a batch of 1000 titles (T up to 64) in one run
# held 131 MiB from then on; 4,096 slots ~10 MiB at D = 256, 1,024 slots ~2.5 (debian-deps, the
# test split in batches of 1000: peak RSS -4.7 MiB against 4,096, queries/s within the noise).
TOKENS_PER_RUN = 1024

class EncodedQueries(NamedTuple):
    """tokens int64 [B, T] (0-padded), weights float32 [B, T], q float32 [B, D]."""

    tokens: np.ndarray
    weights: np.ndarray
    q: np.ndarray


class QueryEncoder:
    """A bundle's tokenizer and ONNX encoder. Safe to call from several threads at once."""

    def __init__(self, tokenizer: Tokenizer, encoder: OnnxEncoder) -> None:
        self.tokenizer = tokenizer
        self.encoder = encoder

    @classmethod
    def open(cls, path: str | Path, threads: int = 1, *,
             max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> QueryEncoder:
        """The encoder of the bundle at `path`, checked (Bundle.open_query_side) without opening
        its label arrays; raises BundleError naming what is wrong."""
        bundle = Bundle.open_query_side(path, max_manifest_bytes)
        return cls(bundle.tokenizer, bundle.encoder(threads))

    def __call__(self, texts: Sequence[str]) -> EncodedQueries:
        """The texts tokenized and encoded, at most TOKENS_PER_RUN token slots an encoder run."""
        ids, weights = self.tokenizer.encode_batch(list(texts))
        rows = max(1, TOKENS_PER_RUN // ids.shape[1])
        if len(ids) <= rows:
            return EncodedQueries(ids, weights, self.encoder.run(ids, weights))
        q = np.concatenate([self.encoder.run(ids[i : i + rows], weights[i : i + rows])
                            for i in range(0, len(ids), rows)])
        return EncodedQueries(ids, weights, q)
