"""A dataset prepared for training: the validation split carved from trn, the tokenizer fitted
on the rest and the label texts, every split encoded as the service encodes it, targets as a
sparse matrix and the propensities of the training labels."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import scipy.sparse as sp

from service.engine.metrics import Truths, label_frequencies, propensities
from service.engine.tokenizer import Tokenizer, is_blank
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
    # Data that is allowed but small (small_train_docs, small_val_docs): logged, and kept in the
    # checkpoint's metrics as "data_warnings".
    warnings: list[str]

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @classmethod
    def load(cls, data_dir: str | Path, cfg: TrainConfig, text_field: str, rng: np.random.Generator,
             trn: xc_data.Split | None = None) -> TrainingSet:
        """data_dir's splits; `trn` replaces its training documents (labels imputed from groups)."""
        labels = xc_data.load_labels(data_dir, text_field)
        source = f"{data_dir} (labels imputed from groups)" if trn is not None else xc_data.find_split_file(
            data_dir, "trn")
        full_trn = trn if trn is not None else xc_data.load_split(data_dir, "trn", text_field, len(labels))
        if len(full_trn) < 2:
            raise ValueError(f"{source}: need at least 2 training documents, found {len(full_trn)}")
        has_tst = xc_data.find_split_file(data_dir, "tst") is not None
        tst = xc_data.load_split(data_dir, "tst", text_field, len(labels)) if has_tst else None
        counts = {"trn": len(full_trn), "tst": len(tst) if tst else 0, "lbl": len(labels)}
        perm = rng.permutation(len(full_trn))
        n_val = min(cfg.val_max_docs, max(1, int(len(full_trn) * cfg.val_fraction)))
        val = full_trn.subset(sorted(perm[:n_val].tolist()))
        trn = full_trn.subset(sorted(perm[n_val:].tolist()))
        log.info("data: %d train, %d validation, %d test documents, %d labels (%s)",
                 len(trn), len(val), len(tst) if tst else 0, len(labels), text_field)
        fitted_on = [*trn.texts, *labels.texts]
        tokenizer = Tokenizer.fit(fitted_on, min_df=cfg.min_df, max_vocab=cfg.max_vocab,
                                  max_tokens=cfg.max_tokens, scheme=cfg.token_scheme)
        log.info("tokenizer: %d tokens", tokenizer.vocab_size - 1)
        docs, val_texts = EncodedTexts.of(tokenizer, trn.texts), EncodedTexts.of(tokenizer, val.texts)
        warnings = check_teachable(str(source), trn, docs, val, val_texts, cfg,
                                   TokenizerFit(tokenizer, fitted_on, text_field))
        freq = label_frequencies(trn.targets, len(labels), trn.weights)  # a soft label counts its weight
        return cls(
            labels, trn, val, tst, tokenizer, docs, EncodedTexts.of(tokenizer, labels.texts), val_texts,
            EncodedTexts.of(tokenizer, tst.texts) if tst else None,
            target_matrix(trn.targets, len(labels), trn.weights),
            1.0 / propensities(freq, len(trn)), xc_data.fingerprint(data_dir, counts), warnings,
        )

    def truths(self, split: xc_data.Split) -> Truths:
        """The split's labels to score rankings against, a soft label (imputed from group labels)
        counting its weight: validation chooses the served scoring by them, and counting a label
        spread over a group's members as sure on each one favoured the labels the model finds
        in many documents (bench/RESULTS.md, aggregated labels)."""
        return Truths(split.targets, self.inv_propensity, split.weights)

    def own_labels(self) -> np.ndarray:
        """Per validation document the id of the label with its uid (-1: none)."""
        return xc_data.own_label_ids(self.val.uids, self.labels.uids)

    def validation_rows(self, limit: int) -> list[dict[str, Any]]:
        """Held-out {"text", "target_ind"} rows for the bundle's quality gate, with "target_weight"
        when the labels were imputed (the gate then counts each label at its weight, as
        validation did here; a label of weight 0 is no truth, and a row without one is left out)."""
        val = self.val
        rows: list[dict[str, Any]] = []
        for i in range(min(limit, len(val))):
            targets = list(val.targets[i])
            weights = [1.0] * len(targets) if val.weights is None else [float(w) for w in val.weights[i]]
            kept = [j for j, w in enumerate(weights) if w > 0]
            if kept:
                rows.append({"text": val.texts[i], "target_ind": [targets[j] for j in kept]})
                if val.weights is not None:
                    rows[-1]["target_weight"] = [weights[j] for j in kept]
        return rows


class TokenizerFit(NamedTuple):
    """The tokenizer and what it was fitted from: what tells why no training document has a token."""

    tokenizer: Tokenizer
    texts: list[str]  # the training documents' and the labels' texts
    text_field: str  # "title" or "title+content"


