"""Module III's negatives at one L: every label against each document's Module II shortlist.

    python bench/module3.py --data DIR [--variants all,shortlist] [--epochs N] [--config FILE]
                            [--sample 1000] [--out FILE]

Trains Module I once with the pipeline's settings, then Module III from a copy of that encoder
for each variant (a name in VARIANTS, or NAME=JSON of TrainConfig overrides), and prints per
variant: seconds per epoch (Module II's shortlist charged to the shortlist variants), the mean
loss of each epoch, and exact P@1 / P@5 over all labels of the classifiers alone on `sample`
validation documents, beside Module I's label embeddings (the classifiers' starting point) and
the centroids. A variant that costs most of training should beat its starting point.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import command_line, git_revision

from service.engine.scorers import Calibration, LabelScorer
from training.ann import AnnParams
from training.centroids import Centroids, hard_negative_shortlists
from training.classifiers import OneVsAll
from training.config import TrainConfig
from training.dataset import TrainingSet
from training.encoder import EncodedTexts, SiameseEncoder, embed
from training.siamese import SiameseTrainer
from training.tuning import exact_metrics

CPU = torch.device("cpu")
IDENTITY = Calibration("identity")
VARIANTS: dict[str, dict[str, Any]] = {
    "all": {"m3_negatives": "all"},
    "shortlist": {"m3_negatives": "shortlist"},
    "shortlist_alone": {"m3_negatives": "shortlist", "m3_batch_negatives": False},  # no in-batch negatives
    "all_no_encoder": {"m3_negatives": "all", "m3_train_encoder": False},
    "all_lr_0.002": {"m3_negatives": "all", "m3_lr": 0.002},
    "all_no_decay": {"m3_negatives": "all", "m3_weight_decay": 0.0},
}


def parse_variants(text: str) -> dict[str, dict[str, Any]]:
    out = {}
    for item in (x for x in re.split(r",(?![^{]*})", text) if x):  # commas inside {...} are JSON's
        name, sep, spec = item.partition("=")
        out[name] = json.loads(spec) if sep else VARIANTS[name]
    return out


def _metrics(weights: np.ndarray, bias: np.ndarray, q: np.ndarray, truths) -> dict[str, float]:
    scorer = LabelScorer(weights, bias, weights, IDENTITY, IDENTITY)
    m = exact_metrics(scorer, q, truths, 1.0)
    return {"P@1": m["P@1"], "P@5": m["P@5"], "PSP@5": m["PSP@5"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--variants", default="all,shortlist")
    ap.add_argument("--epochs", type=int, default=None, help="Module III epochs of every variant (default: config)")
    ap.add_argument("--config", default=None, help="training config JSON (threads, seed, ...)")
    ap.add_argument("--sample", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--module1", type=Path, default=None,
                    help="Module I's encoder: loaded from this file if it exists, else trained and saved there")
    args = ap.parse_args(argv)
    cfg = TrainConfig.from_json(args.config) if args.config else TrainConfig()
    if args.epochs is not None:
        cfg = replace(cfg, m3_epochs=args.epochs)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    data = TrainingSet.load(args.data, cfg, "title", rng)
    ann = AnnParams(cfg.hnsw_m, cfg.hnsw_ef_construction, cfg.hnsw_ef, max(1, cfg.threads))
    encoder = SiameseEncoder(data.tokenizer.vocab_size, cfg.dim, seed=cfg.seed)
    t0 = time.perf_counter()
    if args.module1 is not None and args.module1.is_file():
        encoder.load_state_dict(torch.load(args.module1))
    else:
        SiameseTrainer.of(cfg, ann).fit(encoder, data.docs, data.label_texts, data.y, CPU, rng)
        if args.module1 is not None:
            torch.save(encoder.state_dict(), args.module1)
    module1_s = time.perf_counter() - t0
    label_emb, doc_emb = embed(encoder, data.label_texts, CPU), embed(encoder, data.docs, CPU)
    mu = Centroids(cfg.centroid_label_weight).fit(doc_emb, data.y, label_emb).vectors_
    n = min(args.sample, len(data.val))
    val = EncodedTexts(data.val_texts.ids[:n], data.val_texts.weights[:n])
    truths = data.truths(data.val.subset(list(range(n))))
    q = embed(encoder, val, CPU)
    zeros = np.zeros(data.num_labels, np.float32)
    results: dict[str, Any] = {
        "command": command_line(), "revision": git_revision(), "labels": data.num_labels, "documents": len(data.trn),
        "module1_s": round(module1_s, 1), "label_embeddings": _metrics(label_emb, zeros, q, truths),
        "centroids": _metrics(mu, zeros, q, truths), "variants": {}}
    print(json.dumps({k: v for k, v in results.items() if k != "variants"}), flush=True)
    shortlist = None
    for name, overrides in parse_variants(args.variants).items():
        vcfg = TrainConfig.from_dict(overrides, cfg)
        m3 = OneVsAll.of(vcfg, data.num_labels)
        t0 = time.perf_counter()
        if m3.negatives == "shortlist" and shortlist is None:
            shortlist = hard_negative_shortlists(doc_emb, label_emb, mu, cfg.m2_k_w, cfg.m2_k_mu, ann, cfg.seed)
        module2_s = time.perf_counter() - t0 if m3.negatives == "shortlist" else 0.0
        enc = copy.deepcopy(encoder)
        t0 = time.perf_counter()
        m3.fit(enc, label_emb, data.docs, data.y, shortlist, CPU, np.random.default_rng(cfg.seed))
        fit_s = time.perf_counter() - t0
        row = {"overrides": overrides, "negatives": m3.negatives, "epochs": m3.epochs,
               "module2_s": round(module2_s, 1), "s_per_epoch": round(fit_s / max(m3.epochs, 1), 1),
               "losses": [round(x, 4) for x in m3.losses_],
               "classifiers": _metrics(m3.weights_, m3.bias_, embed(enc, val, CPU), truths)}
        results["variants"][name] = row
        print(json.dumps({name: row}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
