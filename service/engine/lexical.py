"""The token shortlist at serving time: per token, the labels it co-occurred with most in training.

Two uses, both lookups (no search): the first k labels of each query token's row join the
shortlist S, and a weight per (token, label) slot gives a lexical score. Two forms:
  "shares":   lex_l(x) = sum_t x_t P(l | t), the fraction of texts holding t that l was seen with;
  "logistic": lex_l(x) = sigmoid(sum_t x_t W[t, l] + c_l), a one-vs-all logistic model on the
              query's tf-idf tokens, learned on the table's slots (W signed, c_l a per-label bias);
              0 for a label the query's slots do not hold (the model is fitted on those only);
in both, t runs over the query tokens with l among row t's first k labels (x_t: the token's
tf-idf weight in the query). Fitted by training/token_shortlist.py.

Labels added after training (service.engine.label_changes) have rows of their own beside the
table, the overflow: per token, every label added since whose text holds it, each slot with a
weight in the same form; a query's tokens' overflow rows join the first k of their table rows.
"""

from __future__ import annotations

import numpy as np

from service.engine.schema import LEXICAL_FORMS, LexicalForm


class TokenShortlist:
    """labels int32 [V, W] (-1 padded, row 0 = padding token, all -1); weights float32 [V, W] or
    None (no lexical score); bias float32 [L] for the logistic form; overflow int32 [V, W'] and
    overflow_weights float32 [V, W'] (with weights only): the labels added after training."""

    def __init__(
        self,
        labels: np.ndarray,
        weights: np.ndarray | None = None,
        form: LexicalForm = "shares",
        bias: np.ndarray | None = None,
        overflow: np.ndarray | None = None,
        overflow_weights: np.ndarray | None = None,
    ) -> None:
        if labels.ndim != 2:
            raise ValueError(f"labels must be [vocab, width], got shape {labels.shape}")
        if form not in LEXICAL_FORMS:
            raise ValueError(f"lexical form must be one of {', '.join(LEXICAL_FORMS)}, got {form!r}")
        if weights is not None and weights.shape != labels.shape:
            raise ValueError(f"weights shape {weights.shape} differs from labels shape {labels.shape}")
        if weights is not None and np.any(weights[labels < 0]):
            raise ValueError("weights must be 0 in the empty (-1) slots")
        if form == "logistic" and weights is not None:
            if bias is None or bias.ndim != 1:
                raise ValueError("the logistic form needs a bias vector [num_labels]")
            if labels.size and int(labels.max()) >= len(bias):
                raise ValueError(f"label ids reach {int(labels.max())} but the bias covers {len(bias)} labels")
        elif bias is not None:
            raise ValueError("a bias belongs to the logistic form with weights")
        if overflow is not None:
            _check_overflow(labels, weights, bias, overflow, overflow_weights)
        elif overflow_weights is not None:
            raise ValueError("overflow weights without overflow rows")
        self.labels = labels
        self.weights = weights
        self.form = form
        self.bias = bias
        self.overflow = overflow
        self.overflow_weights = overflow_weights

    @property
    def width(self) -> int:
        return int(self.labels.shape[1])

    def entries(
        self, tokens: np.ndarray, k: int, token_weights: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The query tokens' first k labels, int32 [B, T * k] (padding slots and short rows give
        -1), and with token_weights their terms x_t * W[t, l], float32 [B, T * k].

        Summed per label (service.engine.candidates merges them with the other sources) and passed
        to `scores`, the terms give lex_l; a -1 slot's term is 0 (checked at construction).
        """
        labels = self._slots(self.labels, self.overflow, tokens, k).reshape(len(tokens), -1)
        if token_weights is None:
            return labels, None
        if self.weights is None:
            raise LookupError("this token shortlist has no weights: no lexical scores")
        terms = self._slots(self.weights, self.overflow_weights, tokens, k) * token_weights[:, :, None]
        return labels, terms.reshape(len(tokens), -1)

    @staticmethod
    def _slots(table: np.ndarray, overflow: np.ndarray | None, tokens: np.ndarray, k: int) -> np.ndarray:
        """[B, T, k (+ W')]: the first k slots of each token's row, then its overflow row."""
        rows = table[tokens, :k]
        return rows if overflow is None else np.concatenate((rows, overflow[tokens]), axis=2)

    def scores(self, labels: np.ndarray, sums: np.ndarray) -> np.ndarray:
        """lex of label ids [B, C] (-1 slots: any value) from their summed terms [B, C].

        Logistic: a label whose terms sum to exactly 0 (none of the query's slots holds it: it
        came from another shortlist source, or from slots the model never learned) scores 0,
        not its bias alone: the model was fitted on the labels the query's tokens point at.
        """
        if self.form == "shares":
            return sums
        # where(sums != 0, 1 / (1 + exp(-clip(z, -60, 60))), 0), in place on z (this runs on every query)
        z = sums + self.bias[np.maximum(labels, 0)]
        np.maximum(z, -60.0, out=z)
        np.minimum(z, 60.0, out=z)
        np.negative(z, out=z)
        np.exp(z, out=z)
        z += 1.0
        np.divide(1.0, z, out=z)
        z[sums == 0] = 0.0
        return z.astype(np.float32, copy=False)

    def dense_scores(self, tokens: np.ndarray, token_weights: np.ndarray, num_labels: int, k: int) -> np.ndarray:
        """lex over all labels, [B, num_labels] (reference scoring, training's tuning)."""
        if self.weights is None:
            raise LookupError("this token shortlist has no weights: no lexical scores")
        b = len(tokens)
        labels = self._slots(self.labels, self.overflow, tokens, k).reshape(b, -1)
        values = self._slots(self.weights, self.overflow_weights, tokens, k) * token_weights[:, :, None]
        values = values.reshape(b, -1)
        out = np.zeros((b, num_labels), dtype=np.float32)
        rows = np.broadcast_to(np.arange(b)[:, None], labels.shape)
        keep = labels >= 0
        np.add.at(out, (rows[keep], labels[keep]), values[keep])
        return self.scores(np.broadcast_to(np.arange(num_labels), out.shape), out)


def _check_overflow(labels: np.ndarray, weights: np.ndarray | None, bias: np.ndarray | None,
                    overflow: np.ndarray, overflow_weights: np.ndarray | None) -> None:
    if overflow.ndim != 2 or overflow.shape[0] != labels.shape[0]:
        raise ValueError(f"overflow rows {overflow.shape} do not match the table's {labels.shape[0]} tokens")
    if (weights is None) != (overflow_weights is None):
        raise ValueError("the overflow has weights exactly when the table has")
    if overflow_weights is not None:
        if overflow_weights.shape != overflow.shape:
            raise ValueError(f"overflow weights shape {overflow_weights.shape} differs from {overflow.shape}")
        if np.any(overflow_weights[overflow < 0]):
            raise ValueError("overflow weights must be 0 in the empty (-1) slots")
    if bias is not None and overflow.size and int(overflow.max()) >= len(bias):
        raise ValueError(f"overflow label ids reach {int(overflow.max())} but the bias covers {len(bias)} labels")