def check_teachable(source: str, trn: xc_data.Split, docs: EncodedTexts, val: xc_data.Split,
                    val_texts: EncodedTexts, cfg: TrainConfig, fit: TokenizerFit) -> list[str]:
    """ValueError naming `source` (the trn file) when the training documents cannot teach
    anything: none has a label, none has a token of the vocabulary, fewer than min_train_docs
    have both, or the validation split the tuning picks on has fewer than min_val_docs with both
    (the tuning then picks from an objective of noise, or 0 everywhere: a document without a
    token is answered by the prior alone). Returns warnings where the data is allowed but small
    (small_train_docs, small_val_docs)."""
    labelled = np.array([bool(t) for t in trn.targets])
    tokens = _has_tokens(docs)
    if not labelled.any():
        raise ValueError(f"{source}: no training document has a label (target_ind is empty in all {len(trn)})")
    if not tokens.any():
        raise ValueError(f"{source}: no training document has a token of the vocabulary "
                         f"({no_token_cause(trn.texts, fit, cfg)})")
    usable = int((labelled & tokens).sum())
    if usable < cfg.min_train_docs:
        raise ValueError(f"{source}: {usable} training documents have both a label and a token of the vocabulary, "
                         f"fewer than min_train_docs ({cfg.min_train_docs}): too few to learn from")
    warnings = []
    if usable < cfg.small_train_docs:
        warnings.append(f"{source}: only {usable} training documents have a label and a token of the vocabulary "
                        f"(small_train_docs {cfg.small_train_docs}): the model learns little from them")
    if cfg.tune or cfg.m3_min_gain is not None:
        judged = int((np.array([bool(t) for t in val.targets], dtype=bool) & _has_tokens(val_texts)).sum())
        split = (f"{source}: the validation split carved from it (val_fraction {cfg.val_fraction}, val_max_docs "
                 f"{cfg.val_max_docs}) has {judged} documents with both a label and a token of the vocabulary")
        if judged < cfg.min_val_docs:
            raise ValueError(f"{split}, fewer than min_val_docs ({cfg.min_val_docs}) the tuning needs "
                             "(or set tune false)")
        if judged < cfg.small_val_docs:
            warnings.append(f"{split} (small_val_docs {cfg.small_val_docs}): the tuned scoring is noisy")
    for warning in warnings:
        log.warning("small data: %s", warning)
    return warnings


def no_token_cause(texts: Sequence[str], fit: TokenizerFit, cfg: TrainConfig) -> str:
    """Why none of `texts` has a token of the vocabulary, as the cause a user can act on: texts
    that are empty (a text field that is empty everywhere), texts of no word the tokenizer reads,
    or a vocabulary that min_df or max_vocab emptied or left without their words (one refusal
    text for all three sent users looking for an encoding problem that was not there)."""
    blank = sum(map(is_blank, texts))
    if blank == len(texts):
        hint = ": the text field is title; --text-field title+content reads the content too" \
            if fit.text_field == "title" else ""
        return f"all {len(texts)} texts are empty or blank{hint}"
    tokenizer = fit.tokenizer
    readable = sum(1 for text in texts if tokenizer.tokens(text))
    if not readable:
        empty = f"; {blank} of them are empty" if blank else ""
        return f"all {len(texts)} texts are symbols, emoji or other characters the tokenizer drops{empty}"
    # Document frequencies as Tokenizer.fit counts them, on its texts: the number min_df is compared to.
    df = Counter(token for text in fit.texts for token in set(tokenizer.tokens(text)))
    top, count = min(df.items(), key=lambda item: (-item[1], item[0]))
    most = f"the most frequent token, {top!r}, is in {count} of the {len(fit.texts)} texts it was fitted on " \
        "(training documents and labels)"
    if tokenizer.vocab_size <= 1:
        return f"min_df {cfg.min_df} left the vocabulary empty: {most}"
    return (f"{readable} of the {len(texts)} texts have words, none among the vocabulary's {tokenizer.vocab_size - 1} "
            f"tokens (min_df {cfg.min_df}, max_vocab {cfg.max_vocab}): {most}")


def _has_tokens(texts: EncodedTexts) -> np.ndarray:
    """Per text: has a token the vocabulary keeps (id 0 pads: a row of it has none)."""
    return (texts.ids != 0).any(dim=1).numpy()


def target_matrix(targets: Sequence[Sequence[int]], num_labels: int,
                  weights: Sequence[Sequence[float]] | None = None) -> sp.csr_matrix:
    """[documents, labels]: 1 (or the target's weight) at each document's targets."""
    indptr = np.zeros(len(targets) + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(t) for t in targets])
    indices = np.fromiter((x for t in targets for x in t), dtype=np.int64, count=int(indptr[-1]))
    data = (np.ones(len(indices), dtype=np.float32) if weights is None
            else np.fromiter((w for ws in weights for w in ws), dtype=np.float32, count=int(indptr[-1])))
    return sp.csr_matrix((data, indices, indptr), shape=(len(targets), num_labels))
