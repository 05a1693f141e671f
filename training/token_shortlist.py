"""The token shortlist: for each token, the labels it co-occurred with most in training.

Serving reads row t of the table for every token t of a query (service/engine/predictor.py):
a lookup that adds the labels a query's words were seen with to the HNSW shortlists, at no
search cost. On debian-deps (title, test split), 10 labels per token from the training
documents alone plus the 32 head labels, scored by the same model, kept P@1 / P@5 at the
HNSW shortlists' level (62.9 / 32.2 against 62.4 / 32.1) with 54 candidates instead of ~130
but lost the tail (PSP@5 20.0 against 24.4); counting each label's own text as well brought
it back (P@1 62.7, P@5 32.9, PSP@5 24.0) with no HNSW search at all. The shares as a lexical
score beside the model's (weight 0.2, chosen on validation) lifted P@5 to 33.7 (P@1 63.0).

fit_token_logistic learns the table's other lexical form: a signed weight per (token, label)
slot and a bias per label, a one-vs-all logistic model on the tf-idf tokens restricted to the
table's slots, so it costs what the shares cost to serve and scales with V x k, not V x L.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from service.engine.lexical import TokenShortlist
from service.engine.schema import LEXICAL_FILES, TOKEN_SHORTLIST
from training.config import TrainConfig
from training.distinct_keys import contained, distinct, looked_up
from training.encoder import EncodedTexts
from training.progress import Progress

TABLE_FILE = "token_shortlist.npz"


def fit_token_shortlist(
    doc_tokens: np.ndarray, y: sp.csr_matrix, label_tokens: np.ndarray, vocab_size: int, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per token id the labels it co-occurred with most: labels int32 [vocab_size, width] (-1
    padded) and their shares float32 [vocab_size, width], P(label | token) = co-occurrences /
    texts (documents and label texts) holding the token.

    doc_tokens: padded token ids [N, T] of the training documents (0 = padding); y: their
    targets [N, L] (1, or an imputed label's weight); label_tokens: padded token ids [L, T'] of
    the label texts. A label counts its target's value per document that has both (one
    co-occurrence, or that fraction of one), plus one if its own text has the token:
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
    counts = (docs.T @ y.astype(np.float32) + label_texts.T).tocsr()  # [V, L]
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


def fit_token_logistic(
    doc_tokens: np.ndarray,
    doc_weights: np.ndarray,
    y: sp.csr_matrix,
    table: np.ndarray,
    k: int,
    *,
    epochs: int,
    max_steps: int | None = None,
    tol: float = 0.0,
    lr: float,
    l2: float,
    batch_size: int,
    seed: int,
    device: torch.device,
) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """The token table's logistic form (service.engine.lexical): weights float32 [V, M] on the
    slots of the first k columns of `table` (the rest 0), a bias float32 [L] per label, and the
    loss of each epoch.

    P(l is a target of x) = sigmoid(sum_t x_t W[t, l] + c_l) is fitted where it is served: on
    each training document's token candidates (the labels of its tokens' first k slots), with
    binary cross-entropy summed over them, averaged over documents, plus l2 * ||W||^2. A
    document's targets outside its candidates cannot be scored by it and are left out. Stops
    after the first epoch whose loss is less than `tol` (relative) below the one before, or is
    not finite (a diverged fit: its last loss says so).
    doc_tokens / doc_weights: padded token ids and their tf-idf weights [N, T], as served.
    """
    if not 1 <= k <= table.shape[1]:
        raise ValueError(f"k must be in [1, {table.shape[1]}], got {k}")
    if y.shape[0] != len(doc_tokens) or doc_tokens.shape != doc_weights.shape:
        raise ValueError(
            f"{len(doc_tokens)} documents of token ids {doc_tokens.shape}, weights {doc_weights.shape}, "
            f"targets for {y.shape[0]}"
        )
    num_labels = y.shape[1]
    slots = table[:, :k]
    generator = torch.Generator().manual_seed(seed)
    theta = torch.zeros(slots.shape, device=device, requires_grad=True)
    bias = torch.zeros(num_labels, device=device, requires_grad=True)
    opt = torch.optim.Adam([theta, bias], lr=lr)
    y = y.tocsr()
    losses: list[float] = []
    if max_steps is not None:  # whole epochs, as many as max_steps steps allow (at least one)
        epochs = min(epochs, max(1, max_steps // max(1, -(-len(doc_tokens) // batch_size))))
    for epoch in range(epochs):
        order = torch.randperm(len(doc_tokens), generator=generator).numpy()
        total = 0.0
        for start in Progress(range(0, len(order), batch_size), f"lexical weights epoch {epoch + 1}/{epochs}"):
            batch = order[start : start + batch_size]
            cand, tokens, x, inverse, target = _candidate_batch(doc_tokens[batch], doc_weights[batch], y[batch], slots)
            if not len(cand):
                continue
            # each (document, token) row of theta times the token's weight, summed into the
            # candidate its label is (slots without a label into one more, dropped)
            terms = F.embedding(torch.from_numpy(tokens).to(device), theta) * torch.from_numpy(x).to(device)
            z = torch.zeros(len(cand) + 1, device=device).index_add(
                0, torch.from_numpy(inverse).to(device), terms.reshape(-1)
            )[:-1]
            z = z + bias[torch.from_numpy(cand).to(device)]
            fit = F.binary_cross_entropy_with_logits(z, torch.from_numpy(target).to(device), reduction="sum")
            loss = fit / len(batch) + l2 * theta.pow(2).sum()
            if not math.isfinite(float(loss.detach())):  # diverged: no more steps on NaN (the caller names why)
                total = float(loss.detach())
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(fit.detach())
        losses.append(total / max(len(order), 1))
        if not math.isfinite(losses[-1]) or (len(losses) > 1 and losses[-2] - losses[-1] < tol * losses[-2]):
            break
    mask = torch.from_numpy(slots >= 0).to(device)
    weights = np.zeros(table.shape, dtype=np.float32)
    weights[:, :k] = (theta.detach() * mask).cpu().numpy()
    return weights, bias.detach().cpu().numpy().astype(np.float32), losses


def _candidate_batch(
    tokens: np.ndarray, token_weights: np.ndarray, y: sp.csr_matrix, slots: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each document's distinct token candidates (flat label ids, document-major); the batch's
    token ids [B, T] and weights [B, T, 1] cut to its longest document; for every slot of
    slots[tokens] [B, T, k] the candidate it sums into (len(candidates) where it holds no
    label); and the candidates' targets (y's values there: 1, or an imputed label's weight; 0
    where y has none)."""
    num_labels = y.shape[1]
    used = np.flatnonzero((tokens > 0).any(axis=0))  # 0 pads
    width = int(used[-1]) + 1 if len(used) else 1
    tokens, token_weights = tokens[:, :width], token_weights[:, :width]
    labels = slots[tokens]  # [B, T, k]
    valid = labels >= 0
    rows = np.broadcast_to(np.arange(len(tokens))[:, None, None], labels.shape)[valid]
    keys = rows.astype(np.int64) * num_labels + labels[valid]
    bound = len(tokens) * num_labels
    uniq, inverse = distinct(keys, bound)
    target_keys = np.repeat(np.arange(y.shape[0], dtype=np.int64), np.diff(y.indptr)) * num_labels + y.indices
    if (y.data != 1).any():  # soft targets (imputed labels' weights); 0/1 by flags, the cheaper way
        target = looked_up(uniq, target_keys, y.data, bound)
    else:
        target = contained(uniq, target_keys, bound).astype(np.float32)
    slot_candidate = np.full(labels.shape, len(uniq), dtype=np.int64)
    slot_candidate[valid] = inverse
    x = np.ascontiguousarray(token_weights[:, :, None], dtype=np.float32)
    return uniq % num_labels, np.ascontiguousarray(tokens, dtype=np.int64), x, slot_candidate.ravel(), target


