"""Module I: Siamese training of the encoder E on documents against their labels' texts.

The SiameseXML likelihood p(+|v) = c exp(d (v - 1)) on cosine similarities, one positive label
per document per step (drawn by the labels' weights: PositiveDraw), hard negatives from the batch
(the most similar labels of other documents) and, every `refresh_every` epochs, from an HNSW
index over the label embeddings.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.sparse as sp
import torch

from training.ann import AnnParams
from training.config import TrainConfig
from training.encoder import EncodedTexts, SiameseEncoder, embed, encoder_optimizer, siamese_nll
from training.epochs import run_epoch


class SiameseTrainer:
    """Fits a SiameseEncoder (Module I); `losses_` holds each epoch's mean loss."""

    def __init__(self, epochs: int = 2, batch_size: int = 256, lr: float = 0.01, c: float = 0.9, d: float = 1.5,
                 inbatch_negatives: int = 10, refresh_every: int = 2, ann_negatives: int = 20,
                 ann: AnnParams | None = None, seed: int = 0, progress: bool = True, lazy: bool = False) -> None:
        self.epochs, self.batch_size, self.lr, self.c, self.d = epochs, batch_size, lr, c, d
        self.inbatch_negatives, self.refresh_every, self.ann_negatives = inbatch_negatives, refresh_every, ann_negatives
        self.ann = ann or AnnParams(16, 100, 100, 1)
        self.seed, self.progress, self.lazy = seed, progress, lazy

    @classmethod
    def of(cls, cfg: TrainConfig, ann: AnnParams) -> SiameseTrainer:
        return cls(cfg.m1_epochs, cfg.m1_batch_size, cfg.m1_lr, cfg.m1_c, cfg.m1_d, cfg.m1_inbatch_negatives,
                   cfg.m1_refresh_every, cfg.m1_ann_negatives, ann, cfg.seed, cfg.progress, cfg.lazy_embedding)

    def fit(self, encoder: SiameseEncoder, docs: EncodedTexts, labels: EncodedTexts, y: sp.csr_matrix,
            device: torch.device, rng: np.random.Generator) -> SiameseTrainer:
        opts = encoder_optimizer(encoder, self.lr, self.lazy)
        trainable = np.flatnonzero(np.diff(y.indptr) > 0)
        ann_neg: np.ndarray | None = None
        positives = PositiveDraw(y)
        self.losses_: list[float] = []
        encoder.train()
        for epoch in range(self.epochs):
            if self.refresh_every and epoch > 0 and epoch % self.refresh_every == 0 and self.ann_negatives > 0:
                ann_neg = self._ann_negatives(encoder, docs, labels, y, device, epoch)
            order = rng.permutation(trainable)
            self.losses_.append(run_epoch(
                order, self.batch_size,
                lambda batch, negs=ann_neg: self._loss(encoder, docs, labels, positives, batch, negs, device, rng),
                opts, f"Module I epoch {epoch + 1}/{self.epochs}", self.progress))
            if not math.isfinite(self.losses_[-1]):
                break  # diverged: the pipeline's stage check names the setting
        encoder.sparse_grad = False
        encoder.eval()
        return self

    def _ann_negatives(self, encoder: SiameseEncoder, docs: EncodedTexts, labels: EncodedTexts, y: sp.csr_matrix,
                       device: torch.device, epoch: int) -> np.ndarray:
        """Each document's nearest labels by the current encoder, its positives replaced by -1."""
        index = self.ann.build(embed(encoder, labels, device), self.seed + epoch)
        cand = self.ann.nearest(index, embed(encoder, docs, device), self.ann_negatives + 10)
        return negatives_excluding(cand, y)

    def _loss(self, encoder: SiameseEncoder, docs: EncodedTexts, labels: EncodedTexts, positives: PositiveDraw,
              batch: np.ndarray, ann_neg: np.ndarray | None, device: torch.device,
              rng: np.random.Generator) -> torch.Tensor:
        y = positives.y
        label_rows = [positives(batch, rng)]
        if ann_neg is not None:
            cand = ann_neg[batch]
            pick = cand[np.arange(len(batch)), rng.integers(0, cand.shape[1], size=len(batch))]
            label_rows.append(pick[pick >= 0])
        label_batch = np.concatenate(label_rows)
        q = encoder(*docs.rows(batch, device))
        z = encoder(*labels.rows(label_batch, device))
        sims = q @ z.T  # [B, B + B']
        is_pos = torch.from_numpy(y[batch][:, label_batch].toarray() > 0).to(device)
        diag = torch.arange(len(batch), device=device)
        pos_loss = siamese_nll(sims[diag, diag], self.c, self.d, positive=True)
        neg_sims = sims.masked_fill(is_pos, -2.0)
        hard = neg_sims.topk(min(self.inbatch_negatives, neg_sims.shape[1]), dim=1).values
        neg_loss = (siamese_nll(hard, self.c, self.d, positive=False) * (hard > -2.0)).sum(dim=1)
        return (pos_loss + neg_loss).mean()


class PositiveDraw:
    """Draws one label id per document with probability proportional to its weight (y's value).

    A label imputed from a group's labels weighs how sure the imputation is (about 1/4 when it is
    spread over four members): drawn uniformly, it was trained as a sure positive of every member.
    With every weight 1 this is the uniform draw: the same ids from the same generator."""

    def __init__(self, y: sp.csr_matrix) -> None:
        self.y = y
        uniform = bool(np.all(y.data == 1))
        self.cumulative = None if uniform else np.concatenate([[0.0], np.cumsum(y.data, dtype=np.float64)])

    def __call__(self, rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        y = self.y
        starts, ends = y.indptr[rows], y.indptr[rows + 1]
        u = rng.random(len(rows))
        if self.cumulative is None:
            return y.indices[starts + (u * (ends - starts)).astype(np.int64)]
        cum = self.cumulative
        picked = np.searchsorted(cum, cum[starts] + u * (cum[ends] - cum[starts]), side="right") - 1
        return y.indices[np.clip(picked, starts, ends - 1)]


def negatives_excluding(candidates: np.ndarray, y: sp.csr_matrix, rows: np.ndarray | None = None) -> np.ndarray:
    """candidates [N, K] with each row's positives replaced by -1."""
    out = candidates.copy()
    for i in range(len(out)):
        r = i if rows is None else rows[i]
        pos = y.indices[y.indptr[r] : y.indptr[r + 1]]
        if len(pos):
            out[i, np.isin(out[i], pos)] = -1
    return out
