"""`shortlist export`: a training checkpoint -> an immutable, checked, versioned bundle."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from model_export.onnx_export import DEFAULT_TABLE_DTYPE, as_served, check_parity, export_encoder, parity_texts
from service.api.settings import offline_store
from service.engine import canary, schema, store, vectors
from service.engine.bundle import Bundle
from service.engine.index import build_label_indices
from service.engine.metrics import Truths, ranking_metrics, shortlist_recall
from service.engine.predictor import Predictor, check_staged
from service.engine.validation_rows import validation_truths
from training.checkpoint import Checkpoint
from training.files import naming
from training.token_shortlist import lexical_files

log = logging.getLogger("shortlist.export")
CANARY_QUERIES = 3


def default_version() -> str:
    return datetime.now(UTC).strftime("v%Y%m%d-%H%M%S")


def export_checkpoint(ckpt_dir: str | Path, root: str | Path, version: str | None = None,
                      ef_search: int | None = None, n_parity: int = 1000,
                      encoder_dtype: str = DEFAULT_TABLE_DTYPE, vector_dtype: str | None = None) -> Path:
    """Write ROOT/VERSION from a checkpoint; returns the bundle's path once it loads as served.
    `encoder_dtype`: how the encoder's token embedding table is stored (int8, float16 or float32);
    `vector_dtype`: how the label vectors are (service.engine.vectors; default: the training
    config's, which the scoring was tuned on)."""
    t0 = time.perf_counter()
    check_options(ef_search, n_parity)
    # None, not any false value: an empty name is refused, not silently a timestamp.
    version = schema.validate_version_name(default_version() if version is None else version)
    ckpt = Checkpoint.load(ckpt_dir)  # its files checked against its checkpoint.json
    staging = store.staging_dir(Path(root), version)
    try:
        with naming(Path(root) / version):  # an error naming no file (a full disk) names the bundle
            fields = _write_files(ckpt, staging, version, ef_search, n_parity, encoder_dtype,
                                  vector_dtype or ckpt.config.get("vector_dtype", "float32"))
            store.write_manifest(staging, fields)
            staged = Bundle.open(staging, staged=True)
            predictor = Predictor(staged)
            texts = [r["text"] for r in ckpt.validation[:CANARY_QUERIES]] or list(ckpt.labels.titles[:CANARY_QUERIES])
            fields["canary"] = [c.model_dump() for c in canary.record(predictor, texts)]
            if ckpt.validation:
                fields["metrics"]["validation"] = validation_metrics(predictor, staged.validation_rows())
            staged.close()
            store.write_manifest(staging, fields)
            check_staged(staging, Path(root) / version)
            final = store.finalize_bundle(staging, Path(root), version)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("bundle %s written and checked in %.1fs", final, time.perf_counter() - t0)
    return final


def check_options(ef_search: int | None, n_parity: int) -> None:
    """The numeric options, checked before any work (ValueError naming the flag): a bad one used
    to surface after the whole export, as pydantic's report on the manifest, or not at all (0
    parity texts turned the ONNX parity check off)."""
    if n_parity < 1:
        raise ValueError(f"--parity-texts must be >= 1 (texts the ONNX encoder is checked on against torch), "
                         f"got {n_parity}")
    if ef_search is not None and not 1 <= ef_search <= schema.MAX_EF_SEARCH:
        raise ValueError(f"--ef-search must be in [1, {schema.MAX_EF_SEARCH}] (candidates an HNSW search keeps), "
                         f"got {ef_search}")


def _write_files(ckpt: Checkpoint, staging: Path, version: str, ef_search: int | None,
                 n_parity: int, encoder_dtype: str, vector_dtype: str) -> dict[str, Any]:
    """Every file of the bundle but the manifest; returns the manifest's fields."""
    export_encoder(ckpt.encoder, staging / schema.ENCODER, encoder_dtype)
    texts = parity_texts(ckpt.tokenizer, [*(r["text"] for r in ckpt.validation), *ckpt.labels.titles], n_parity)
    worst = check_parity(as_served(ckpt.encoder, encoder_dtype), staging / schema.ENCODER, ckpt.tokenizer, texts)
    log.info("onnx parity: max |onnxruntime - torch| = %.2e over %d texts", worst, len(texts))
    ckpt.tokenizer.save(staging / schema.TOKENIZER)
    ckpt.labels.save(staging / schema.LABELS)
    w, b, mu = ckpt.classifiers.weights_, ckpt.classifiers.bias_, ckpt.centroids.vectors_
    np.save(staging / schema.CLASSIFIER_BIAS, np.ascontiguousarray(b, dtype=np.float32))
    for name, array in ((schema.CLASSIFIERS, w), (schema.CENTROIDS, mu)):
        values, scales = vectors.quantize(array, vector_dtype)
        np.save(staging / name, values)
        if scales is not None:
            np.save(staging / schema.SCALES_FILES[name], scales)
    index_w, index_mu = ckpt.indices or build_label_indices(w, b, mu, ckpt.hnsw, ckpt.seed)
    index_w.save(staging / schema.HNSW_W)
    index_mu.save(staging / schema.HNSW_MU)
    if ckpt.token_table is not None:
        for name, array in lexical_files(ckpt.token_table).items():
            np.save(staging / name, array)
    if ckpt.tree is not None:
        arrays = dict(ckpt.tree.arrays_)
        arrays["classifier_weights"], scales = vectors.quantize(arrays["classifier_weights"], vector_dtype)
        if scales is not None:
            arrays["classifier_scales"] = scales
        np.savez(staging / schema.TREE, **arrays)  # stored, not compressed: the engine maps its big members
    if ckpt.validation:
        with (staging / schema.VALIDATION).open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in ckpt.validation)
    hnsw = ckpt.hnsw if ef_search is None else ckpt.hnsw.model_copy(update={"ef_search": ef_search})
    return {
        "version": version, "dim": int(w.shape[1]), "num_labels": int(w.shape[0]),
        "vocab_size": ckpt.tokenizer.vocab_size, "text_field": ckpt.text_field,
        "scoring": ckpt.scoring.model_dump(), "hnsw": hnsw.model_dump(), "data_fingerprint": ckpt.fingerprint,
        "training_config": ckpt.config, "metrics": {"training": ckpt.metrics, "onnx_parity_max_abs": worst,
                    "encoder_table_dtype": encoder_dtype},
        "vector_dtype": vector_dtype,
    }