class TokenTable:
    """Fits the token shortlist (`width` labels per token) and its lexical forms: `tables_`, one
    TokenShortlist per form in `forms` (shares first), all over the same rows; the logistic
    form is fitted on the first `served_k` columns, the ones served."""

    def __init__(self, width: int = 20, forms: tuple[str, ...] = ("shares", "logistic"), served_k: int = 10,
                 epochs: int = 100, lr: float = 0.05, l2: float = 1e-5, batch_size: int = 1024, seed: int = 0,
                 max_steps: int | None = None, tol: float = 0.0) -> None:
        self.width, self.forms, self.served_k, self.max_steps, self.tol = width, forms, served_k, max_steps, tol
        self.epochs, self.lr, self.l2, self.batch_size, self.seed = epochs, lr, l2, batch_size, seed

    @classmethod
    def of(cls, cfg: TrainConfig) -> TokenTable:
        forms = ("shares", "logistic") if cfg.lexical_form == "auto" else (cfg.lexical_form,)
        return cls(cfg.token_shortlist_width, forms, max(cfg.serve_k_tok, 1), cfg.lexical_epochs, cfg.lexical_lr,
                   cfg.lexical_l2, cfg.lexical_batch_size, cfg.seed, cfg.lexical_max_steps, cfg.lexical_tol)

    def fit(self, docs: EncodedTexts, y: sp.csr_matrix, label_texts: EncodedTexts, vocab_size: int,
            device: torch.device) -> TokenTable:
        labels, shares = fit_token_shortlist(docs.ids.numpy(), y, label_texts.ids.numpy(), vocab_size, self.width)
        self.tables_: list[TokenShortlist] = []
        if "shares" in self.forms:
            self.tables_.append(TokenShortlist(labels, shares))
        if "logistic" in self.forms:
            weights, bias, self.losses_ = fit_token_logistic(
                docs.ids.numpy(), docs.weights.numpy(), y, labels, self.served_k, epochs=self.epochs,
                max_steps=self.max_steps, tol=self.tol, lr=self.lr, l2=self.l2, batch_size=self.batch_size,
                seed=self.seed, device=device,
            )
            self.tables_.append(TokenShortlist(labels, weights, "logistic", bias))
        return self


def lexical_files(table: TokenShortlist) -> dict[str, np.ndarray]:
    """The table's bundle files (service.engine.schema): its rows and its lexical form's arrays."""
    out = {TOKEN_SHORTLIST: np.ascontiguousarray(table.labels, dtype=np.int32)}
    if table.weights is not None:
        arrays = zip(LEXICAL_FILES[table.form], (table.weights, table.bias), strict=False)
        out.update({name: np.ascontiguousarray(array, dtype=np.float32) for name, array in arrays})
    return out


def save_table(table: TokenShortlist, directory: Path) -> None:
    """TABLE_FILE: the bundle files' arrays, named "labels" and by their files' stems."""
    files = lexical_files(table)
    np.savez(directory / TABLE_FILE, **{_stem(name): array for name, array in files.items()})


def _stem(name: str) -> str:
    return "labels" if name == TOKEN_SHORTLIST else name.removeprefix("token_shortlist_").removesuffix(".npy")


def load_table(directory: Path, form: str) -> TokenShortlist | None:
    if not (directory / TABLE_FILE).is_file():
        return None
    with np.load(directory / TABLE_FILE) as z:
        arrays = {k: z[k] for k in z.files}
    weights = arrays.get("shares", arrays.get("weights"))
    return TokenShortlist(arrays["labels"], weights, form if weights is not None else "shares", arrays.get("bias"))
