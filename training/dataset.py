"""A dataset prepared for training: the validation split carved from trn, the tokenizer fitted
on the rest and the label texts, every split encoded as the service encodes it, targets as a
sparse matrix and the propensities of the training labels."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from service.engine.metrics import Truths, label_frequencies, propensities
from service.engine.tokenizer import Tokenizer
from training import data as xc_data
from training.config import TrainConfig
from training.encoder import EncodedTexts

log = logging.getLogger("shortlist.training")


@dataclass
class TrainingSet:
    labels: xc_data.LabelSet
    trn: xc_data.Split
    val: xc_data.Split
    tst: xc_data.Split | None
    tokenizer: Tokenizer
    docs: EncodedTexts  # trn
    label_texts: EncodedTexts
    val_texts: EncodedTexts
    tst_texts: EncodedTexts | None
    y: sp.csr_matrix  # trn targets [N, L]
    inv_propensity: np.ndarray  # [L], from trn
    fingerprint: dict[str, Any]

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @classmethod
    def load(cls, data_dir: str | Path, cfg: TrainConfig, text_field: str, rng: np.random.Generator,
             trn: xc_data.Split | None = None) -> TrainingSet:
        """data_dir's splits; `trn` replaces its training documents (labels imputed from groups)."""
        labels = xc_data.load_labels(data_dir, text_field)
        full_trn = trn if trn is not None else xc_data.load_split(data_dir, "trn", text_field, len(labels))
        if len(full_trn) < 2:
            raise ValueError(f"{data_dir}: need at least 2 training documents, found {len(full_trn)}")
        has_tst = xc_data.find_split_file(data_dir, "tst") is not None
        tst = xc_data.load_split(data_dir, "tst", text_field, len(labels)) if has_tst else None
        counts = {"trn": len(full_trn), "tst": len(tst) if tst else 0, "lbl": len(labels)}
        perm = rng.permutation(len(full_trn))
        n_val = min(cfg.val_max_docs, max(1, int(len(full_trn) * cfg.val_fraction)))
        val = full_trn.subset(sorted(perm[:n_val].tolist()))
        trn = full_trn.subset(sorted(perm[n_val:].tolist()))
        log.info("data: %d train, %d validation, %d test documents, %d labels (%s)",
                 len(trn), len(val), len(tst) if tst else 0, len(labels), text_field)
        tokenizer = Tokenizer.fit([*trn.texts, *labels.texts], min_df=cfg.min_df, max_vocab=cfg.max_vocab,
                                  max_tokens=cfg.max_tokens)
        log.info("tokenizer: %d tokens", tokenizer.vocab_size - 1)
        freq = label_frequencies(trn.targets, len(labels))
        return cls(
            labels, trn, val, tst, tokenizer, EncodedTexts.of(tokenizer, trn.texts),
            EncodedTexts.of(tokenizer, labels.texts), EncodedTexts.of(tokenizer, val.texts),
            EncodedTexts.of(tokenizer, tst.texts) if tst else None,
            target_matrix(trn.targets, len(labels), trn.weights),
            1.0 / propensities(freq, len(trn)), xc_data.fingerprint(data_dir, counts),
        )

    def truths(self, split: xc_data.Split) -> Truths:
        return Truths(split.targets, self.inv_propensity)

    def own_labels(self) -> np.ndarray:
        """Per validation document the id of the label with its uid (-1: none)."""
        return xc_data.own_label_ids(self.val.uids, self.labels.uids)

    def validation_rows(self, limit: int) -> list[dict[str, Any]]:
        """Held-out {"text", "target_ind"} rows for the bundle's quality gate."""
        val = self.val
        return [{"text": val.texts[i], "target_ind": val.targets[i]} for i in range(min(limit, len(val)))
                if val.targets[i]]


def target_matrix(targets: list[list[int]], num_labels: int,
                  weights: list[list[float]] | None = None) -> sp.csr_matrix:
    """[documents, labels]: 1 (or the target's weight) at each document's targets."""
    indptr = np.zeros(len(targets) + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(t) for t in targets])
    indices = np.fromiter((x for t in targets for x in t), dtype=np.int64, count=int(indptr[-1]))
    data = (np.ones(len(indices), dtype=np.float32) if weights is None
            else np.fromiter((w for ws in weights for w in ws), dtype=np.float32, count=int(indptr[-1])))
    return sp.csr_matrix((data, indices, indptr), shape=(len(targets), num_labels))
