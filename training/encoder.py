"""The bag-of-words Siamese encoder E(x) in torch (DESIGN.md, "Encoder"), texts encoded for it,
and the SiameseXML likelihood its training uses.

Written over padded ids/weights [B, T] (Gather, Mul, ReduceSum) rather than
nn.EmbeddingBag: it exports to ONNX without a Loop node and runs faster at batch 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from service.engine.tokenizer import Tokenizer

NORM_EPS = 1e-12


class SiameseEncoder(nn.Module):
    """tokens -> TF-IDF weighted sum of embeddings -> ReLU -> L2 -> v + ReLU(R v) -> L2."""

    def __init__(self, vocab_size: int, dim: int = 256, seed: int | None = None) -> None:
        super().__init__()
        self.vocab_size = int(vocab_size)
        self.dim = int(dim)
        # Row gradients of the token embedding as a sparse tensor (the rows a batch uses), for a
        # lazy optimizer (encoder_optimizer): a dense Adam step touches all V x D values.
        self.sparse_grad = False
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        emb = torch.randn(self.vocab_size, self.dim, generator=gen) / self.dim**0.5
        emb[0] = 0.0  # padding row
        self.embedding = nn.Parameter(emb)
        # R starts at zero so the residual block is the identity until training moves it.
        self.residual = nn.Linear(self.dim, self.dim, bias=False)
        nn.init.zeros_(self.residual.weight)

    def forward(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        bag = (F.embedding(ids, self.embedding, sparse=self.sparse_grad) * weights.unsqueeze(-1)).sum(dim=1)
        v = _unit(F.relu(bag))
        v = v + F.relu(self.residual(v))
        return _unit(v)


def encoder_optimizer(encoder: SiameseEncoder, lr: float, lazy: bool) -> list[torch.optim.Optimizer]:
    """Adam over the encoder; with `lazy`, the token embedding is updated only in the rows a
    batch uses (SparseAdam: each step costs the batch's tokens, not V x D; a row's moments
    advance only when it is used) and the residual block by Adam."""
    encoder.sparse_grad = lazy
    if not lazy:
        return [torch.optim.Adam(encoder.parameters(), lr=lr)]
    dense = [p for name, p in encoder.named_parameters() if name != "embedding"]
    return [torch.optim.SparseAdam([encoder.embedding], lr=lr), torch.optim.Adam(dense, lr=lr)]


def _unit(v: torch.Tensor) -> torch.Tensor:
    """v / max(||v||, eps): F.normalize's arithmetic, but broadcast instead of expand_as, so
    the ONNX graph has no Shape + Expand per normalisation (4 of its 22 nodes; ~1 us each per
    single-query run)."""
    return v / v.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)


@dataclass
class EncodedTexts:
    """Texts as the tokenizer encodes them for serving: padded ids [N, T] and weights [N, T]."""

    ids: torch.Tensor  # int64
    weights: torch.Tensor  # float32

    @classmethod
    def of(cls, tokenizer: Tokenizer, texts: list[str]) -> EncodedTexts:
        ids, w = tokenizer.encode_batch(texts)
        return cls(torch.from_numpy(ids), torch.from_numpy(w))

    def __len__(self) -> int:
        return len(self.ids)

    def rows(self, idx: torch.Tensor | np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        ids, w = self.ids[idx_t], self.weights[idx_t]
        # Trim the padding columns no row of this batch uses.
        width = max(1, int((w != 0).sum(dim=1).max().item())) if len(idx_t) else 1
        return ids[:, :width].to(device), w[:, :width].to(device)


@torch.no_grad()
def embed(encoder: SiameseEncoder, texts: EncodedTexts, device: torch.device, batch_size: int = 4096) -> np.ndarray:
    """E(x) for every row, float32 [N, D]."""
    was_training = encoder.training
    encoder.eval()
    out = np.zeros((len(texts), encoder.dim), dtype=np.float32)
    for start in range(0, len(texts), batch_size):
        idx = np.arange(start, min(start + batch_size, len(texts)))
        out[idx] = encoder(*texts.rows(idx, device)).float().cpu().numpy()
    encoder.train(was_training)
    return out


def siamese_nll(sims: torch.Tensor, c: float, d: float, positive: bool) -> torch.Tensor:
    """-log p(y|v) with p(+|v) = c exp(d (v - 1)): the SiameseXML likelihood (Modules I, III)."""
    if positive:
        return -(math.log(c) + d * (sims - 1.0))
    p = c * torch.exp(d * (sims - 1.0))
    return -torch.log1p(-p.clamp(max=1.0 - 1e-6))
