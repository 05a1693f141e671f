"""The token shortlist at serving time: per token, the labels it co-occurred with most in training.

Two uses, both lookups (no search): the first k labels of each query token's row join the
shortlist S, and their shares P(l | t) give a lexical score
    lex_l(x) = sum over query tokens t with l among row t's first k labels of x_t * P(l | t)
(x_t: the token's tf-idf weight in the query). Fitted by training/token_shortlist.py.
"""

from __future__ import annotations

import numpy as np


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

    def entries(
        self, tokens: np.ndarray, k: int, token_weights: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The query tokens' first k labels, int32 [B, T * k] (padding slots and short rows give
        -1), and with token_weights their lexical terms x_t * P(l | t), float32 [B, T * k].

        Summed per label (Predictor merges them with the other shortlist sources) the terms are
        lex_l; a -1 slot's term is 0 (Bundle.load checks).
        """
        labels = self.labels[tokens, :k].reshape(len(tokens), -1)
        if token_weights is None:
            return labels, None
        if self.shares is None:
            raise LookupError("this token shortlist has no shares: no lexical scores")
        terms = self.shares[tokens, :k] * token_weights[:, :, None]
        return labels, terms.reshape(len(tokens), -1)

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
