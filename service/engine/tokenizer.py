"""The tokenizer contract: text -> (token ids, TF-IDF weights).

This is the single definition used by training, export, evaluation and serving, so a
document is tokenised the same way wherever it is seen.
"""

from __future__ import annotations

import array
import json
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import orjson

TOKENIZER_FORMAT = 1
# Id 0 is padding: it has weight 0 in every padded batch, so its embedding row never counts.
PAD_ID = 0
_TOKEN_RE = re.compile(r"\w+")


def normalize_text(text: str) -> str:
    """NFKC-normalise and lower-case, so full-width and composed forms share tokens."""
    if text.isascii():  # NFKC leaves ASCII as it is
        return text.lower()
    return unicodedata.normalize("NFKC", text).lower()


def word_tokens(text: str) -> list[str]:
    return _TOKEN_RE.findall(normalize_text(text))


class Tokenizer:
    """Word tokens with TF-IDF weights over a fixed vocabulary.

    Unknown tokens are dropped; a text with no known token encodes to an empty list,
    which the encoder maps to the zero vector (a valid input, not an error).
    """

    def __init__(self, vocab: Sequence[str], idf: Sequence[float], max_tokens: int = 64) -> None:
        if len(vocab) != len(idf):
            raise ValueError(f"vocab has {len(vocab)} tokens but idf has {len(idf)} values")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        # Tuples for the same reason as LabelTable's: untracked by the cyclic GC.
        self.vocab: tuple[str, ...] = tuple(vocab)
        self.idf = np.asarray(idf, dtype=np.float32)
        self.max_tokens = int(max_tokens)
        # ids are 1-based: PAD_ID = 0 is reserved.
        self._index: dict[str, int] = {tok: i + 1 for i, tok in enumerate(self.vocab)}
        # array.array, not a tuple of floats: 8 bytes an entry instead of 32 (each serving
        # process holds its own), and indexing it gives a Python float as fast.
        self._idf_by_id = array.array("d", (0.0, *self.idf.tolist()))

    @property
    def vocab_size(self) -> int:
        """Number of embedding rows the encoder needs (vocabulary plus the padding row)."""
        return len(self.vocab) + 1

    @classmethod
    def fit(
        cls,
        texts: Iterable[str],
        min_df: int = 1,
        max_vocab: int | None = None,
        max_tokens: int = 64,
    ) -> Tokenizer:
        """Build the vocabulary and smoothed idf = ln((1 + n) / (1 + df)) + 1 from `texts`."""
        df: Counter[str] = Counter()
        n = 0
        for text in texts:
            df.update(set(word_tokens(text)))
            n += 1
        items = [(tok, c) for tok, c in df.items() if c >= min_df]
        # Most frequent first, ties broken by the token so the vocabulary is deterministic.
        items.sort(key=lambda tc: (-tc[1], tc[0]))
        if max_vocab is not None:
            items = items[:max_vocab]
        vocab = [tok for tok, _ in items]
        idf = [math.log((1 + n) / (1 + c)) + 1.0 for _, c in items]
        return cls(vocab, idf, max_tokens=max_tokens)

    def encode(self, text: str) -> tuple[list[int], list[float]]:
        """Token ids (first-occurrence order) and their L2-normalised tf * idf weights."""
        index = self._index
        counts: dict[int, int] = {}
        for tok in _TOKEN_RE.findall(normalize_text(text)):
            i = index.get(tok)
            if i is not None:
                counts[i] = counts.get(i, 0) + 1
        if not counts:
            return [], []
        idf = self._idf_by_id
        ids = list(counts)
        weights = [counts[i] * idf[i] for i in ids]
        if len(ids) > self.max_tokens:
            # Keep the most informative tokens of a long text, in their original order.
            keep = sorted(sorted(range(len(ids)), key=lambda j: -weights[j])[: self.max_tokens])
            ids = [ids[j] for j in keep]
            weights = [weights[j] for j in keep]
        norm = math.sqrt(sum(w * w for w in weights))
        return ids, [w / norm for w in weights]

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Padded int64 ids and float32 weights, both [len(texts), T] with T >= 1."""
        if len(texts) == 1:  # the single-query path: one array each, nothing to pad
            tok_ids, tok_w = self.encode(texts[0])
            return np.array([tok_ids or [PAD_ID]], dtype=np.int64), np.array([tok_w or [0.0]], dtype=np.float32)
        encoded = [self.encode(t) for t in texts]
        width = max(1, max((len(ids) for ids, _ in encoded), default=1))
        ids = np.zeros((len(texts), width), dtype=np.int64)
        weights = np.zeros((len(texts), width), dtype=np.float32)
        for row, (tok_ids, tok_w) in enumerate(encoded):
            ids[row, : len(tok_ids)] = tok_ids
            weights[row, : len(tok_w)] = tok_w
        return ids, weights

    def to_dict(self) -> dict:
        return {
            "format": TOKENIZER_FORMAT,
            "normalization": "NFKC+lower",
            "token_pattern": _TOKEN_RE.pattern,
            "max_tokens": self.max_tokens,
            "vocab": self.vocab,
            "idf": [float(x) for x in self.idf],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        try:
            # orjson: bundles load beside live traffic, and one json.loads of this file held
            # the GIL for ~10 ms on debian-deps (37K tokens); orjson takes ~2.5 ms.
            data = orjson.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read tokenizer: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a tokenizer is a JSON object")
        if data.get("format") != TOKENIZER_FORMAT:
            raise ValueError(f"{path}: tokenizer format {data.get('format')!r}, expected {TOKENIZER_FORMAT}")
        if data.get("token_pattern") != _TOKEN_RE.pattern:
            raise ValueError(f"{path}: tokenizer was built with another token pattern")
        try:
            tokenizer = cls(data["vocab"], data["idf"], max_tokens=data.get("max_tokens", 64))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: bad tokenizer: {exc!r}") from exc
        if not all(isinstance(token, str) for token in tokenizer.vocab):
            raise ValueError(f"{path}: vocabulary entries must be strings")
        if not (np.isfinite(tokenizer.idf).all() and (tokenizer.idf >= 0).all()):
            raise ValueError(f"{path}: idf values must be finite and >= 0")
        return tokenizer
