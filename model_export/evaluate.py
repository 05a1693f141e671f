"""`shortlist eval`: metrics of a bundle through the serving engine (what is measured is what is served)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from service.engine import Bundle, Predictor
from service.engine.metrics import label_frequencies, propensities, ranking_metrics, shortlist_recall
from training.data import load_split

EVAL_BATCH = 256


def evaluate_bundle(
    bundle_dir: str | Path,
    data_dir: str | Path,
    split: str = "tst",
    text_field: str | None = None,
    scorer: str = "alpha",
    alpha: float | None = None,
    limit: int | None = None,
    predictor: Predictor | None = None,
) -> dict[str, Any]:
    """P@1/3/5, nDCG@1/3/5, PSP@1/3/5 (propensities from trn), shortlist recall and queries/s."""
    if predictor is None:
        predictor = Predictor(Bundle.load(bundle_dir))
    manifest = predictor.bundle.manifest
    field = text_field or manifest.text_field
    num_labels = manifest.num_labels
    docs = load_split(data_dir, split, field, num_labels=num_labels)
    if limit is not None:
        docs = docs.subset(list(range(min(limit, len(docs)))))
    trn = docs if split == "trn" else load_split(data_dir, "trn", field, num_labels=num_labels)
    inv_prop = 1.0 / propensities(label_frequencies(trn.targets, num_labels), len(trn))

    ids = np.empty((len(docs), 5), dtype=np.int64)
    t0 = time.perf_counter()
    for start in range(0, len(docs), EVAL_BATCH):
        batch = docs.texts[start : start + EVAL_BATCH]
        if scorer == "tree":
            ids[start : start + len(batch)] = predictor.predict_tree_ids(batch, k=5)[0]
        else:
            ids[start : start + len(batch)] = predictor.predict_ids(batch, k=5, alpha=alpha)[0]
    elapsed = time.perf_counter() - t0
    out: dict[str, Any] = {
        "bundle": predictor.version,
        "split": split,
        "scorer": scorer,
        "documents": len(docs),
    }
    out.update(ranking_metrics(ids, docs.targets, ks=(1, 3, 5), inv_propensity=inv_prop))
    if scorer == "alpha":
        shortlists = []
        for start in range(0, len(docs), EVAL_BATCH):
            shortlists.extend(predictor.shortlist(docs.texts[start : start + EVAL_BATCH]))
        out["recall@shortlist"] = shortlist_recall(shortlists, docs.targets)
        out["shortlist_size_mean"] = float(np.mean([len(s) for s in shortlists])) if shortlists else 0.0
    out["queries_per_s"] = len(docs) / elapsed if elapsed > 0 else 0.0
    return out


def run_cli(args: argparse.Namespace) -> int:
    result = evaluate_bundle(
        args.bundle, args.data, args.split, args.text_field, args.scorer, args.alpha, args.limit
    )
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"bundle {result['bundle']}  split {result['split']}  scorer {result['scorer']}  "
          f"documents {result['documents']}")
    for name in ("P@1", "P@3", "P@5", "nDCG@1", "nDCG@3", "nDCG@5", "PSP@1", "PSP@3", "PSP@5",
                 "recall@shortlist", "queries_per_s"):
        if name in result:
            print(f"  {name:<18} {result[name]:10.2f}")
    return 0
