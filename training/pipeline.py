"""`shortlist train`: SiameseXML Modules I-III, the token table, the bundle's indices, the tuned
scoring and the tree, on an XC raw-text dataset -> Checkpoint. Read `_fit_modules`, then `_train`."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import scipy.sparse as sp
import torch

from service.engine.candidates import CandidateSources
from service.engine.index import VectorIndex, build_label_indices
from service.engine.labels import LabelTable
from service.engine.lexical import TokenShortlist
from service.engine.schema import HnswParams, Scoring, Shortlist
from service.engine.scorers import Calibration, LabelScorer
from service.engine.tokenizer import Tokenizer
from service.engine.vectors import as_served
from training.ann import AnnParams
from training.centroids import Centroids, hard_negative_shortlists
from training.checkpoint import Checkpoint
from training.classifiers import OneVsAll, Validation
from training.config import TrainConfig
from training.data import Split, data_differences, find_split_file
from training.dataset import TrainingSet
from training.divergence import check_fitted
from training.encoder import SiameseEncoder, embed
from training.progress import Progress
from training.report import Report
from training.siamese import SiameseTrainer
from training.token_shortlist import TokenTable
from training.tree_lexical import TokenRows
from training.tree_train import AdversarialTree
from training.tuning import ScoringTuner, classifier_objective, default_scoring

log = logging.getLogger("shortlist.training")
IDENTITY = Calibration("identity")


def train(data_dir: str | Path, config: TrainConfig | None = None, text_field: str = "title",
          seed: int | None = None, trn: Split | None = None) -> Checkpoint:
    """Train on data_dir's trn (validation carved from it); test metrics on tst when present.
    `trn` replaces data_dir's training documents (training/aggregated.py passes imputed ones)."""
    cfg = replace(config or TrainConfig(), **({} if seed is None else {"seed": int(seed)}))
    cfg.validate()
    if trn is None and find_split_file(data_dir, "groups") is not None:
        raise ValueError(f"{data_dir}: grouped data (it has a groups file): train it with --aggregated")
    with _torch_settings(cfg):
        return _train(Path(data_dir), cfg, text_field, trn)


@dataclass
class Modules:
    """What SiameseXML's Modules I-III leave for the rest of training."""

    data: TrainingSet
    encoder: SiameseEncoder
    encoder_losses: list[float]
    classifiers: OneVsAll
    centroids: Centroids
    doc_emb: np.ndarray


class MemberModel(NamedTuple):
    """A model's probability that a document carries a label (Module III's), what training from
    aggregated labels re-imputes with; a Checkpoint has the same three attributes."""

    tokenizer: Tokenizer
    encoder: SiameseEncoder
    classifiers: OneVsAll


def fit_member_model(data_dir: str | Path, config: TrainConfig, text_field: str, trn: Split) -> MemberModel:
    """Modules I-III alone on `trn` (data_dir's labels): no token table, tree, indices, tuning or
    test metrics, the same encoder and classifiers `train` would give."""
    config.validate()
    with _torch_settings(config):
        modules = _fit_modules(Path(data_dir), config, text_field, trn, Report(), test=False)
    return MemberModel(modules.data.tokenizer, modules.encoder.cpu(), modules.classifiers)


