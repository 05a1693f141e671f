"""Each query's candidate labels S (DESIGN.md, "Log-time prediction"), from the sources a
bundle's `scoring.shortlist` serves.

S = topK_w(HNSW over [w_l, b_l] with query [q, 1]) U topK_mu(HNSW over mu_l) U H U T,
H = the k_head labels of largest bias b_l (query-independent: the label prior's head), in
every S (head "always") or only where no query token has a label in the token shortlist
(head "fallback": the prior answers a text whose words say nothing),
T = the first k_tok labels of each query token's row of the token shortlist (a lookup),
U in a derived bundle the top-k_added of the labels added after training by w_l.q + b_l (exact
search over their rows: AddedLabels).

One definition: the service serves it and training tunes the scoring on it, over the same
indices and table the bundle ships.
"""

from __future__ import annotations

import numpy as np

from service.engine.index import VectorIndex
from service.engine.lexical import TokenShortlist
from service.engine.schema import Shortlist


class AddedLabels:
    """The labels added after training as a shortlist source: the k whose w_l.q + b_l is largest,
    by exact scoring of their rows (a float32 copy of [w_l, b_l]: ~1 KB a label at D = 256).

    Trained labels reach a query through the token rows of its words; a label added by its text
    has no trained row, and its words need not be the words of its documents.
    """

    def __init__(self, ids: np.ndarray, w: np.ndarray, b: np.ndarray) -> None:
        if w.ndim != 2 or len(w) != len(ids) or b.shape != ids.shape:
            raise ValueError(f"added labels: ids {ids.shape}, w {w.shape}, b {b.shape} do not match")
        self.ids = np.asarray(ids, dtype=np.int64)
        self.w = np.ascontiguousarray(w, dtype=np.float32)
        self.b = np.asarray(b, dtype=np.float32)

    def __len__(self) -> int:
        return len(self.ids)

    def search(self, q: np.ndarray, k: int) -> np.ndarray:
        """Label ids [B, min(k, N)] of each query's top k (in no particular order)."""
        if len(self.ids) <= k:
            return np.broadcast_to(self.ids, (len(q), len(self.ids)))
        scores = q @ self.w.T
        scores += self.b
        return self.ids[np.argpartition(-scores, k - 1, axis=1)[:, :k]]


