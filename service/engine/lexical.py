"""The token shortlist at serving time: per token, the labels it co-occurred with most in training.

Two uses, both lookups (no search): the first k labels of each query token's row join the
shortlist S, and their shares P(l | t) give a lexical score
    lex_l(x) = sum over query tokens t with l among row t's first k labels of x_t * P(l | t)
(x_t: the token's tf-idf weight in the query). Fitted by training/token_shortlist.py.
"""

from __future__ import annotations

import numpy as np

_MATCH_ROWS = 16


class TokenShortlist:
    """labels int32 [V, W] (-1 padded, row 0 = padding token, all -1); shares float32 [V, W] or None."""

    def __init__(self, labels: np.ndarray, shares: np.ndarray | None = None) -> None:
        if labels.ndim != 2:
            raise ValueError(f"labels must be [vocab, width], got shape {labels.shape}")
        if shares is not None and shares.shape != labels.shape:
            raise ValueError(f"shares shape {shares.shape} differs from labels shape {labels.shape}")
        if shares is not None and np.any(shares[labels < 0]):
            raise ValueError("shares must be 0 in the empty (-1) slots")
        self.labels = labels
        self.shares = shares

    @property
    def width(self) -> int:
        return int(self.labels.shape[1])

    def candidates(self, tokens: np.ndarray, k: int) -> np.ndarray:
        """[B, T * k] label ids of the query tokens' rows (padding slots and short rows give -1)."""
        return self.labels[tokens, :k].reshape(len(tokens), -1).astype(np.int64)

    def scores(self, tokens: np.ndarray, token_weights: np.ndarray, cands: np.ndarray, k: int) -> np.ndarray:
        """lex at candidate ids [B, C] (-1 entries and labels in no query token's row score 0)."""
        if self.shares is None:
            raise LookupError("this token shortlist has no shares: no lexical scores")
        b = len(tokens)
        labels = self.labels[tokens, :k].reshape(b, 1, -1)
        values = (self.shares[tokens, :k] * token_weights[:, :, None]).reshape(b, -1, 1)
        # Candidates against the query's (token, label) entries, a few rows at a time: the
        # match matrix is [rows, C, T * k] (a few thousand cells for one short query). A -1
        # candidate matches only empty slots, whose shares are 0 (Bundle.load checks).
        if b <= _MATCH_ROWS:
            return np.matmul((cands[:, :, None] == labels).astype(np.float32), values)[:, :, 0]
        out = np.empty(cands.shape, dtype=np.float32)
        for start in range(0, b, _MATCH_ROWS):
            part = slice(start, start + _MATCH_ROWS)
            match = cands[part, :, None] == labels[part]
            out[part] = np.matmul(match.astype(np.float32), values[part])[:, :, 0]
        return out

    def dense_scores(self, tokens: np.ndarray, token_weights: np.ndarray, num_labels: int, k: int) -> np.ndarray:
        """lex over all labels, [B, num_labels] (reference scoring, training's tuning)."""
        if self.shares is None:
            raise LookupError("this token shortlist has no shares: no lexical scores")
        b = len(tokens)
        labels = self.labels[tokens, :k].reshape(b, -1)
        values = (self.shares[tokens, :k] * token_weights[:, :, None]).reshape(b, -1)
        out = np.zeros((b, num_labels), dtype=np.float32)
        rows = np.broadcast_to(np.arange(b)[:, None], labels.shape)
        keep = labels >= 0
        np.add.at(out, (rows[keep], labels[keep]), values[keep])
        return out