def _fit_modules(data_dir: Path, cfg: TrainConfig, text_field: str, trn: Split | None, report: Report,
                 test: bool = True) -> Modules:
    device, rng = _device(cfg), np.random.default_rng(cfg.seed)
    with report.stage("data"):
        data = TrainingSet.load(data_dir, cfg, text_field, rng, trn)
    if data.warnings:
        report.metrics["data_warnings"] = data.warnings
    ann = AnnParams(cfg.hnsw_m, cfg.hnsw_ef_construction, cfg.hnsw_ef, _index_threads(cfg), cfg.progress,
                   cfg.deterministic)
    encoder = SiameseEncoder(data.tokenizer.vocab_size, cfg.dim, seed=cfg.seed).to(device)
    with report.stage("module1"):
        m1 = SiameseTrainer.of(cfg, ann).fit(encoder, data.docs, data.label_texts, data.y, device, rng)
        label_emb, doc_emb = embed(encoder, data.label_texts, device), embed(encoder, data.docs, device)
        check_fitted("Module I", "lower m1_lr or m1_d", {**_encoder_arrays(encoder), "its loss": m1.losses_,
                                                           "the label embeddings": label_emb,
                                                           "the documents' embeddings": doc_emb})
        mu = _centroids(cfg, doc_emb, data.y, label_emb).vectors_
    if test:
        report.test_module1(data, encoder, label_emb, mu, device)
    with report.stage("module3"):
        m3 = OneVsAll.of(cfg, data.num_labels)
        negatives = None
        if m3.negatives == "shortlist":
            negatives = hard_negative_shortlists(doc_emb, label_emb, mu, cfg.m2_k_w, cfg.m2_k_mu, ann, cfg.seed)
        del mu  # each [L, D] array is 1 GB at 10^6 labels: dropped as soon as it is no longer needed
        clf = m3.fit(encoder, label_emb, data.docs, data.y, negatives, device, rng,
                     _module3_validation(cfg, data, encoder, device))
        _check_module3(cfg, clf, encoder)
        del negatives
        if cfg.m3_train_encoder:  # the encoder moved: the centroids live in the served encoder's space
            del label_emb, doc_emb
            label_emb, doc_emb = embed(encoder, data.label_texts, device), embed(encoder, data.docs, device)
        centroids = _centroids(cfg, doc_emb, data.y, label_emb)
        del label_emb
        clf.weights_, centroids.vectors_ = _as_stored(clf.weights_, cfg), _as_stored(centroids.vectors_, cfg)
    return Modules(data, encoder, m1.losses_, clf, centroids, doc_emb)


def _train(data_dir: Path, cfg: TrainConfig, text_field: str, trn: Split | None = None) -> Checkpoint:
    report, device = Report(), _device(cfg)
    modules = _fit_modules(data_dir, cfg, text_field, trn, report)
    data, encoder, clf, centroids = modules.data, modules.encoder, modules.classifiers, modules.centroids
    doc_emb, encoder_losses = modules.doc_emb, modules.encoder_losses
    del modules  # doc_emb is dropped below, before the indices
    with report.stage("token_shortlist"):
        lexical = (TokenTable.of(cfg).fit(data.docs, data.y, data.label_texts, data.tokenizer.vocab_size, device)
                   if cfg.token_shortlist_width else None)
        tables = lexical.tables_ if lexical is not None else [None]
        _check_lexical(lexical)
    tree = None
    if cfg.tree_enabled:  # before the indices: the tree's peak memory does not add to theirs
        with report.stage("tree"):
            tree = fit_tree(cfg, data, doc_emb, clf, centroids)
    del doc_emb
    with report.stage("indices"):
        hnsw = index_params(cfg)
        indices = _build_indices(cfg, hnsw, clf, centroids)
    with report.stage("tuning"):
        scoring, table = tune_scoring(cfg, data, encoder, clf, centroids, indices, tables, device, report)
    report.test_module3(data, encoder, LabelScorer.of(clf.weights_, clf.bias_, centroids.vectors_, scoring), device,
                        scoring.alpha)
    report.losses(encoder_losses, clf.losses_, getattr(lexical, "losses_", None), clf.validation_)
    return Checkpoint(
        tokenizer=data.tokenizer, labels=LabelTable(data.labels.uids, data.labels.titles), encoder=encoder.cpu(),
        classifiers=clf, centroids=centroids, scoring=scoring, hnsw=hnsw, indices=indices, token_table=table,
        tree=tree, text_field=text_field, config=asdict(cfg), fingerprint=data.fingerprint,
        metrics=report.metrics, validation=data.validation_rows(cfg.validation_rows),
    )


def _require_same_data(data_dir: str | Path, data: TrainingSet, ckpt: Checkpoint, checkpoint: str | Path) -> None:
    if differences := data_differences(data_dir, data.fingerprint, ckpt.fingerprint):
        raise ValueError(f"{data_dir}: not the data {checkpoint} was trained on ({'; '.join(differences)})")