class CandidateSources:
    """The shortlist spec's sources over concrete indices and a token table.

    index_w / index_mu are needed when k_w / k_mu > 0, the table when k_tok > 0; bias [L] ranks
    the head; `added` is searched when k_added > 0 (None or empty: nothing to search). With
    `lexical`, each candidate also gets the table's lexical score. Safe to call from several
    threads at once (searches never modify an index).
    """

    def __init__(
        self,
        spec: Shortlist,
        bias: np.ndarray,
        *,
        index_w: VectorIndex | None = None,
        index_mu: VectorIndex | None = None,
        table: TokenShortlist | None = None,
        lexical: bool = False,
        added: AddedLabels | None = None,
    ) -> None:
        if spec.k_w and index_w is None or spec.k_mu and index_mu is None:
            raise ValueError("k_w / k_mu > 0 need the HNSW index they search")
        if spec.k_tok and (table is None or spec.k_tok > table.width):
            have = 0 if table is None else table.width
            raise ValueError(f"k_tok={spec.k_tok} but the token shortlist holds {have} labels per token")
        if lexical and (table is None or table.weights is None or not spec.k_tok):
            raise ValueError("lexical_weight > 0 needs a token shortlist with weights and k_tok >= 1")
        self.spec = spec
        self.num_labels = len(bias)
        self.index_w = index_w if spec.k_w else None
        self.index_mu = index_mu if spec.k_mu else None
        self.table = table if spec.k_tok else None
        self.lexical = lexical
        self.added = added if spec.k_added and added is not None and len(added) else None
        self.head = np.argsort(-np.asarray(bias), kind="stable")[: spec.k_head].astype(np.int64)

    def __call__(
        self, tokens: np.ndarray, token_weights: np.ndarray, q: np.ndarray, head: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Label ids [B, C] of each query's S (sorted, distinct, -1 padded at the end; C = the
        longest row) and, with `lexical`, their lexical scores [B, C]. head (bool [B]): the rows
        the head joins under "fallback", instead of the rows whose tokens found no label."""
        spec = self.spec
        searched = []
        if self.index_w is not None:
            ones = np.ones((len(q), 1), dtype=np.float32)
            searched.append(self.index_w.search(np.hstack([q, ones]), spec.k_w))
        if self.index_mu is not None:
            searched.append(self.index_mu.search(q, spec.k_mu))
        if self.added is not None:
            searched.append(self.added.search(q, spec.k_added))
        labels = terms = None
        if self.table is not None:
            # Row 0 (padding) is all -1, so padded token slots add nothing.
            labels, terms = self.table.entries(tokens, spec.k_tok, token_weights if self.lexical else None)
        cands, sums = union_shortlist(len(q), searched, self.head if len(self.head) else None, spec.head, labels,
                                      terms, self.num_labels, unmatched=head)
        return cands, None if sums is None else self.table.scores(cands, sums)


def union_shortlist(
    rows: int,
    searched: list[np.ndarray],
    head: np.ndarray | None,
    head_mode: str,
    token_labels: np.ndarray | None,
    token_terms: np.ndarray | None,
    num_labels: int,
    unmatched: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """S of each of `rows` queries: the searched ids [rows, k] U the head ids [H] (in every row,
    or with head_mode "fallback" only in rows whose token labels are all -1, or those `unmatched`
    says, bool [rows]) U the token shortlist's labels [rows, T * k], merged by merge_shortlists
    with the token terms summed."""
    parts = list(searched)
    if head is not None:
        head = head[None, :]
        if token_labels is not None and head_mode == "fallback":
            if unmatched is None:
                unmatched = token_labels.max(axis=1) < 0  # no query token has a label in its row
            if rows == 1:
                if unmatched[0]:
                    parts.append(head)
            elif unmatched.any():
                parts.append(np.where(unmatched[:, None], head, -1))
        else:
            parts.append(np.broadcast_to(head, (rows, head.shape[1])))
    terms = None
    if token_labels is not None:
        if token_terms is not None:
            # The other sources' slots carry no lexical term.
            width = sum(part.shape[1] for part in parts)
            terms = np.concatenate((np.zeros((rows, width), np.float32), token_terms), axis=1) if width else token_terms
        parts.append(token_labels)
    return merge_shortlists(np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0], terms, num_labels)


def merge_shortlists(
    labels: np.ndarray, terms: np.ndarray | None, num_labels: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Label ids [B, N] (-1 = empty slot, repeats allowed) and their terms [B, N] (or None) ->
    each row's distinct ids [B, C], sorted, -1 padded at the end, and the sum of each id's terms.

    One stable sort of all rows at once (key row * (L + 1) + id + 1), so a text's ids and sums
    are the same alone and in a batch.
    """
    rows = len(labels)
    span = num_labels + 1
    key = np.add(labels, 1, dtype=np.int64)
    if rows > 1:
        key += np.arange(0, rows * span, span, dtype=np.int64)[:, None]
    key = key.ravel()  # array methods below, not np.*: the same calls without their Python wrappers
    if terms is None:
        key.sort()
    else:
        order = key.argsort(kind="stable")
        key = key[order]
    first = np.empty(len(key), dtype=bool)
    first[0] = True
    np.not_equal(key[1:], key[:-1], out=first[1:])
    starts = first.nonzero()[0]
    groups = key[starts]
    sums = None if terms is None else np.add.reduceat(terms.ravel()[order], starts)
    if rows == 1:
        skip = int(groups[0] == 0)  # the empty slots' group sorts first
        if skip == len(groups):
            return np.full((1, 1), -1, dtype=np.int64), None if sums is None else np.zeros((1, 1), np.float32)
        return (groups[skip:] - 1)[None, :], None if sums is None else sums[skip:][None, :]
    row_of, ids = np.divmod(groups, span)
    keep = ids > 0
    row_of, ids = row_of[keep], ids[keep] - 1
    counts = np.bincount(row_of, minlength=rows)
    cols = np.arange(len(ids)) - np.repeat(np.cumsum(counts) - counts, counts)
    cands = np.full((rows, max(1, int(counts.max()))), -1, dtype=np.int64)
    cands[row_of, cols] = ids
    if sums is None:
        return cands, None
    lexical = np.zeros(cands.shape, dtype=np.float32)
    lexical[row_of, cols] = sums[keep]
    return cands, lexical
