"""The token shortlist: for each token, the labels it co-occurred with most in training.

Serving reads row t of the table for every token t of a query (service/engine/predictor.py):
a lookup that adds the labels a query's words were seen with to the HNSW shortlists, at no
search cost. On debian-deps (title, test split), 10 labels per token from the training
documents alone plus the 32 head labels, scored by the same model, kept P@1 / P@5 at the
HNSW shortlists' level (62.9 / 32.2 against 62.4 / 32.1) with 54 candidates instead of ~130
but lost the tail (PSP@5 20.0 against 24.4); counting each label's own text as well brought
it back (P@1 62.7, P@5 32.9, PSP@5 24.0) with no HNSW search at all. The shares as a lexical
score beside the model's (weight 0.2, chosen on validation) lifted P@5 to 33.7 (P@1 63.0).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def fit_token_shortlist(
    doc_tokens: np.ndarray, y: sp.csr_matrix, label_tokens: np.ndarray, vocab_size: int, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per token id the labels it co-occurred with most: labels int32 [vocab_size, width] (-1
    padded) and their shares float32 [vocab_size, width], P(label | token) = co-occurrences /
    texts (documents and label texts) holding the token.

    doc_tokens: padded token ids [N, T] of the training documents (0 = padding); y: their
    targets [N, L]; label_tokens: padded token ids [L, T'] of the label texts. A label counts
    one co-occurrence per document that has both, plus one if its own text has the token:
    without the label texts a label seen with few documents reaches no token's list.
    Ties go to the smaller label id, so the table is deterministic. Row 0 stays -1.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if y.shape[0] != len(doc_tokens):
        raise ValueError(f"{len(doc_tokens)} documents of token ids but {y.shape[0]} rows of targets")
    if len(label_tokens) != y.shape[1]:
        raise ValueError(f"{len(label_tokens)} label texts but {y.shape[1]} labels")
    docs, label_texts = _incidence(doc_tokens, vocab_size), _incidence(label_tokens, vocab_size)
    counts = (docs.T @ (y > 0).astype(np.float32) + label_texts.T).tocsr()  # [V, L]
    texts_with = np.asarray(docs.sum(axis=0)).ravel() + np.asarray(label_texts.sum(axis=0)).ravel()
    table = np.full((vocab_size, width), -1, dtype=np.int32)
    shares = np.zeros((vocab_size, width), dtype=np.float32)
    for token in range(1, vocab_size):
        start, end = counts.indptr[token], counts.indptr[token + 1]
        if start == end:
            continue
        labels = counts.indices[start:end]
        # Most documents first; lexsort's last key is the primary one.
        order = np.lexsort((labels, -counts.data[start:end]))[:width]
        table[token, : len(order)] = labels[order]
        shares[token, : len(order)] = counts.data[start:end][order] / texts_with[token]
    table[0] = -1
    shares[0] = 0.0
    return table, shares


def _incidence(tokens: np.ndarray, vocab_size: int) -> sp.csr_matrix:
    """Binary [N, V] text-token matrix: a token counts once per text however often it occurs."""
    n, t = tokens.shape
    rows = np.repeat(np.arange(n), t)
    cols = tokens.ravel()
    keep = cols > 0
    x = sp.csr_matrix((np.ones(int(keep.sum()), dtype=np.float32), (rows[keep], cols[keep])), shape=(n, vocab_size))
    x.data[:] = 1.0  # duplicate (row, col) pairs were summed on construction
    return x