def refit_tree(checkpoint: str | Path, data_dir: str | Path, tree_config: dict[str, Any] | None = None) -> Checkpoint:
    """`checkpoint` with only its tree route fitted again (the encoder, Modules I-III, the token
    table and the scoring kept), on the same data and split: the tree's config is the
    checkpoint's overridden by `tree_config`. Minutes less than training all of it again."""
    ckpt = Checkpoint.load(checkpoint)
    cfg = TrainConfig.from_dict({**ckpt.config, "tree": {**ckpt.config.get("tree", {}), **(tree_config or {})}})
    with _torch_settings(cfg):
        data = TrainingSet.load(Path(data_dir), cfg, ckpt.text_field, np.random.default_rng(cfg.seed))
        _require_same_data(data_dir, data, ckpt, checkpoint)
        doc_emb = embed(ckpt.encoder, data.docs, torch.device("cpu"))
        ckpt.tree = fit_tree(cfg, data, doc_emb, ckpt.classifiers, ckpt.centroids)
    ckpt.config = asdict(cfg)
    return ckpt


def index_params(cfg: TrainConfig) -> HnswParams:
    """The bundle's HNSW parameters from the training config: projected where the rows (dim D, or
    D + 1 with the bias) have more dimensions than index_projection_dim."""
    projection = cfg.index_projection_dim if cfg.index_projection_dim < cfg.dim else 0
    return HnswParams(M=cfg.index_m, ef_construction=cfg.index_ef_construction, ef_search=cfg.index_ef_search,
                      projection_dim=projection)


def _build_indices(cfg: TrainConfig, hnsw: HnswParams, clf: OneVsAll,
                   centroids: Centroids) -> tuple[VectorIndex, VectorIndex]:
    insertion_threads = 1 if cfg.deterministic else _index_threads(cfg)
    return build_label_indices(
        clf.weights_, clf.bias_, centroids.vectors_, hnsw, cfg.seed, insertion_threads,
        lambda name: lambda starts: Progress(starts, f"bundle's HNSW index of {len(clf.bias_)} {name}",
                                             enabled=cfg.progress))


# The training config keys a retune may change: the tuning's and the served sources', and the
# indices' (which are then built again before the tuning).
INDEX_KEYS = ("index_m", "index_ef_construction", "index_ef_search", "index_projection_dim", "index_threads")
RETUNE_KEYS = ("tune", "tune_objective", "exclude_own_labels", "alpha", "serve_k_w", "serve_k_mu", "serve_k_tok",
               "serve_k_head", "tune_sources", "tune_k_hnsw", "tune_source_margin", "tune_source_level", *INDEX_KEYS)


def retune(checkpoint: str | Path, data_dir: str | Path, tune_config: dict[str, Any] | None = None) -> Checkpoint:
    """`checkpoint` with only its scoring and served sources tuned again (RETUNE_KEYS of its
    config overridden by `tune_config`) on the same data and validation split, over its own
    indices and token table (the lexical form training kept: the other one is not stored);
    the encoder, classifiers, centroids and tree kept. Seconds instead of a training. Index
    keys that change the checkpoint's HNSW parameters build its indices again first (minutes)."""
    unknown = sorted(set(tune_config or {}) - set(RETUNE_KEYS))
    if unknown:
        raise ValueError(f"a retune changes only {', '.join(RETUNE_KEYS)}; got {', '.join(unknown)}")
    ckpt = Checkpoint.load(checkpoint)
    # The indices the checkpoint holds, whatever its config says (a config of an older version
    # lacks the newer keys, which would read as today's defaults).
    held = {"index_m": ckpt.hnsw.M, "index_ef_construction": ckpt.hnsw.ef_construction,
            "index_ef_search": ckpt.hnsw.ef_search, "index_projection_dim": ckpt.hnsw.projection_dim}
    cfg = TrainConfig.from_dict({**ckpt.config, **held, **(tune_config or {})})
    if index_params(cfg) != ckpt.hnsw:
        with _torch_settings(cfg):
            ckpt.hnsw = index_params(cfg)
            ckpt.indices = _build_indices(cfg, ckpt.hnsw, ckpt.classifiers, ckpt.centroids)
    if ckpt.indices is None:
        raise ValueError(f"{checkpoint}: a format-1 checkpoint holds no HNSW indices to tune over")
    with _torch_settings(cfg):
        data = TrainingSet.load(Path(data_dir), cfg, ckpt.text_field, np.random.default_rng(cfg.seed))
        _require_same_data(data_dir, data, ckpt, checkpoint)
        report, device = Report(), torch.device("cpu")
        ckpt.scoring, ckpt.token_table = tune_scoring(cfg, data, ckpt.encoder, ckpt.classifiers, ckpt.centroids,
                                                      ckpt.indices, [ckpt.token_table], device, report)
        w, b, mu = ckpt.classifiers.weights_, ckpt.classifiers.bias_, ckpt.centroids.vectors_
        report.test_module3(data, ckpt.encoder, LabelScorer.of(w, b, mu, ckpt.scoring), device, ckpt.scoring.alpha)
    del report.metrics["times"]
    ckpt.config, ckpt.metrics = asdict(cfg), {**ckpt.metrics, **report.metrics}
    return ckpt


