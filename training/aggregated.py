"""`shortlist train --aggregated`: per-document labels imputed from group labels (training/eagle.py),
then the usual training on them; each further round (aggregated_rounds) imputes again from
models trained on the round before's labels: by default each member's posterior of carrying each
of its group's labels under the probabilities of a model that did not train on its group
(aggregated_reimpute "model", cross-fitted over aggregated_posterior_folds folds of the groups),
or EAGLE's imputation in the embedding space of a model trained on all of them ("encoder")."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

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
from training.pipeline import MemberModel, fit_member_model, train

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
    """Train on a grouped dataset: impute (TF-IDF), re-impute per extra round, train."""
    cfg = replace(config or TrainConfig(), **({} if seed is None else {"seed": int(seed)}))
    cfg.validate()
    labels = xc_data.load_labels(data_dir, text_field)
    grouped = load_grouped(data_dir, text_field, len(labels))
    started = time.monotonic()
    docs_tfidf, labels_tfidf = tfidf_spaces(grouped.texts, labels.texts, cfg)
    imputer = fit_imputer(grouped, docs_tfidf, len(labels), cfg, labels_tfidf)
    split = xc_data.Split(grouped.uids, grouped.texts, imputer.impute(), _weights(imputer, cfg))
    seconds = time.monotonic() - started
    log.info("aggregated: %d documents in %d groups, labels imputed in %.1f s (TF-IDF)",
             len(grouped), len(grouped.group_uids), seconds)
    record = _record_round(None, grouped, seconds, imputer)
    for number in range(2, cfg.aggregated_rounds + 1):
        split, done = reimpute(data_dir, grouped, labels.texts, split, cfg, text_field)
        log.info("aggregated round %d: %d labels imputed in %.1f s (%s) after %.1f s of training", number,
                 sum(map(len, split.targets)), done.imputation_s,
                 "the models' posteriors" if done.imputer is None else "encoder embeddings", done.training_s)
        record["training_s"].append(round(done.training_s, 3))
        record = _record_round(record, grouped, done.imputation_s, done.imputer)
    ckpt = train(data_dir, cfg, text_field, trn=split)
    record["training_s"].append(ckpt.metrics.get("times", {}).get("total_s"))
    ckpt.metrics["aggregated"] = record
    return ckpt


class Reimputed(NamedTuple):
    training_s: float  # training the models on the round before's labels
    imputation_s: float
    imputer: EagleImputer | None  # None: from the models' posteriors


def reimpute(data_dir: str | Path, grouped: GroupedSplit, label_texts: list[str], split: xc_data.Split,
             cfg: TrainConfig, text_field: str) -> tuple[xc_data.Split, Reimputed]:
    """A round's labels, from models trained on the round before's (`split`): by
    cfg.aggregated_reimpute, the members' posteriors under models cross-fitted over the groups
    (posterior_folds), or EAGLE again in the embedding space of one model trained on all of them."""
    started, training_s, imputer = time.monotonic(), 0.0, None
    if cfg.aggregated_reimpute == "model":
        folds = posterior_folds(grouped, cfg.aggregated_posterior_folds, cfg.seed)
        post = sp.csr_matrix((len(grouped), len(label_texts)), dtype=np.float32)
        for fold in range(folds.count):  # one model at a time: each holds [L, D] classifiers
            trained, rows = time.monotonic(), folds.trained_on(fold)
            log.info("aggregated: posterior model %d of %d, trained on %d of %d documents", fold + 1, folds.count,
                     len(rows), len(grouped))
            model = _member_model(data_dir, cfg, text_field, split.subset(rows), f"posterior model {fold + 1} of "
                                  f"{folds.count} (trained on {len(rows)} of {len(grouped)} documents)")
            training_s += time.monotonic() - trained
            post += fold_posteriors(model, grouped, np.flatnonzero(folds.of_group == fold), len(label_texts),
                                    cfg.aggregated_min_posterior)
        targets, weights = as_lists(post)
    else:
        model = fit_member_model(data_dir, cfg, text_field, split)
        training_s = time.monotonic() - started
        with torch.no_grad():
            emb, label_emb = (embed(model.encoder, EncodedTexts.of(model.tokenizer, t), torch.device("cpu"))
                              for t in (grouped.texts, label_texts))
        imputer = fit_imputer(grouped, emb, len(label_texts), cfg, label_emb)
        targets, weights = imputer.impute(), _weights(imputer, cfg)
    return (xc_data.Split(grouped.uids, grouped.texts, targets, weights),
            Reimputed(training_s, time.monotonic() - started - training_s, imputer))


def _member_model(data_dir: str | Path, cfg: TrainConfig, text_field: str, trn: xc_data.Split,
                  which: str) -> MemberModel:
    """fit_member_model, a refusal of its data naming the fold (a fold's model sees part of the data)."""
    try:
        return fit_member_model(data_dir, cfg, text_field, trn)
    except ValueError as e:
        raise ValueError(f"aggregated_posterior_folds {cfg.aggregated_posterior_folds}: {which}: {e}; "
                         f"use fewer folds (1: one model on every group)") from e


@dataclass(frozen=True)
class Folds:
    """Groups in folds; count 1: one fold, whose model trains on every group."""

    of_group: np.ndarray  # int64 [G]
    of_document: np.ndarray  # int64 [N], its group's
    count: int

    def trained_on(self, fold: int) -> list[int]:
        """The documents fold's model trains on: the other folds' (all of them, with one fold)."""
        rows = np.arange(len(self.of_document)) if self.count == 1 else np.flatnonzero(self.of_document != fold)
        return rows.tolist()


def posterior_folds(grouped: GroupedSplit, folds: int, seed: int) -> Folds:
    """Each group in one of `folds` folds at random (given the seed), about as many groups a fold;
    fewer folds than asked when there are fewer groups."""
    count = max(1, min(folds, len(grouped.group_uids)))
    of_group = (np.random.default_rng(seed).permutation(len(grouped.group_uids)) % count).astype(np.int64)
    if count < folds:
        log.warning("aggregated_posterior_folds %d: only %d groups, %d folds", folds, count, count)
    return Folds(of_group, of_group[grouped.group_of], count)


def fold_posteriors(model: MemberModel, grouped: GroupedSplit, groups: np.ndarray, num_labels: int,
                    min_posterior: float) -> sp.csr_matrix:
    """[documents, labels]: each member of `groups` (rows of grouped's groups) with its posterior
    of carrying each of its group's labels (carrier_posteriors) under the model's Module III
    probabilities, those under min_posterior left out (but each pair's likeliest); no other rows."""
    docs = np.flatnonzero(np.isin(grouped.group_of, groups))
    local = np.zeros(len(grouped), np.int64)
    local[docs] = np.arange(len(docs))
    with torch.no_grad():
        emb = embed(model.encoder, EncodedTexts.of(model.tokenizer, [grouped.texts[i] for i in docs]),
                    torch.device("cpu"))
    probability = member_probability(emb, model.classifiers.weights_, model.classifiers.bias_)
    return carrier_posteriors(grouped.members()[groups], grouped.group_labels(num_labels)[groups],
                              lambda d, labels: probability(local[d], labels), min_posterior)


def as_lists(post: sp.csr_matrix) -> tuple[list[list[int]], list[list[float]]]:
    """A [documents, labels] matrix as per-document label ids and weights (a Split's targets and weights)."""
    rows = range(post.shape[0])
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


def _record_round(before: dict | None, grouped: GroupedSplit, imputation_s: float,
                  imputer: EagleImputer | None) -> dict:
    """The checkpoint's metrics["aggregated"] so far: the rounds with each one's imputation
    seconds, the iterations it ran and the keep ratio it used (None: not the relative assignment,
    or no EAGLE imputation: a round from the models' posteriors), and (appended by the caller)
    the seconds of training on each round's labels (the member models' or the final model's)."""
    before = before or {"rounds": 0, "imputation_s": [], "training_s": [], "iterations": [], "keep_ratio": []}
    ratio = imputer.keep_ratio_ if imputer is not None and imputer.assignment == "relative" else None
    return {"groups": len(grouped.group_uids), "documents": len(grouped), "rounds": before["rounds"] + 1,
            "imputation_s": [*before["imputation_s"], imputation_s],
            "iterations": [*before["iterations"], None if imputer is None else imputer.iterations_],
            "keep_ratio": [*before["keep_ratio"], ratio], "training_s": list(before["training_s"])}
