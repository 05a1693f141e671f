"""The tree classifier's lexical part (training/tree_train.py): xi_y(x) gains

    sum_t x_t U[t, y] + hit_y(x) h_y

over the query's tokens t (TF-IDF weights x_t), where U is nonzero only on each token's row of
labels (the `width` labels it co-occurred with most in training documents and label texts,
training.token_shortlist.fit_token_shortlist) and hit_y(x) = 1 when some token of x has y in
its row. h_y is what a label is worth once the query's words point at it at all: a one-vs-all
model of tokens says nothing about the labels its rows never hold, so those get the term 0,
and h_y starts at the logistic bias plus MISS (a label no word points at ranks as if its
logit were MISS below its bias).

Served by service.engine.tree.LexicalRows (tree.npz: lexical_indptr, lexical_labels,
lexical_weights, lexical_bias).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from training.dataset import target_matrix
from training.token_shortlist import fit_token_logistic, fit_token_shortlist

# A lookup of (token, label) pairs: support slots, token weights, hits, labels (LexicalPart.lookup).
Lookup = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# How far below its logistic bias a label no query word points at starts (see the docstring).
MISS = 10.0


@dataclass
class TokenRows:
    """The documents' tokens as the service encodes them (padded ids and TF-IDF weights [N, T]),
    the label texts' token ids [L, T'] (or None) and the vocabulary size: xi's lexical input."""

    doc_ids: np.ndarray
    doc_weights: np.ndarray
    label_ids: np.ndarray | None
    vocab_size: int


@dataclass
class LexicalStart:
    """The support of U as sorted keys token * L + label, U's values there and h."""

    keys: np.ndarray
    weights: np.ndarray
    hit_bias: np.ndarray


def lexical_start(tokens: TokenRows, targets: Sequence[Sequence[int]], num_labels: int, width: int,
                  fitted: bool, epochs: int = 100, lr: float = 0.05, l2: float = 1e-5, seed: int = 0,
                  max_steps: int | None = None, tol: float = 0.0,
                  target_weights: Sequence[Sequence[float]] | None = None) -> LexicalStart:
    """Each token's row of labels, and U, h at zero or (fitted) at the one-vs-all logistic model
    of the tokens restricted to the rows (training.token_shortlist.fit_token_logistic)."""
    y = target_matrix(targets, num_labels, target_weights)
    label_ids = tokens.label_ids if tokens.label_ids is not None else np.zeros((num_labels, 1), np.int64)
    table, _ = fit_token_shortlist(tokens.doc_ids, y, label_ids, tokens.vocab_size, width)
    weights = np.zeros(table.shape, np.float32)
    hit_bias = np.zeros(num_labels, np.float32)
    if fitted:
        weights, bias, _ = fit_token_logistic(tokens.doc_ids, tokens.doc_weights, y, table, width, epochs=epochs,
                                              max_steps=max_steps, tol=tol, lr=lr, l2=l2, batch_size=1024, seed=seed,
                                              device=torch.device("cpu"))
        hit_bias = (bias + MISS).astype(np.float32)
    valid = table >= 0
    keys = (np.arange(len(table), dtype=np.int64)[:, None] * num_labels + table)[valid]
    order = np.argsort(keys, kind="stable")
    return LexicalStart(keys[order], weights[valid][order].astype(np.float32), hit_bias)


class LexicalPart:
    """The lexical term's parameters in torch (sparse rows, for Adagrad): U on the support, one
    more row fixed at 0 for every pair outside it, and h."""

    def __init__(self, tokens: TokenRows, start: LexicalStart, num_labels: int) -> None:
        self.num_labels, self.vocab_size, self.keys = num_labels, tokens.vocab_size, start.keys
        self.doc_ids = np.ascontiguousarray(tokens.doc_ids, dtype=np.int64)
        self.doc_weights = torch.from_numpy(np.ascontiguousarray(tokens.doc_weights, dtype=np.float32))
        nnz = len(self.keys)
        self.weight = torch.nn.Embedding(nnz + 1, 1, sparse=True, padding_idx=nnz)
        self.hit_bias = torch.nn.Embedding(num_labels, 1, sparse=True)
        with torch.no_grad():
            self.weight.weight[:nnz, 0] = torch.from_numpy(start.weights)
            self.weight.weight[nnz] = 0.0
            self.hit_bias.weight[:, 0] = torch.from_numpy(start.hit_bias)

    @property
    def parameters(self) -> list[torch.Tensor]:
        return [self.weight.weight, self.hit_bias.weight]

    def lookup(self, doc: np.ndarray, labels: np.ndarray) -> Lookup:
        """For labels[b, j] of the documents doc [B]: the support slot of each (token, label)
        [B, J, T] (nnz where outside it), the tokens' weights [B, 1, T], whether any token's row
        holds the label [B, J], and the labels."""
        ids = self.doc_ids[doc]  # [B, T]
        width = max(1, int((ids > 0).sum(1).max()))
        ids = ids[:, :width]
        keys = ids[:, None, :] * self.num_labels + labels[:, :, None]  # [B, J, T]
        slot = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        found = (self.keys[slot] == keys) & (ids[:, None, :] > 0)
        x = self.doc_weights[torch.from_numpy(doc)][:, None, :width]
        return (torch.from_numpy(np.where(found, slot, len(self.keys))), x, torch.from_numpy(found.any(-1)).float(),
                torch.from_numpy(labels))

    def scores(self, found: Lookup,
               weights: torch.Tensor | None = None, hit_bias: torch.Tensor | None = None) -> torch.Tensor:
        """[B, J] the lexical term of a lookup, with the live parameters or the given ones
        (weights [nnz + 1], hit_bias [L]; the start the regulariser measures change from)."""
        slot, x, hit, labels = found
        u = self.weight(slot)[..., 0] if weights is None else weights[slot]
        h = self.hit_bias(labels)[..., 0] if hit_bias is None else hit_bias[labels]
        return (u * x).sum(-1) + hit * h

    def export(self) -> dict[str, np.ndarray]:
        """U as CSR rows by token (indptr [V + 1] int64, labels [nnz] int32 ascending within a
        row, weights [nnz] float32) and h [L] float32."""
        token = self.keys // self.num_labels
        return {
            "lexical_indptr": np.searchsorted(token, np.arange(self.vocab_size + 1)).astype(np.int64),
            "lexical_labels": (self.keys % self.num_labels).astype(np.int32),
            "lexical_weights": self.weight.weight.detach().numpy()[:-1, 0].astype(np.float32),
            "lexical_bias": self.hit_bias.weight.detach().numpy()[:, 0].astype(np.float32),
        }