def validation_metrics(predictor: Predictor, rows: list[dict]) -> dict[str, float]:
    """P@k / nDCG@k and shortlist recall of the engine on held-out rows, recorded at export (the
    activation's quality gate scores a served bundle itself: service.api.quality_gate)."""
    texts = [r["text"] for r in rows]
    truths, weights = validation_truths(rows)
    ids, _ = predictor.predict_ids(texts, k=5)
    out = ranking_metrics(ids, Truths(truths, weights=weights), ks=(1, 3, 5))
    out["recall@shortlist"] = shortlist_recall(predictor.shortlist(texts), truths)
    return {k: round(v, 4) for k, v in out.items()}


def run_cli(args: argparse.Namespace) -> int:
    """`shortlist export`: every option checked before any work, the version too. A name the
    server's state directory holds (SHORTLIST_STATE_DIR: its label changes' versions) is refused
    like one the bundle root holds: the server would see one name in two places."""
    check_options(args.ef_search, args.parity_texts)
    if args.version == "":
        raise ValueError("--version: empty; give a name, or leave --version out for a UTC timestamp")
    version = default_version() if args.version is None else args.version
    try:
        offline_store(args.out).check_free(version)
    except schema.BundleError as exc:
        raise ValueError(f"--version {version}: {exc}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    export_checkpoint(args.checkpoint, args.out, version, ef_search=args.ef_search, n_parity=args.parity_texts,
                      encoder_dtype=args.encoder_dtype or DEFAULT_TABLE_DTYPE, vector_dtype=args.vector_dtype)
    return 0
