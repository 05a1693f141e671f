"""`shortlist export`: a training checkpoint -> an immutable, validated, versioned bundle."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from model_export.onnx_export import check_parity, export_encoder, parity_texts
from service.engine import bundle as fmt
from service.engine.bundle import Bundle, BundleError
from service.engine.index import VectorIndex
from service.engine.metrics import ranking_metrics, shortlist_recall
from service.engine.predictor import Predictor
from training.checkpoint import Checkpoint

CANARY_QUERIES = 3
DEFAULT_EF_SEARCH = 50


@dataclass(frozen=True)
class HnswConfig:
    M: int = 24
    ef_construction: int = 200
    ef_search: int | None = None  # default: the larger HNSW shortlist size

    def resolved_ef(self, k_w: int, k_mu: int) -> int:
        # With both HNSW sources off by default the indices still ship; searched later, they
        # should start from a breadth that finds neighbours, not ef 1.
        return max(self.ef_search or 0, k_w, k_mu) or DEFAULT_EF_SEARCH


def default_version() -> str:
    return datetime.now(UTC).strftime("v%Y%m%d-%H%M%S")


def export_checkpoint(
    ckpt_dir: str | Path,
    root: str | Path,
    version: str | None = None,
    ef_search: int | None = None,
    n_parity: int = 1000,
    log=print,
) -> Path:
    """Write ROOT/VERSION from a checkpoint; returns the bundle path after loading it back."""
    t0 = time.perf_counter()
    ckpt = Checkpoint.load(ckpt_dir)
    _check_shapes(ckpt, Path(ckpt_dir))
    version = fmt.validate_version_name(version or default_version())
    root = Path(root)
    if (root / version).exists():
        raise BundleError(f"bundle {root / version} already exists; bundles are immutable, pick another version")
    hnsw_cfg = dict(ckpt.config.get("hnsw", {}))
    if ef_search is not None:
        hnsw_cfg["ef_search"] = ef_search
    hnsw = HnswConfig(**hnsw_cfg)
    scoring = _with_head(ckpt)
    shortlist = scoring["shortlist"]
    ef_search = hnsw.resolved_ef(shortlist["k_w"], shortlist["k_mu"])
    staging = fmt.staging_dir(root, version)
    try:
        export_encoder(ckpt.encoder, staging / fmt.ENCODER)
        texts = parity_texts(ckpt.tokenizer, [*(r["text"] for r in ckpt.validation), *ckpt.labels.titles], n_parity)
        worst = check_parity(ckpt.encoder, staging / fmt.ENCODER, ckpt.tokenizer, texts)
        log(f"onnx parity: max |onnxruntime - torch| = {worst:.2e} over {len(texts)} texts")

        ckpt.tokenizer.save(staging / fmt.TOKENIZER)
        ckpt.labels.save(staging / fmt.LABELS)
        w = np.ascontiguousarray(ckpt.classifiers, dtype=np.float32)
        b = np.ascontiguousarray(ckpt.classifier_bias, dtype=np.float32)
        mu = np.ascontiguousarray(ckpt.centroids, dtype=np.float32)
        np.save(staging / fmt.CLASSIFIERS, w)
        np.save(staging / fmt.CLASSIFIER_BIAS, b)
        np.save(staging / fmt.CENTROIDS, mu)
        seed = int(ckpt.config.get("seed", 0))
        t = time.perf_counter()
        # The bias rides along as one more coordinate, matched by a constant 1 in the query.
        VectorIndex.build(np.hstack([w, b[:, None]]), hnsw.M, hnsw.ef_construction, ef_search, seed).save(
            staging / fmt.HNSW_W
        )
        VectorIndex.build(mu, hnsw.M, hnsw.ef_construction, ef_search, seed).save(staging / fmt.HNSW_MU)
        log(f"hnsw indices built in {time.perf_counter() - t:.1f}s (M={hnsw.M}, efC={hnsw.ef_construction})")
        if "tree" in ckpt.extra_arrays:
            np.savez(staging / fmt.TREE, **ckpt.extra_arrays["tree"])
        if "token_shortlist" in ckpt.extra_arrays:
            table = ckpt.extra_arrays["token_shortlist"]
            np.save(staging / fmt.TOKEN_SHORTLIST, np.ascontiguousarray(table["labels"], dtype=np.int32))
            # The checkpoint's array names are the bundle's file names without the prefix.
            for name in fmt.LEXICAL_FILES[scoring.get("lexical_form", "shares")]:
                key = name.removeprefix("token_shortlist_").removesuffix(".npy")
                if key in table:
                    np.save(staging / name, np.ascontiguousarray(table[key], dtype=np.float32))
        if ckpt.validation:
            with (staging / fmt.VALIDATION).open("w", encoding="utf-8") as f:
                for row in ckpt.validation:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")

        fields = {
            "version": version,
            "dim": int(w.shape[1]),
            "num_labels": int(w.shape[0]),
            "vocab_size": ckpt.tokenizer.vocab_size,
            "text_field": ckpt.config.get("text_field", "title"),
            "scoring": scoring,
            "hnsw": {"M": hnsw.M, "ef_construction": hnsw.ef_construction, "ef_search": ef_search},
            "tree_default_beam": _tree_beam(ckpt),
            "data_fingerprint": ckpt.fingerprint,
            "training_config": ckpt.config,
            "metrics": {"training": ckpt.metrics, "onnx_parity_max_abs": worst},
        }
        fmt.write_manifest(staging, fields)
        staged = Bundle.load(staging, canary=False, staged=True)
        predictor = Predictor(staged)
        fields["canary"] = _canary(predictor, ckpt)
        if ckpt.validation:
            fields["metrics"]["validation"] = validation_metrics(predictor, staged.validation_rows())
        staged.close()
        final = fmt.finalize_bundle(staging, root, fields)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    Bundle.load(final).close()  # what was written must pass the same validation the service runs
    log(f"bundle {final} written and validated in {time.perf_counter() - t0:.1f}s")
    return final


DEFAULT_K_HEAD = 32


def _with_head(ckpt: Checkpoint) -> dict:
    """Scoring defaults with k_head set (the checkpoint's, else 32 when classifiers carry a prior,
    a bias) and, with a served token shortlist, the head as its fallback."""
    scoring = json.loads(json.dumps(ckpt.scoring))
    shortlist = scoring["shortlist"]
    if "k_head" not in shortlist:
        has_prior = bool(np.any(ckpt.classifier_bias != 0))
        shortlist["k_head"] = min(DEFAULT_K_HEAD, len(ckpt.labels)) if has_prior else 0
    if "head" not in shortlist and shortlist.get("k_tok", 0) and "token_shortlist" in ckpt.extra_arrays:
        # The token rows already hold the head labels a query's words point to (bundle.py).
        shortlist["head"] = "fallback"
    return scoring


def _check_shapes(ckpt: Checkpoint, ckpt_dir: Path) -> None:
    L, D = len(ckpt.labels), ckpt.encoder.dim
    expected = {"classifiers.npy": (L, D), "classifier_bias.npy": (L,), "centroids.npy": (L, D)}
    found = {"classifiers.npy": ckpt.classifiers, "classifier_bias.npy": ckpt.classifier_bias,
             "centroids.npy": ckpt.centroids}
    for name, shape in expected.items():
        if found[name].shape != shape:
            raise ValueError(
                f"{ckpt_dir / name}: shape {found[name].shape}, expected {shape} ({L} labels, dim {D})"
            )


def _tree_beam(ckpt: Checkpoint) -> int | None:
    tree = ckpt.extra_arrays.get("tree")
    if tree is None or "default_beam" not in tree:
        return None
    return int(np.asarray(tree["default_beam"]))


def _canary(predictor: Predictor, ckpt: Checkpoint) -> list[dict]:
    texts = [r["text"] for r in ckpt.validation[:CANARY_QUERIES]] or list(ckpt.labels.titles[:CANARY_QUERIES])
    ids, scores = predictor.predict_ids(texts, k=5)
    return [
        {"text": t, "top_ids": [int(i) for i in row_ids if i >= 0], "top_scores": [float(s) for s in row_scores]}
        for t, row_ids, row_scores in zip(texts, ids, scores, strict=True)
    ]


def validation_metrics(predictor: Predictor, rows: list[dict]) -> dict[str, float]:
    """P@k / nDCG@k and shortlist recall of the engine on held-out rows (the quality gate's yardstick)."""
    texts = [r["text"] for r in rows]
    truths = [r["target_ind"] for r in rows]
    ids, _ = predictor.predict_ids(texts, k=5)
    out = ranking_metrics(ids, truths, ks=(1, 3, 5))
    out["recall@shortlist"] = shortlist_recall(predictor.shortlist(texts), truths)
    return {k: round(v, 4) for k, v in out.items()}


def run_cli(args: argparse.Namespace) -> int:
    export_checkpoint(args.checkpoint, args.out, args.version, ef_search=args.ef_search, n_parity=args.parity_texts)
    return 0