def tune_scoring(cfg: TrainConfig, data: TrainingSet, encoder: SiameseEncoder, clf: OneVsAll, centroids: Centroids,
                 indices: tuple[VectorIndex, VectorIndex], tables: list[TokenShortlist | None],
                 device: torch.device, report: Report) -> tuple[Scoring, TokenShortlist | None]:
    """The scoring and token table served: tuned on the validation documents over the candidate
    sources (cfg.tune; reported), or the untuned scoring of the configured sources."""
    candidates = _candidate_sources(cfg, data.num_labels, clf.bias_, indices, tables)
    if not cfg.tune:
        table = candidates[-1].table
        return default_scoring(cfg.classifier_form, cfg.alpha, candidates[-1],
                               table.form if table is not None else "shares"), table
    scorer = LabelScorer(clf.weights_, clf.bias_, centroids.vectors_, IDENTITY, IDENTITY)
    tuner = ScoringTuner(cfg.classifier_form, cfg.tune_objective, margin=cfg.tune_source_margin,
                         level=cfg.tune_source_level, seed=cfg.seed).fit(
        embed(encoder, data.val_texts, device), data.val_texts.ids.numpy(), data.val_texts.weights.numpy(),
        data.truths(data.val), candidates, scorer, data.own_labels() if cfg.exclude_own_labels else None)
    report.validation(tuner)
    return tuner.scoring_, tuner.sources_.table


def fit_tree(cfg: TrainConfig, data: TrainingSet, doc_emb: np.ndarray, clf: OneVsAll,
             centroids: Centroids) -> AdversarialTree:
    """The tree route (training/tree_train.py) on the training documents' embeddings, their
    tokens, Module III's classifiers and the label centroids."""
    tokens = TokenRows(data.docs.ids.numpy(), data.docs.weights.numpy(), data.label_texts.ids.numpy(),
                       data.tokenizer.vocab_size)
    model = AdversarialTree(cfg.tree, cfg.seed, cfg.progress)
    model.fit(doc_emb, data.trn.targets, data.num_labels, tokens=tokens, module3=(clf.weights_, clf.bias_),
              centroids=centroids.vectors_, target_weights=data.trn.weights)
    check_fitted("tree classifier", f"lower tree.lr, or train with vector_dtype float32 (not {cfg.vector_dtype})",
                 {"classifier_weights": model.arrays_["classifier_weights"]}, cfg.vector_dtype)
    model.arrays_["classifier_weights"] = as_served(model.arrays_["classifier_weights"], cfg.vector_dtype)
    return model


def _encoder_arrays(encoder: SiameseEncoder) -> dict[str, torch.Tensor]:
    """The encoder's learned tensors, named for a divergence message."""
    return {f"the encoder's {name}": tensor for name, tensor in encoder.state_dict().items()}


