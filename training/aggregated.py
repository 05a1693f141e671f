"""`shortlist train --aggregated`: per-document labels imputed from group labels (training/eagle.py),
then the usual training on them; with aggregated_rounds = 2, imputed again in the trained
encoder's embedding space and trained again."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from service.engine.tokenizer import Tokenizer
from training import data as xc_data
from training.checkpoint import Checkpoint
from training.config import TrainConfig
from training.eagle import EagleImputer
from training.encoder import EncodedTexts, embed
from training.grouped import GroupedSplit, load_grouped
from training.pipeline import train

log = logging.getLogger("shortlist.training")


def tfidf_features(texts: list[str], label_texts: list[str], cfg: TrainConfig) -> sp.csr_matrix:
    """The documents as the tokenizer's L2-normalised TF-IDF rows [N, V], a tokenizer fitted on
    the documents and the label texts (the space the served tokenizer also uses)."""
    tokenizer = Tokenizer.fit([*texts, *label_texts], min_df=cfg.min_df, max_vocab=cfg.max_vocab,
                              max_tokens=cfg.max_tokens)
    ids, weights = tokenizer.encode_batch(texts)
    keep = weights != 0
    indptr = np.r_[0, np.cumsum(keep.sum(axis=1))]
    return sp.csr_matrix((weights[keep], ids[keep], indptr), shape=(len(texts), tokenizer.vocab_size))


def impute(grouped: GroupedSplit, features: sp.csr_matrix | np.ndarray, num_labels: int,
           cfg: TrainConfig) -> list[list[int]]:
    imputer = EagleImputer(cfg.aggregated_iterations, cfg.aggregated_step, cfg.seed, cfg.aggregated_assignment)
    imputer.fit(features, grouped.members(), grouped.group_labels(num_labels))
    return imputer.impute()


def train_aggregated(data_dir: str | Path, config: TrainConfig | None = None, text_field: str = "title",
                     seed: int | None = None) -> Checkpoint:
    """Train on a grouped dataset: impute, train; re-impute with the encoder and retrain per extra round."""
    cfg = replace(config or TrainConfig(), **({} if seed is None else {"seed": int(seed)}))
    cfg.validate()
    labels = xc_data.load_labels(data_dir, text_field)
    grouped = load_grouped(data_dir, text_field, len(labels))
    started = time.monotonic()
    targets = impute(grouped, tfidf_features(grouped.texts, labels.texts, cfg), len(labels), cfg)
    seconds = [time.monotonic() - started]
    log.info("aggregated: %d documents in %d groups, labels imputed in %.1f s (TF-IDF)",
             len(grouped), len(grouped.group_uids), seconds[0])
    ckpt = train(data_dir, cfg, text_field, trn=xc_data.Split(grouped.uids, grouped.texts, targets))
    training_s = [ckpt.metrics.get("times", {}).get("total_s")]
    for round_number in range(2, cfg.aggregated_rounds + 1):
        started = time.monotonic()
        with torch.no_grad():
            emb = embed(ckpt.encoder, EncodedTexts.of(ckpt.tokenizer, grouped.texts), torch.device("cpu"))
        targets = impute(grouped, emb, len(labels), cfg)
        seconds.append(time.monotonic() - started)
        log.info("aggregated round %d: labels imputed in %.1f s (encoder embeddings)", round_number, seconds[-1])
        ckpt = train(data_dir, cfg, text_field, trn=xc_data.Split(grouped.uids, grouped.texts, targets))
        training_s.append(ckpt.metrics.get("times", {}).get("total_s"))
    ckpt.metrics["aggregated"] = {"groups": len(grouped.group_uids), "documents": len(grouped),
                                  "rounds": cfg.aggregated_rounds, "imputation_s": seconds, "training_s": training_s}
    return ckpt
