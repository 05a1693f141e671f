"""Module III: per-label 1-vs-all classifiers.

"paper": w_l = normalise(E(z_l) + eta_l), positives + shortlisted negatives, SiameseXML's
likelihood (c=0.75, d=3.0). "scaled_bias": w_l = E(z_l) + eta_l left unnormalised (its length
is the label's scale) plus a bias b_l, binary cross-entropy against all labels (or the
shortlist for large L): a classifier can learn its label's prior, which the heavy head needs.
Optionally the encoder is fine-tuned with them (debian-deps validation P@1 53 -> 60).

On shortlists, each document's negatives are its Module II shortlist (hard negatives) and the
other documents' positives in its batch (`batch_negatives`, shared columns). Without the
latter a classifier only ever meets documents close to its own: nothing holds its score down
on the rest, and over all labels the classifiers ranked badly (10^4 generated labels,
validation P@1 of the classifiers alone: all negatives 88.0, shortlist 56.2, shortlist + the
batch's positives 89.0; 10^5: test P@1 3.39 with the shortlist alone). The batch's positives
are drawn by label frequency, so the head labels, whose large priors cost the most precision
elsewhere, meet the most negatives: the negatives of in-batch training (Module I's too).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from training.config import TrainConfig
from training.encoder import EncodedTexts, SiameseEncoder, encoder_optimizer, siamese_nll
from training.epochs import run_epoch

WEIGHTS_FILE, BIAS_FILE = "classifiers.npy", "classifier_bias.npy"
log = logging.getLogger("shortlist.training")
# (weights [L, D], bias [L]) -> the validation objective of those classifiers (higher is better).
Validation = Callable[[np.ndarray, np.ndarray], float]


class _Classifiers(torch.nn.Module):
    """w_l = base_l + eta_l (paper: normalised) and b_l (trained for scaled_bias only)."""

    def __init__(self, base: np.ndarray, form: str, prior_logit: np.ndarray | None) -> None:
        super().__init__()
        self.form = form
        self.register_buffer("base", torch.from_numpy(base.astype(np.float32)))
        self.eta = torch.nn.Parameter(torch.zeros_like(self.base))
        bias = np.zeros(len(base), dtype=np.float32) if prior_logit is None else prior_logit.astype(np.float32)
        self.bias = torch.nn.Parameter(torch.from_numpy(bias), requires_grad=form == "scaled_bias")

    def weight(self) -> torch.Tensor:
        w = self.base + self.eta
        return F.normalize(w, dim=-1) if self.form == "paper" else w


class _RowAdam:
    """Adam on the rows of eta and the bias that a step uses, the others untouched (lazy Adam, the
    rule of torch's SparseAdam, without its sparse-tensor bookkeeping). Weight decay is L2 on the
    rows used.

    `rows(labels)` gives leaf tensors of the batch's distinct rows for the loss; `step()` moves
    them by their gradients after backward."""

    def __init__(self, clf: _Classifiers, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        self.clf, self.lr, self.weight_decay, self.betas, self.eps = clf, lr, weight_decay, betas, eps
        self.train_bias = clf.bias.requires_grad
        self.moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in (clf.eta, clf.bias)]
        self.t = 0
        self._used: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def rows(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w [*labels.shape, D] and b [*labels.shape] of label ids `labels`, differentiable
        through the batch's distinct rows."""
        used, inverse = torch.unique(labels, return_inverse=True)
        eta = self.clf.eta.detach().index_select(0, used).requires_grad_()
        bias = self.clf.bias.detach().index_select(0, used).requires_grad_(self.train_bias)
        self._used = (used, eta, bias)
        w = self.clf.base.index_select(0, used) + eta
        if self.clf.form == "paper":
            w = F.normalize(w, dim=-1)
        return w[inverse], bias[inverse]

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # the leaves are made fresh by each rows() call

    def step(self) -> None:
        assert self._used is not None
        used, eta, bias = self._used
        self._used = None
        (b1, b2), self.t = self.betas, self.t + 1
        size = self.lr * (1 - b2**self.t) ** 0.5 / (1 - b1**self.t)
        pairs = [(self.clf.eta, eta, self.moments[0])]
        if self.train_bias:
            pairs.append((self.clf.bias, bias, self.moments[1]))
        with torch.no_grad():
            for table, leaf, (m_all, v_all) in pairs:
                grad = leaf.grad if not self.weight_decay else leaf.grad.add(leaf.detach(), alpha=self.weight_decay)
                m = m_all.index_select(0, used).mul_(b1).add_(grad, alpha=1 - b1)
                v = v_all.index_select(0, used).mul_(b2).addcmul_(grad, grad, value=1 - b2)
                m_all.index_copy_(0, used, m)
                v_all.index_copy_(0, used, v)
                table.index_copy_(0, used, leaf.detach().addcdiv_(m, v.sqrt_().add_(self.eps), value=-size))


class OneVsAll:
    """Fits `weights_` [L, D] and `bias_` [L] (Module III); `losses_` per epoch."""

    def __init__(self, form: str = "scaled_bias", negatives: str = "all", epochs: int = 8, batch_size: int = 256,
                 lr: float = 0.02, c: float = 0.75, d: float = 3.0, train_encoder: bool = True,
                 encoder_lr: float = 0.005, weight_decay: float = 1e-5, softmax_weight: float = 0.0,
                 progress: bool = True, lazy: bool = False, batch_negatives: bool = True,
                 max_steps: int | None = None, min_gain: float = 0.0) -> None:
        self.batch_negatives, self.max_steps, self.min_gain = batch_negatives, max_steps, min_gain
        self.form, self.negatives, self.epochs, self.batch_size, self.lr = form, negatives, epochs, batch_size, lr
        self.c, self.d, self.train_encoder, self.encoder_lr = c, d, train_encoder, encoder_lr
        self.weight_decay, self.softmax_weight, self.progress = weight_decay, softmax_weight, progress
        self.lazy = lazy  # the encoder's token embedding by SparseAdam (encoder_optimizer)

    @classmethod
    def of(cls, cfg: TrainConfig, num_labels: int) -> OneVsAll:
        return cls(cfg.classifier_form, cfg.module3_negatives(num_labels), cfg.m3_epochs, cfg.m3_batch_size,
                   cfg.m3_lr, cfg.m3_c, cfg.m3_d, cfg.m3_train_encoder, cfg.m3_encoder_lr, cfg.m3_weight_decay,
                   cfg.m3_softmax_weight, cfg.progress, cfg.lazy_embedding, cfg.m3_batch_negatives, cfg.m3_max_steps,
                   cfg.m3_min_gain)

    def fit(self, encoder: SiameseEncoder, label_emb: np.ndarray, docs: EncodedTexts, y: sp.csr_matrix,
            shortlist: np.ndarray | None, device: torch.device, rng: np.random.Generator,
            validation: Validation | None = None) -> OneVsAll:
        """Classifiers starting from the label embeddings E(z_l) (and, for scaled_bias, each
        label's prior log-odds as its bias); `shortlist` [N, K]: each document's negatives when
        negatives is "shortlist". With `validation`, training stops after the first epoch that
        raises it by less than min_gain (`validation_`: its value after each epoch)."""
        prior = None
        if self.form == "scaled_bias":
            # documents per label, a soft (imputed) label counting by its weight
            freq = np.bincount(y.indices, weights=y.data, minlength=y.shape[1])
            p = np.clip(freq / y.shape[0], 1e-6, 1 - 1e-6)
            prior = np.log(p / (1 - p))
        clf = _Classifiers(label_emb, self.form, prior).to(device)
        # Shortlisted negatives touch a batch's rows only: Adam steps those (_RowAdam); all
        # negatives touch every row.
        rows: _RowAdam | None = None
        opts: list = []
        if self.negatives == "shortlist":
            rows = _RowAdam(clf, self.lr, self.weight_decay)
            opts.append(rows)
        else:  # fused: one pass over the [L, D] moments a step instead of ~10 (debian-deps: 331 -> 51 ms)
            opts.append(torch.optim.Adam([p for p in clf.parameters() if p.requires_grad], lr=self.lr,
                                         weight_decay=self.weight_decay, fused=True))
        encoder.requires_grad_(self.train_encoder)
        if self.train_encoder:
            opts += encoder_optimizer(encoder, self.encoder_lr, self.lazy)
        trainable = np.flatnonzero(np.diff(y.indptr) > 0)
        epochs = self.epochs
        if self.max_steps is not None:  # whole epochs, as many as max_steps steps allow (at least one)
            epochs = min(epochs, max(1, self.max_steps // max(1, -(-len(trainable) // self.batch_size))))
        self.losses_: list[float] = []
        self.validation_: list[float] = []
        encoder.train(self.train_encoder)
        for epoch in range(epochs):
            order = rng.permutation(trainable)
            self.losses_.append(run_epoch(
                order, self.batch_size, lambda batch: self._loss(encoder, clf, rows, docs, y, batch, shortlist, device),
                opts, f"Module III epoch {epoch + 1}/{epochs}", self.progress))
            if not math.isfinite(self.losses_[-1]):
                break  # diverged: the pipeline's stage check names the setting
            # Only an epoch before the last can stop, and only once one before it was scored: none
            # is scored in a training of 2 epochs (10^6 labels: an exact pass over all labels saved).
            if validation is not None and epoch + 1 < epochs and epochs > 2 and self._plateaued(validation, clf):
                log.info("Module III: validation objective %s by epoch; stopped after epoch %d (gain < %g)",
                         [round(v, 2) for v in self.validation_], epoch + 1, self.min_gain)
                break
        encoder.requires_grad_(True)
        encoder.sparse_grad = False
        encoder.eval()
        self.weights_, self.bias_ = _arrays(clf)
        return self

    def _plateaued(self, validation: Validation, clf: _Classifiers) -> bool:
        """Scores this epoch's classifiers on validation; did the epoch gain less than min_gain?"""
        self.validation_.append(float(validation(*_arrays(clf))))
        return len(self.validation_) > 1 and self.validation_[-1] - self.validation_[-2] < self.min_gain

    def _loss(self, encoder: SiameseEncoder, clf: _Classifiers, rows: _RowAdam | None, docs: EncodedTexts,
              y: sp.csr_matrix, batch: np.ndarray, shortlist: np.ndarray | None, device: torch.device) -> torch.Tensor:
        ids, w = docs.rows(batch, device)
        with torch.set_grad_enabled(self.train_encoder):
            q = encoder(ids, w)
        yb = y[batch]
        valid = None
        if rows is None:
            logits = torch.addmm(clf.bias, q, clf.weight().T)
            if self.form == "scaled_bias" and not self.softmax_weight:
                return _all_labels_bce(logits, yb, device)
            target = torch.from_numpy(yb.toarray()).to(device)
        else:
            logits, target, valid = self._shortlist_logits(q, rows, yb, shortlist[batch], device)
        if self.form == "paper":
            pos_t = siamese_nll(logits, self.c, self.d, positive=True)
            per = target * pos_t + (1 - target) * siamese_nll(logits, self.c, self.d, positive=False)
        else:
            per = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        if valid is not None:
            per = per * valid
        loss = per.sum(dim=1).mean()
        if self.softmax_weight > 0 and self.negatives == "all":
            npos = target.sum(dim=1).clamp(min=1.0)
            ce = -(target * F.log_softmax(logits, dim=1)).sum(dim=1) / npos
            loss = loss + self.softmax_weight * ce.mean()
        return loss

    def _shortlist_logits(self, q: torch.Tensor, rows: _RowAdam, yb: sp.csr_matrix, negatives: np.ndarray,
                          device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits, targets and weights [B, W (+ U)] of each document's positives and shortlisted
        negatives (and, with batch_negatives, of the U distinct positives of the batch, shared)."""
        cols, tgt = _positives_and_negatives(yb, negatives)
        cols_t = torch.from_numpy(cols).to(device)
        valid, safe = (cols_t >= 0).float(), cols_t.clamp(min=0)
        target = torch.from_numpy(tgt).to(device)
        if not self.batch_negatives:
            w, b = rows.rows(safe)
            return torch.einsum("bd,bkd->bk", q, w) + b, target, valid
        union = np.unique(yb.indices)
        w, b = rows.rows(torch.cat([safe.flatten(), torch.from_numpy(union).to(device)]))
        n = safe.numel()
        own = torch.einsum("bd,bkd->bk", q, w[:n].view(*safe.shape, -1)) + b[:n].view(safe.shape)
        shared_target = torch.from_numpy(yb[:, union].toarray()).to(device)
        # A document's own positives among the shared columns are already counted in its own.
        return (torch.cat([own, q @ w[n:].T + b[n:]], dim=1), torch.cat([target, shared_target], dim=1),
                torch.cat([valid, (shared_target == 0).float()], dim=1))

    def save(self, directory: Path) -> None:
        np.save(directory / WEIGHTS_FILE, np.ascontiguousarray(self.weights_, dtype=np.float32))
        np.save(directory / BIAS_FILE, np.ascontiguousarray(self.bias_, dtype=np.float32))

    @classmethod
    def load(cls, directory: Path) -> OneVsAll:
        out = cls()
        out.weights_, out.bias_ = np.load(directory / WEIGHTS_FILE), np.load(directory / BIAS_FILE)
        return out


def _all_labels_bce(logits: torch.Tensor, yb: sp.csr_matrix, device: torch.device) -> torch.Tensor:
    """Binary cross-entropy summed over every label, averaged over the batch's documents, as
    softplus(z) summed less the positives' z: the same loss as F.binary_cross_entropy_with_logits
    on a dense target without building the target, in fewer passes over the [B, L] logits (a
    positive's target is its weight, yb's value: 1 unless the labels were imputed soft)."""
    rows = torch.from_numpy(np.repeat(np.arange(yb.shape[0]), np.diff(yb.indptr))).to(device)
    cols = torch.from_numpy(yb.indices.astype(np.int64)).to(device)
    positives = logits[rows, cols]
    if not np.all(yb.data == 1):
        positives = positives * torch.from_numpy(yb.data.astype(np.float32)).to(device)
    return (F.softplus(logits).sum() - positives.sum()) / yb.shape[0]


def _arrays(clf: _Classifiers) -> tuple[np.ndarray, np.ndarray]:
    """The classifiers' weights [L, D] and bias [L] as float32 arrays."""
    with torch.no_grad():
        return clf.weight().float().cpu().numpy(), clf.bias.detach().float().cpu().numpy()


def _positives_and_negatives(yb: sp.csr_matrix, negatives: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per document its positives then its shortlisted negatives that are not positives: label
    columns [B, W] (-1 where empty) and targets [B, W]: a positive's weight (yb's value), 0 elsewhere."""
    counts = np.diff(yb.indptr)
    rows = np.repeat(np.arange(yb.shape[0]), counts)
    pos = np.full((yb.shape[0], max(int(counts.max(initial=0)), 1)), -1, dtype=np.int64)
    pos[rows, np.arange(len(rows)) - np.repeat(yb.indptr[:-1], counts)] = yb.indices
    # A shortlisted label that is a positive of its document is dropped: keys doc * L + label.
    keys = np.sort(rows.astype(np.int64) * yb.shape[1] + yb.indices)
    neg = negatives.astype(np.int64)
    neg_keys = np.arange(len(neg), dtype=np.int64)[:, None] * yb.shape[1] + neg
    hit = keys[np.minimum(np.searchsorted(keys, neg_keys), len(keys) - 1)] == neg_keys if len(keys) else False
    cols = np.concatenate([pos, np.where((neg < 0) | hit, -1, neg)], axis=1)
    tgt = np.zeros(cols.shape, dtype=np.float32)
    tgt[rows, np.arange(len(rows)) - np.repeat(yb.indptr[:-1], counts)] = yb.data
    return cols, tgt
