"""`shortlist train --aggregated`: per-document labels imputed from group labels (training/eagle.py),
then the usual training on them; each further round (aggregated_rounds) imputes again from the
trained model and trains again: by default each member's posterior of carrying each of its
group's labels under the model's probabilities (aggregated_reimpute "model"), or EAGLE's
imputation in the trained encoder's embedding space ("encoder")."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from service.engine.tokenizer import Tokenizer
from training import data as xc_data
from training.checkpoint import Checkpoint
from training.config import TrainConfig
from training.eagle import KEEP_RATIOS, EagleImputer, carrier_posteriors
from training.encoder import EncodedTexts, embed
from training.grouped import GroupedSplit, load_grouped
from training.pipeline import train

log = logging.getLogger("shortlist.training")


def tfidf_features(texts: list[str], label_texts: list[str], cfg: TrainConfig) -> sp.csr_matrix:
    """The documents as the tokenizer's L2-normalised TF-IDF rows [N, V], a tokenizer fitted on
    the documents and the label texts (the space the served tokenizer also uses)."""
    return tfidf_spaces(texts, label_texts, cfg)[0]


def tfidf_spaces(texts: list[str], label_texts: list[str], cfg: TrainConfig) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """(documents [N, V], label texts [L, V]) as TF-IDF rows of one tokenizer fitted on both."""
    tokenizer = Tokenizer.fit([*texts, *label_texts], min_df=cfg.min_df, max_vocab=cfg.max_vocab,
                              max_tokens=cfg.max_tokens, scheme=cfg.token_scheme)
    return _rows(tokenizer, texts), _rows(tokenizer, label_texts)


def _rows(tokenizer: Tokenizer, texts: list[str]) -> sp.csr_matrix:
    ids, weights = tokenizer.encode_batch(texts)
    keep = weights != 0
    indptr = np.r_[0, np.cumsum(keep.sum(axis=1))]
    return sp.csr_matrix((weights[keep], ids[keep], indptr), shape=(len(texts), tokenizer.vocab_size))


def impute(grouped: GroupedSplit, features: sp.csr_matrix | np.ndarray, num_labels: int, cfg: TrainConfig,
           label_features: sp.csr_matrix | np.ndarray | None = None) -> list[list[int]]:
    """Per-document labels; label_features (the label texts in the documents' space) join as
    groups of one when cfg.aggregated_label_texts."""
    return fit_imputer(grouped, features, num_labels, cfg, label_features).impute()


def fit_imputer(grouped: GroupedSplit, features: sp.csr_matrix | np.ndarray, num_labels: int, cfg: TrainConfig,
                label_features: sp.csr_matrix | np.ndarray | None = None) -> EagleImputer:
    imputer = EagleImputer(cfg.aggregated_iterations, cfg.aggregated_step, cfg.seed, cfg.aggregated_assignment,
                           cfg.aggregated_center, cfg.aggregated_validation, cfg.aggregated_keep_ratio,
                           cfg.aggregated_min_val_groups)
    imputer.fit(features, grouped.members(), grouped.group_labels(num_labels),
                label_features if cfg.aggregated_label_texts else None)
    if (skipped := imputer.choice_skipped_) is not None:
        log.warning("%s: aggregated_validation %s holds out %d of its %d groups with a label, fewer than "
                    "aggregated_min_val_groups (%d): nothing chosen on them, %d iterations and keep ratio %s "
                    "(each group label to its closest member where none is given: the paper's method)",
                    grouped.groups_file, cfg.aggregated_validation, skipped.held, skipped.labelled, skipped.needed,
                    imputer.iterations_, imputer.keep_ratio_)
    if imputer.validation_scores_:
        log.info("aggregated: %d iterations chosen on held-out groups (group P@1 by iterations: %s)",
                 imputer.iterations_, " ".join(f"{100 * p:.1f}" for p in imputer.validation_scores_))
    if imputer.keep_ratio_scores_:
        log.info("aggregated: keep ratio %.1f chosen on held-out groups (their labels' R-precision by ratio "
                 "%s: %s)", imputer.keep_ratio_, " ".join(map(str, KEEP_RATIOS)),
                 " ".join(f"{100 * x:.2f}" for x in imputer.keep_ratio_scores_))
    return imputer


def train_aggregated(data_dir: str | Path, config: TrainConfig | None = None, text_field: str = "title",
                     seed: int | None = None) -> Checkpoint:
    """Train on a grouped dataset: impute, train; re-impute with the encoder and retrain per extra round."""
    cfg = replace(config or TrainConfig(), **({} if seed is None else {"seed": int(seed)}))
    cfg.validate()
    labels = xc_data.load_labels(data_dir, text_field)
    grouped = load_grouped(data_dir, text_field, len(labels))
    started = time.monotonic()
    docs_tfidf, labels_tfidf = tfidf_spaces(grouped.texts, labels.texts, cfg)
    imputer = fit_imputer(grouped, docs_tfidf, len(labels), cfg, labels_tfidf)
    targets, weights = imputer.impute(), _weights(imputer, cfg)
    seconds = time.monotonic() - started
    log.info("aggregated: %d documents in %d groups, labels imputed in %.1f s (TF-IDF)",
             len(grouped), len(grouped.group_uids), seconds)
    ckpt = train(data_dir, cfg, text_field, trn=xc_data.Split(grouped.uids, grouped.texts, targets, weights))
    _record_round(ckpt, grouped, seconds, imputer, None)
    for _ in range(2, cfg.aggregated_rounds + 1):
        ckpt = next_round(data_dir, ckpt, cfg, text_field)
    return ckpt


def next_round(data_dir: str | Path, ckpt: Checkpoint, config: TrainConfig, text_field: str = "title") -> Checkpoint:
    """One more round on a grouped dataset after `ckpt` (trained on it): labels imputed again from
    ckpt (config.aggregated_reimpute: its probabilities, or EAGLE in its encoder space), then
    trained again."""
    labels = xc_data.load_labels(data_dir, text_field)
    grouped = load_grouped(data_dir, text_field, len(labels))
    started = time.monotonic()
    imputer = None
    if config.aggregated_reimpute == "model":
        targets, weights = model_posteriors(ckpt, grouped, len(labels), config.aggregated_min_posterior)
    else:
        with torch.no_grad():
            emb, label_emb = (embed(ckpt.encoder, EncodedTexts.of(ckpt.tokenizer, t), torch.device("cpu"))
                              for t in (grouped.texts, labels.texts))
        imputer = fit_imputer(grouped, emb, len(labels), config, label_emb)
        targets, weights = imputer.impute(), _weights(imputer, config)
    seconds = time.monotonic() - started
    rounds = ckpt.metrics.get("aggregated", {})
    log.info("aggregated round %d: %d labels imputed in %.1f s (%s)", rounds.get("rounds", 1) + 1,
             sum(map(len, targets)), seconds, "the model's posteriors" if imputer is None else "encoder embeddings")
    new = train(data_dir, config, text_field, trn=xc_data.Split(grouped.uids, grouped.texts, targets, weights))
    _record_round(new, grouped, seconds, imputer, rounds)
    return new


def model_posteriors(ckpt: Checkpoint, grouped: GroupedSplit, num_labels: int,
                     min_posterior: float) -> tuple[list[list[int]], list[list[float]]]:
    """Per document, its group's labels and its posterior of carrying each (carrier_posteriors)
    under ckpt's Module III probabilities, those under min_posterior left out (but each pair's likeliest)."""
    with torch.no_grad():
        emb = embed(ckpt.encoder, EncodedTexts.of(ckpt.tokenizer, grouped.texts), torch.device("cpu"))
    post = carrier_posteriors(grouped.members(), grouped.group_labels(num_labels),
                              member_probability(emb, ckpt.classifiers.weights_, ckpt.classifiers.bias_),
                              min_posterior)
    rows = range(len(grouped))
    return ([post.indices[post.indptr[i] : post.indptr[i + 1]].tolist() for i in rows],
            [post.data[post.indptr[i] : post.indptr[i + 1]].tolist() for i in rows])


def member_probability(emb: np.ndarray, weights: np.ndarray, bias: np.ndarray,
                       chunk: int = 1 << 16) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """(documents, labels) -> sigmoid(w_l . E(x) + b_l) per pair: Module III's probability that a
    document carries a label (its binary cross-entropy's), from the documents' embeddings."""
    def probability(docs: np.ndarray, labels: np.ndarray) -> np.ndarray:
        out = np.empty(len(docs), np.float64)
        for s in range(0, len(docs), chunk):
            d, lab = docs[s : s + chunk], labels[s : s + chunk]
            out[s : s + chunk] = np.einsum("ij,ij->i", emb[d], weights[lab], dtype=np.float64) + bias[lab]
        return 1.0 / (1.0 + np.exp(-out))
    return probability


def _weights(imputer: EagleImputer, cfg: TrainConfig) -> list[list[float]] | None:
    """The imputed labels' weights when cfg.aggregated_soft_labels (None: every label 1)."""
    return imputer.impute_weights() if cfg.aggregated_soft_labels else None


def _record_round(ckpt: Checkpoint, grouped: GroupedSplit, imputation_s: float, imputer: EagleImputer | None,
                  before: dict | None) -> None:
    """ckpt.metrics["aggregated"]: the rounds so far with each one's imputation and training seconds,
    the iterations it ran and the keep ratio it used (None: not the relative assignment, or no
    EAGLE imputation: a round from the model's posteriors)."""
    before = before or {"rounds": 0, "imputation_s": [], "training_s": [], "iterations": []}
    ratio = imputer.keep_ratio_ if imputer is not None and imputer.assignment == "relative" else None
    ckpt.metrics["aggregated"] = {
        "groups": len(grouped.group_uids), "documents": len(grouped), "rounds": before["rounds"] + 1,
        "imputation_s": [*before["imputation_s"], imputation_s],
        "iterations": [*before.get("iterations", []), None if imputer is None else imputer.iterations_],
        "keep_ratio": [*before.get("keep_ratio", []), ratio],
        "training_s": [*before["training_s"], ckpt.metrics.get("times", {}).get("total_s")]}
