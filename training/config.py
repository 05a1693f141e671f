"""`shortlist train`'s hyper-parameters: one dataclass, validated at the edge.

What each setting was measured at is in bench/RESULTS.md; the comments here say what a
setting does and why its default is what it is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import orjson

from service.engine.jsonlines import os_reason
from service.engine.schema import LEXICAL_FORMS, MAX_EF_SEARCH, MAX_SOURCE_K, VECTOR_DTYPES
from service.engine.small_files import RefusedFile, read_small_file
from service.engine.token_schemes import DEFAULT_SCHEME, SCHEME_PATTERNS
from training.config_values import (
    BATCH,
    COUNT_0,
    COUNT_1,
    LEARNING_RATE,
    MAX_HNSW_M,
    MAX_LEARNING_RATE,
    MAX_POINTS,
    MAX_SEED,
    MAX_THREADS,
    PER_ROW_0,
    PER_ROW_1,
    POSITIVE_WEIGHT,
    STEPS_0,
    STEPS_1,
    UNIT,
    WEIGHT,
    WIDTH_0,
    WIDTH_1,
    Bounds,
    json_value,
)
from training.tree_config import resolve_config as resolve_tree_config
from training.tree_config import setting_bounds as tree_setting_bounds

CLASSIFIER_FORMS = ("paper", "scaled_bias")
# Metrics the validation tuning can weigh: ranking_metrics at ks (1, 5) with propensities.
TUNABLE_METRICS = ("P@1", "P@5", "nDCG@1", "nDCG@5", "PSP@1", "PSP@5", "PSnDCG@1", "PSnDCG@5")
DEFAULT_OBJECTIVE = {"P@1": 1.0, "P@5": 1.0, "PSP@5": 1.0}
# A training config is a few hundred bytes of settings: past this it is not one.
MAX_CONFIG_BYTES = 1 << 20
# m3_negatives "auto": all labels as negatives up to this many labels, the shortlist beyond.
M3_ALL_MAX_LABELS = 50_000


@dataclass
class TrainConfig:
    """All hyper-parameters of `shortlist train`; a JSON file given by --config overrides them."""

    seed: int = 0
    dim: int = 256
    threads: int = 0  # 0 = all cores
    # HNSW insertion (with deterministic false) and search threads, 0 = as `threads`. hnswlib's
    # threads do not wait for each other as torch's OpenMP team does: on a busy machine one torch
    # thread and two HNSW threads (bench/scale-config.json) build the indices ~1.8x faster.
    index_threads: int = 0
    device: str = "auto"  # auto | cpu | cuda
    progress: bool = True  # a bar on a terminal, a log line every few seconds elsewhere
    # Deterministic torch kernels (the parallel embedding-gradient sum otherwise varies run to run)
    # and training's HNSW indices built on one thread (false: on `threads`, faster at 10^6 labels).
    deterministic: bool = True
    # tokenizer: token_scheme is how a text splits into tokens (service.engine.token_schemes:
    # "unicode-words", or "words", the split of bundles trained before schemes)
    token_scheme: str = DEFAULT_SCHEME
    min_df: int = 1
    max_vocab: int = 200_000
    max_tokens: int = 64
    # validation split carved from trn (tuning of the scoring, the bundle's quality gate rows)
    val_fraction: float = 0.05
    val_max_docs: int = 2000
    validation_rows: int = 200
    # Data that cannot teach is refused before training (exit 2): fewer than min_train_docs
    # training documents with both a label and a token of the vocabulary, or, when the scoring is
    # tuned (tune) or Module III stops on validation (m3_min_gain), fewer than min_val_docs
    # validation documents with a label (1 document: the tuning picks on one document's luck).
    # Below small_train_docs or small_val_docs (0: never) training goes on with a warning in the
    # log and the checkpoint's metrics ("data_warnings").
    min_train_docs: int = 10
    min_val_docs: int = 10
    small_train_docs: int = 1000
    small_val_docs: int = 100
    # Module I: Siamese training of the encoder on documents against their labels' texts
    m1_epochs: int = 2
    m1_batch_size: int = 256
    m1_lr: float = 0.01
    m1_c: float = 0.9
    m1_d: float = 1.5
    m1_inbatch_negatives: int = 10
    m1_refresh_every: int = 2  # epochs between refreshes of the ANN hard negatives (0 = never)
    m1_ann_negatives: int = 20  # nearest non-positive labels kept per document at a refresh
    # ANN (hnswlib, inner product) used for hard negatives in Modules I and II
    hnsw_m: int = 16
    hnsw_ef_construction: int = 100
    hnsw_ef: int = 100
    # Module II shortlists (Module III's negatives with m3_negatives "shortlist")
    m2_k_w: int = 50
    m2_k_mu: int = 50
    # weight of the label's own text embedding added to its centroid (0 = the paper's centroid):
    # tail labels with few documents then score by their text too
    centroid_label_weight: float = 1.0
    # Module III: per-label classifiers
    classifier_form: str = "scaled_bias"
    # Negatives of each document in Module III: "all" L labels (O(N L D) an epoch), its Module II
    # "shortlist" (hard negatives, O(N k D); the classifiers' rows then step sparsely), or "auto":
    # all up to M3_ALL_MAX_LABELS labels, the shortlist beyond (bench/scale.py measured both).
    m3_negatives: str = "auto"
    m3_epochs: int = 8
    # ...and at most this many steps (whole epochs, at least one): 8 epochs of 10^6 documents are
    # 31,200 steps, hours on 2 cores; 10^5 labels (3,064 steps), debian-deps and -tags stay below.
    m3_max_steps: int = 8000
    # ...and, with m3_min_gain, it stops after the first epoch that raises the classifiers'
    # validation objective (tune_objective of w_l . q + b_l over all labels, own labels left out)
    # by less than that many points (null: every epoch runs). Off by default: the classifiers
    # alone are not the served score. debian-deps seed 0, classifiers alone: 94.2, 101.7, 105.8,
    # 107.9 after epochs 1-4 (gains halving); stopped there (2.5) the served validation P@1 fell
    # 67.82 -> 66.62 (P@5 34.79 -> 35.01, PSP@5 31.61 -> 31.40), test own P@1 66.33 -> 65.68.
    m3_min_gain: float | None = None
    m3_batch_size: int = 256
    m3_lr: float = 0.02
    m3_c: float = 0.75
    m3_d: float = 3.0
    m3_train_encoder: bool = True  # fine-tune the encoder with the classifiers
    m3_encoder_lr: float = 0.005
    m3_weight_decay: float = 1e-5  # L2 on the classifiers; without it Module III overfits
    # On shortlists, the other documents' positives in a batch are negatives too (shared
    # columns): without them the classifiers rank only their shortlists (training/classifiers.py).
    m3_batch_negatives: bool = True
    # The encoder's token embedding stepped lazily (SparseAdam over the rows a batch uses) in
    # Modules I and III: a dense Adam step costs V x D whatever the batch holds.
    lazy_embedding: bool = True
    # weight of a softmax cross-entropy term added to the per-label BCE (m3_negatives "all")
    m3_softmax_weight: float = 0.0
    # dtype of the bundle's [L, D] label vectors (classifiers, centroids; service.engine.vectors):
    # float16 halves what serving maps (10^6 labels: 3 x 1 GiB -> 3 x 0.5 GiB), int8 with a scale
    # per row halves it again (the tree's classifier too, tree.npz's classifier_scales): on debian-deps and
    # debian-tags test P@k and PSP@k within 0.02 of float16, serving memory -20 MiB on debian-deps,
    # the scoring stage ~2x faster (bench/RESULTS.md, issue 21). Training rounds them to it before
    # the indices and the tuning, so what is tuned is what is served.
    vector_dtype: str = "int8"
    # The bundle's HNSW indices over [w_l, b_l] and mu_l: built before tuning, so the scoring
    # is tuned on the searches the bundle serves, and shipped as they are.
    index_m: int = 24
    index_ef_construction: int = 200
    index_ef_search: int = 50
    # Rows of more dimensions than this are indexed projected onto their top index_projection_dim
    # principal directions (HnswParams.projection_dim); rows of at most this many, or with 0, as
    # they are. The index only finds candidates, scored from the full rows after; hnswlib's
    # float32 copy of each row shrinks by dim / index_projection_dim and a search computes
    # shorter products. debian-deps validation (D = 256, k_mu 50, the same scoring; bench/RESULTS.md,
    # issue 21): 128 kept P@1 / P@5 / PSP@5 within 0.25 point (the objective -0.35, inside
    # tune_source_margin), the centroid graph 52 -> 31 MB, its search 94 -> 71 us; 64 lost 0.8 of PSP@5.
    index_projection_dim: int = 128
    # Scoring (alpha, calibrations, lexical weight): tuned on validation when `tune`, to
    # maximise sum of weight * metric (TUNABLE_METRICS); a single metric picks noisily.
    tune: bool = True
    tune_objective: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_OBJECTIVE))
    # Tune as if each validation document's own label (same uid) were excluded, as the
    # service's `exclude` and the XC repository's filtered protocol do: a document that is
    # also a label is never its own target. No effect where documents are not labels.
    exclude_own_labels: bool = True
    alpha: float = 0.8  # used when tune is off
    # Shortlist sources served by default: HNSW over [w, b] (k_w), HNSW over centroids (k_mu),
    # the token shortlist (k_tok labels per query token, of token_shortlist_width kept; 0 = no
    # table), the k labels of largest bias (the prior's head). The token table alone beat both
    # HNSW searches on debian-deps at a fifth of the latency; data whose texts share little
    # vocabulary with the label texts needs the HNSW sources, which every bundle carries.
    serve_k_w: int = 0
    serve_k_mu: int = 0
    token_shortlist_width: int = 20
    serve_k_tok: int = 10
    serve_k_head: int = 32
    # With tune_sources, tuning also chooses the sources: k_tok in {serve_k_tok,
    # token_shortlist_width}, k_w and k_mu each in {serve value, 0, tune_k_hnsw}, and serves the
    # cheapest choice (fewest HNSW searches, then the narrower token rows) not significantly below
    # the best validation objective: below it on fewer than tune_source_level of 1,000 paired
    # bootstrap resamples of the validation documents (seeded by seed), or within
    # tune_source_margin points of it. An HNSW index costs a search and ~1.2 KB of memory per
    # label when served, so it is served only where it pays beyond the validation split's noise
    # and by more than the margin (on a large validation split a tiny gain is significant yet
    # not worth a search). tune_source_level 0: the margin alone decides (the rule before the
    # bootstrap); 1: only a source below the best on every resample is refused. debian-deps
    # (1,995 validation documents): the token rows alone, 1.2 points below k_mu 50, were below on
    # 98.2% of resamples (refused; on test too: PSP@5 -1.8); k_tok 10 with k_mu 50, 0.8 below,
    # on 91.9% (served).
    tune_sources: bool = True
    tune_k_hnsw: int = 50
    tune_source_margin: float = 0.5
    tune_source_level: float = 0.95
    # The token table's lexical score (service/engine/lexical.py): "shares", "logistic" (fitted
    # by Adam with lexical_epochs, lexical_lr, L2 lexical_l2), or "auto": fit both and keep the
    # one whose tuned validation objective is higher.
    lexical_form: str = "auto"
    lexical_epochs: int = 100
    # ...and at most this many steps (batches): 100 epochs of 10^6 documents were 100,000 steps;
    # debian-deps (37 steps an epoch) and debian-tags reach neither cap before 100 epochs.
    lexical_max_steps: int = 4000
    # ...and it stops after the first epoch that lowers its loss by less than this share of the
    # epoch before's (0: every epoch). debian-deps' loss (seed 0) was within 0.5% of its 100th
    # epoch's by the 20th (15.47, 7.63, 7.21, 7.09, 7.05 after epochs 1, 6, 11, 16, 21; 7.00 at 100),
    # where an epoch gains ~0.1%: that fit (and the tree's lexical start) ran ~5x longer than needed.
    lexical_tol: float = 1e-3
    lexical_lr: float = 0.05
    lexical_l2: float = 1e-5
    lexical_batch_size: int = 1024
    # the adversarial tree scorer (training/tree_train.py)
    tree_enabled: bool = True
    # Grouped data (`shortlist train --aggregated`, training/aggregated.py): EAGLE's Algorithm 1
    # iterations T and step lambda, and the rounds of imputation (each round after the first
    # re-imputes from the model trained in the round before it, aggregated_reimpute, then
    # retrains). With aggregated_validation > 0 (beyond the paper),
    # that share of the groups is held out and the number of iterations, 0..T, is the one whose
    # vectors rank the held-out groups' labels best (by their members' best scores): a
    # group-level validation, never per-document labels. It is needed: in the centred space
    # below the start (0 iterations) ranked best on random groups of debian-tags and debian-deps
    # and 10 iterations on clustered groups of debian-tags (bench/aggregated_imputation.py).
    # 0 = T as given (the paper's method, measured with T = 10, lambda = 0.5: bench/RESULTS.md).
    aggregated_iterations: int = 10
    aggregated_validation: float = 0.1
    # The fewest held-out groups with a label (a share aggregated_validation of the groups that
    # have one, leaving at least one to learn from) the iterations and keep ratio are chosen on
    # (a group is scored as a validation document is, by its labels' ranks): with fewer nothing
    # is chosen on one group's luck, a warning says so, and the paper's method is used
    # (aggregated_iterations as given; aggregated_keep_ratio, else each group label to its closest member).
    aggregated_min_val_groups: int = 10
    aggregated_step: float = 0.5
    # A second round re-imputes from cross-fitted models' posteriors (aggregated_reimpute,
    # aggregated_posterior_folds): on groups of 4 it recovers more of the naive-to-true P@1 gap
    # (clustered: debian-tags 9 / 11 / 18% -> 45 / 43 / 45% at seeds 0 / 1 / 2, debian-deps 35% ->
    # 58%; random: debian-tags 74% -> 85%, debian-deps 80% -> 86%), but training takes two to four
    # times as long and on debian-deps' random groups PSP@5 falls from 32.6 to 27.0 (clustered
    # groups and debian-tags: -0.9 to +2.3; bench/RESULTS.md): one round by default, two on
    # request, for groups of alike documents.
    aggregated_rounds: int = 1
    # Who gets a group's label: its closest member (the paper's Algorithm 2), "expected": as
    # many closest members as a group carrying the label is expected to hold (from the share of
    # groups carrying it), or "relative": every member scoring at least aggregated_keep_ratio
    # times the closest member's (training/eagle.py). The ratio, when None, is chosen on the
    # held-out groups (aggregated_validation): the one whose imputed labels best predict those
    # groups' labels from their members' neighbours. On debian-tags it keeps the label on half the
    # closest score in clustered groups of 4 and 0.7 in random ones (bench/RESULTS.md).
    aggregated_assignment: str = "relative"
    aggregated_keep_ratio: float | None = None
    # Soft imputed labels (the relative assignment): a member's label weighs its score over its
    # group's closest member's, as Module III's target and in the label's centroid (Module I
    # takes every kept label as a positive). Clustered groups of 4, P@1 / P@5 / PSP@5 against
    # every kept label weighing 1: debian-tags 75.35 / 41.39 / 58.03 vs 74.60 / 40.25 / 54.59,
    # debian-deps (own label excluded) 58.80 / 30.44 / 26.52 vs 58.35 / 30.00 / 25.25
    # (bench/RESULTS.md). With the closest member alone (random groups of debian-deps) no change.
    aggregated_soft_labels: bool = True
    # Beyond the paper (training/eagle.py): centre the features on the documents' mean (TF-IDF
    # rows share a large non-negative common part that otherwise draws every frequent label to
    # the most generic member), and add each label's text as a group of one carrying the label.
    aggregated_center: bool = True
    aggregated_label_texts: bool = True
    # How a further round re-imputes: "model": every member of a group gets each of the group's
    # labels with its posterior of carrying it given that at least one member does, under the
    # trained model's probabilities (training/eagle.py carrier_posteriors; the trained model
    # tells a group's alike members apart better than the TF-IDF label vectors do); "encoder":
    # EAGLE's imputation again in the trained encoder's embedding space.
    aggregated_reimpute: str = "model"
    # The "model" round's smallest posterior kept as a soft label (each pair's likeliest member
    # keeps its label whatever its posterior): a large group gives every member each of its labels,
    # 30 million soft labels for 20,000 documents in groups of 500, nearly all weighing ~1/500,
    # which train as targets near 0, as the negatives they would be without them (bench/RESULTS.md).
    aggregated_min_posterior: float = 0.01
    # The "model" round's posteriors are cross-fitted: the groups are dealt into this many folds
    # and each fold's members are scored by a model (Modules I-III) trained on the other folds'
    # labels of the round before, never on their own, which a model trained on them echoes back.
    # Clustered groups of 4 of debian-tags, the naive-to-true P@1 gap the second round recovers at
    # seeds 0 / 1 / 2 (bench/RESULTS.md): one model on every group 31 / 39 / 43%, 2 folds 41 / 43 /
    # 44%, 4 folds 47 / 45 / 52% (one round: 14 / 19 / 25%). The folds' models cost about
    # folds - 1 trainings of Modules I-III (1: one model on every group, as before).
    aggregated_posterior_folds: int = 4
    tree: dict[str, Any] = field(default_factory=dict)

    def shortlist_choices(self, has_table: bool) -> list[tuple[int, int, int]]:
        """(k_w, k_mu, k_tok) the tuning chooses among, the configured serve_* first."""
        k_tok = self.serve_k_tok if has_table else 0
        if not self.tune_sources:
            return [(self.serve_k_w, self.serve_k_mu, k_tok)]
        toks = dict.fromkeys([k_tok, self.token_shortlist_width] if has_table else [0])
        ws = dict.fromkeys([self.serve_k_w, 0, self.tune_k_hnsw])
        mus = dict.fromkeys([self.serve_k_mu, 0, self.tune_k_hnsw])
        return [(w, mu, t) for w in ws for mu in mus for t in toks if w + mu + t > 0]

    def module3_negatives(self, num_labels: int) -> str:
        """m3_negatives with "auto" resolved for num_labels labels."""
        if self.m3_negatives != "auto":
            return self.m3_negatives
        return "all" if num_labels <= M3_ALL_MAX_LABELS else "shortlist"

    @classmethod
    def tiny(cls) -> TrainConfig:
        """Trains in a few seconds on small generated data (test fixtures)."""
        return cls(
            dim=32, m1_epochs=4, m1_batch_size=128, m1_lr=0.02, m1_refresh_every=2, m3_epochs=4, m3_batch_size=128,
            m3_lr=0.02, val_max_docs=300, validation_rows=50, hnsw_ef=50, hnsw_ef_construction=50, m2_k_w=20,
            m2_k_mu=20, serve_k_w=20, serve_k_mu=20, tune_sources=False,
            # one form, fitted once: the test fixtures' bundles hold the logistic table
            lexical_form="logistic", lexical_epochs=30, progress=False,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any], base: TrainConfig | None = None) -> TrainConfig:
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown training config keys: {', '.join(unknown)}")
        d = {f.name: json_value(f.name, f.type, d[f.name]) for f in fields(cls) if f.name in d}
        out = cls(**{**asdict(base or cls()), **d})
        out.validate()
        return out

    @classmethod
    def from_json(cls, path: str | Path) -> TrainConfig:
        d = read_config_file(path)
        presets = {"tiny": cls.tiny()}
        try:
            base = None
            if "preset" in d:  # a typo (or null) must not train at full size
                preset = d.pop("preset")
                if not isinstance(preset, str) or preset not in presets:
                    raise ValueError(f"training config 'preset' must be one of {sorted(presets)}, got {preset!r}")
                base = presets[preset]
            return cls.from_dict(d, base)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def validate(self) -> None:
        _choice("classifier_form", self.classifier_form, CLASSIFIER_FORMS)
        _choice("m3_negatives", self.m3_negatives, ("auto", "all", "shortlist"))
        _choice("vector_dtype", self.vector_dtype, VECTOR_DTYPES)
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        _choice("token_scheme", self.token_scheme, tuple(SCHEME_PATTERNS))
        _choice("lexical_form", self.lexical_form, (*LEXICAL_FORMS, "auto"))
        _choice("aggregated_assignment", self.aggregated_assignment, ("closest", "expected", "relative"))
        _choice("aggregated_reimpute", self.aggregated_reimpute, ("model", "encoder"))
        for f in fields(self):
            if f.name in _BOUNDS and not (f.type.endswith("None") and getattr(self, f.name) is None):
                _BOUNDS[f.name].check(f.name, getattr(self, f.name), integer=f.type == "int")
        if not 0 <= self.serve_k_tok <= self.token_shortlist_width:
            raise ValueError(
                f"serve_k_tok must be in [0, token_shortlist_width={self.token_shortlist_width}], "
                f"got {self.serve_k_tok}"
            )
        if self.serve_k_w + self.serve_k_mu + self.serve_k_tok == 0:
            raise ValueError("serve_k_w, serve_k_mu and serve_k_tok are all 0: serving would have nothing to score")
        check_objective(self.tune_objective)
        tree = resolve_tree_config(self.tree)  # before any training: a bad tree setting fails now
        if self.tree_enabled and tree["pca_dim"] > self.dim:
            raise ValueError(f"training config 'tree.pca_dim' must be <= dim ({self.dim}), got {tree['pca_dim']}")
        ratio = self.aggregated_keep_ratio
        if self.aggregated_assignment == "relative" and ratio is None and self.aggregated_validation == 0:
            raise ValueError("aggregated_assignment 'relative' needs aggregated_keep_ratio or "
                             "aggregated_validation > 0 to choose it on")


_FRACTION, _LIKELIHOOD_C = Bounds(0, 1, open_high=True), Bounds(0, 1, open_low=True)
# A source's k (a manifest's k_w, k_mu, k_head): the engine's limit, every label of the largest sets served.
_SOURCE_K = Bounds(0, MAX_SOURCE_K)
_EF = Bounds(1, MAX_EF_SEARCH)  # the manifest's ef_search limit; beyond any build's useful ef_construction too
_HNSW_M = Bounds(2, MAX_HNSW_M)  # hnswlib divides by log(M): M = 1 is no graph
_POINTS = Bounds(0, MAX_POINTS)
_THREADS = Bounds(0, MAX_THREADS)  # 0: every core
_FOLDS = Bounds(1, 100)  # a model trained per fold: past a few folds, more cost and little change
# The range of every numeric setting (m3_min_gain and aggregated_keep_ratio may also be null; the
# maxima: training.config_values). Settings that count epochs or candidates may be 0 where 0 is
# documented to turn that part off.
_BOUNDS: dict[str, Bounds] = {
    "seed": Bounds(0, MAX_SEED), "dim": WIDTH_1, "threads": _THREADS, "index_threads": _THREADS,
    "min_df": COUNT_1, "max_vocab": COUNT_1, "max_tokens": WIDTH_1,
    "val_fraction": _FRACTION, "val_max_docs": COUNT_1, "validation_rows": COUNT_1,
    "min_train_docs": COUNT_1, "min_val_docs": COUNT_1, "small_train_docs": COUNT_0, "small_val_docs": COUNT_0,
    "m1_epochs": STEPS_0, "m1_batch_size": BATCH, "m1_lr": LEARNING_RATE, "m1_c": _LIKELIHOOD_C,
    "m1_d": POSITIVE_WEIGHT, "m1_inbatch_negatives": PER_ROW_0, "m1_refresh_every": STEPS_0,
    "m1_ann_negatives": PER_ROW_0,
    "hnsw_m": _HNSW_M, "hnsw_ef_construction": _EF, "hnsw_ef": _EF,
    "m2_k_w": PER_ROW_1, "m2_k_mu": PER_ROW_1, "centroid_label_weight": WEIGHT,
    "m3_epochs": STEPS_1, "m3_max_steps": STEPS_1, "m3_min_gain": Bounds(-MAX_POINTS, MAX_POINTS),
    "m3_batch_size": BATCH, "m3_lr": LEARNING_RATE, "m3_c": _LIKELIHOOD_C, "m3_d": POSITIVE_WEIGHT,
    "m3_encoder_lr": LEARNING_RATE, "m3_weight_decay": WEIGHT, "m3_softmax_weight": WEIGHT,
    "index_m": _HNSW_M, "index_ef_construction": _EF, "index_ef_search": _EF,
    "index_projection_dim": WIDTH_0, "alpha": UNIT,
    "serve_k_w": _SOURCE_K, "serve_k_mu": _SOURCE_K, "token_shortlist_width": PER_ROW_0, "serve_k_tok": PER_ROW_0,
    "serve_k_head": _SOURCE_K, "tune_k_hnsw": _SOURCE_K, "tune_source_margin": _POINTS,
    "tune_source_level": UNIT, "lexical_epochs": STEPS_1, "lexical_max_steps": STEPS_1,
    "lexical_tol": UNIT, "lexical_lr": Bounds(0, MAX_LEARNING_RATE), "lexical_l2": WEIGHT, "lexical_batch_size": BATCH,
    "aggregated_iterations": STEPS_0, "aggregated_validation": _FRACTION,
    "aggregated_min_val_groups": COUNT_1,
    "aggregated_step": Bounds(0, 1, open_low=True), "aggregated_rounds": STEPS_1, "aggregated_keep_ratio": UNIT,
    "aggregated_min_posterior": _FRACTION, "aggregated_posterior_folds": _FOLDS,
}


def setting_bounds() -> dict[str, Bounds]:
    """The range of every numeric setting, the tree's by their names in a config (tree.beam)."""
    return {**_BOUNDS, **tree_setting_bounds()}


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_objective(objective: dict[str, float]) -> None:
    if not isinstance(objective, dict) or not objective:
        raise ValueError(f"tune_objective must be a non-empty object of metric weights, got {objective!r}")
    unknown = sorted(set(objective) - set(TUNABLE_METRICS))
    if unknown:
        raise ValueError(f"tune_objective: unknown metrics {unknown}; known: {', '.join(TUNABLE_METRICS)}")
    for name, weight in objective.items():
        WEIGHT.check(f"tune_objective.{name}", weight, integer=False)
    if not any(objective.values()):
        raise ValueError("tune_objective: all weights are 0, nothing to maximise")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The JSON object of a config file (orjson: RFC 8259, nesting bounded without recursion);
    ValueError naming the file otherwise."""
    try:
        # A FIFO would hang the read and /dev/zero fill the memory: a regular file, bounded.
        d = orjson.loads(read_small_file(Path(path), MAX_CONFIG_BYTES, follow_symlinks=True))
    except RefusedFile as exc:
        raise ValueError(f"{path}: cannot read training config: {str(exc).removeprefix(f'{path}: ')}") from None
    except (OSError, orjson.JSONDecodeError) as exc:
        reason = os_reason(exc) if isinstance(exc, OSError) else exc
        raise ValueError(f"{path}: cannot read training config: {reason}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: training config must be a JSON object")
    return d