def _centroids(cfg: TrainConfig, doc_emb: np.ndarray, y: sp.csr_matrix, label_emb: np.ndarray) -> Centroids:
    """The label centroids, checked (a centroid not finite met the centroid index later, and
    export named hnsw_mu.bin, not the setting)."""
    centroids = Centroids(cfg.centroid_label_weight).fit(doc_emb, y, label_emb)
    check_fitted("centroids", "lower centroid_label_weight", {"the centroids": centroids.vectors_})
    return centroids


def _check_module3(cfg: TrainConfig, clf: OneVsAll, encoder: SiameseEncoder) -> None:
    """Module III's classifiers, loss and (fine-tuned with them) encoder finite and, the weights,
    within the vector_dtype the bundle stores them in; the advice names the settings in effect."""
    settings = ["m3_lr", *(["m3_encoder_lr"] if cfg.m3_train_encoder else []),
                *(["m3_softmax_weight"] if cfg.m3_softmax_weight > 0 else []),
                *(["m3_d"] if cfg.classifier_form == "paper" else [])]
    advice = f"lower {' or '.join(settings)}"
    check_fitted("Module III", advice, {"the classifiers' weights": clf.weights_, "the classifiers' bias": clf.bias_,
                                        **(_encoder_arrays(encoder) if cfg.m3_train_encoder else {}),
                                        "its loss": clf.losses_})
    check_fitted("Module III", f"{advice}, or train with vector_dtype float32 (not {cfg.vector_dtype})",
                 {"the classifiers' weights": clf.weights_}, cfg.vector_dtype)


def _check_lexical(lexical: TokenTable | None) -> None:
    """The token table's logistic form finite (the shares are ratios of counts: always finite)."""
    for table in lexical.tables_ if lexical is not None else []:
        if table.form == "logistic":
            check_fitted("lexical table", "lower lexical_lr or raise lexical_l2",
                         {"its weights": table.weights, "its bias": table.bias, "its loss": lexical.losses_})


def _module3_validation(cfg: TrainConfig, data: TrainingSet, encoder: SiameseEncoder,
                        device: torch.device) -> Validation | None:
    """Module III's early stop (m3_min_gain): the tune_objective of the classifiers alone on the
    validation documents, embedded by the encoder as it is then (Module III fine-tunes it), own
    labels left out as the tuning leaves them."""
    if cfg.m3_min_gain is None or not len(data.val):
        return None
    truths, own = data.truths(data.val), data.own_labels() if cfg.exclude_own_labels else None
    return lambda weights, bias: classifier_objective(embed(encoder, data.val_texts, device), weights, bias, truths,
                                                      cfg.tune_objective, own)


@contextmanager
def _torch_settings(cfg: TrainConfig) -> Iterator[None]:
    """Deterministic kernels, the thread count and the seeds of this run; restored after."""
    was_deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.use_deterministic_algorithms(cfg.deterministic, warn_only=True)
    torch.set_num_threads(_threads(cfg))
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % (2**32))
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.set_num_threads(threads)


def _candidate_sources(cfg: TrainConfig, num_labels: int, bias: np.ndarray, indices: tuple[VectorIndex, VectorIndex],
                       tables: list[TokenShortlist | None]) -> list[CandidateSources]:
    """The shortlists the tuning chooses among (cfg.shortlist_choices), each with each lexical form."""
    out = []
    for k_w, k_mu, k_tok in cfg.shortlist_choices(tables[0] is not None):
        spec = Shortlist.served(k_w, k_mu, k_tok, min(cfg.serve_k_head, num_labels), bool(np.any(bias != 0)))
        for t in tables if k_tok else [None]:
            out.append(CandidateSources(spec, bias, index_w=indices[0], index_mu=indices[1], table=t,
                                        lexical=t is not None and t.weights is not None))
    return out


def _as_stored(vectors: np.ndarray, cfg: TrainConfig) -> np.ndarray:
    """float32 vectors rounded to the bundle's vector_dtype (the values serving will read)."""
    return as_served(vectors, cfg.vector_dtype)


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def _threads(cfg: TrainConfig) -> int:
    return cfg.threads if cfg.threads > 0 else (os.cpu_count() or 1)


def _index_threads(cfg: TrainConfig) -> int:
    return cfg.index_threads if cfg.index_threads > 0 else _threads(cfg)
