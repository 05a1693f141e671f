"""The training checkpoint directory: what `shortlist train` writes and `shortlist export` reads.

Layout of CKPT_DIR:
  checkpoint.json        format, dims, hyper-parameters, scoring defaults, data fingerprint, metrics
  tokenizer.json         service.engine.tokenizer.Tokenizer
  labels.jsonl           service.engine.labels.LabelTable (row i = label i)
  encoder.pt             state_dict of training.encoder.SiameseEncoder
  classifiers.npy        [L, D] float32, w_l
  classifier_bias.npy    [L] float32, b_l (zeros for the paper's form)
  centroids.npy          [L, D] float32, mu_l (unit rows; a label with no document has a zero row,
                         or its text embedding when training.train.TrainConfig.centroid_label_weight > 0)
  validation.jsonl       optional: held-out {"text", "target_ind"} rows for a bundle's quality gate
  tree.npz, tree_classifier.npz   optional: the adversarial tree scorer
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.engine.labels import LabelTable
from service.engine.tokenizer import Tokenizer
from training.encoder import SiameseEncoder

CHECKPOINT_FORMAT = 1


@dataclass
class Checkpoint:
    tokenizer: Tokenizer
    labels: LabelTable
    encoder: SiameseEncoder
    classifiers: np.ndarray
    classifier_bias: np.ndarray
    centroids: np.ndarray
    # Scoring defaults carried into the bundle: {"alpha", "classifier_form",
    # "calibration": {"classifier": {...}, "centroid": {...}}, "shortlist": {...}}
    scoring: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    validation: list[dict[str, Any]] = field(default_factory=list)
    extra_arrays: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    def save(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        L, D = self.classifiers.shape
        meta = {
            "format": CHECKPOINT_FORMAT,
            "dim": D,
            "num_labels": L,
            "vocab_size": self.tokenizer.vocab_size,
            "scoring": self.scoring,
            "config": self.config,
            "fingerprint": self.fingerprint,
            "metrics": self.metrics,
            "extra_arrays": sorted(self.extra_arrays),
        }
        self.tokenizer.save(out / "tokenizer.json")
        self.labels.save(out / "labels.jsonl")
        torch.save(self.encoder.state_dict(), out / "encoder.pt")
        np.save(out / "classifiers.npy", np.ascontiguousarray(self.classifiers, dtype=np.float32))
        np.save(out / "classifier_bias.npy", np.ascontiguousarray(self.classifier_bias, dtype=np.float32))
        np.save(out / "centroids.npy", np.ascontiguousarray(self.centroids, dtype=np.float32))
        if self.validation:
            with (out / "validation.jsonl").open("w", encoding="utf-8") as f:
                for row in self.validation:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        for name, arrays in self.extra_arrays.items():
            np.savez(out / f"{name}.npz", **arrays)
        (out / "checkpoint.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
        return out

    @classmethod
    def load(cls, ckpt_dir: str | Path) -> Checkpoint:
        ckpt = Path(ckpt_dir)
        meta_path = ckpt / "checkpoint.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{ckpt}: not a checkpoint directory (no checkpoint.json)")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{meta_path}: checkpoint format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT}")
        tokenizer = Tokenizer.load(ckpt / "tokenizer.json")
        encoder = SiameseEncoder(meta["vocab_size"], meta["dim"])
        encoder.load_state_dict(torch.load(ckpt / "encoder.pt", map_location="cpu", weights_only=True))
        encoder.eval()
        validation: list[dict[str, Any]] = []
        if (ckpt / "validation.jsonl").is_file():
            with (ckpt / "validation.jsonl").open(encoding="utf-8") as f:
                validation = [json.loads(line) for line in f]
        extra = {}
        for name in meta.get("extra_arrays", []):
            with np.load(ckpt / f"{name}.npz") as z:
                extra[name] = {k: z[k] for k in z.files}
        return cls(
            tokenizer=tokenizer,
            labels=LabelTable.load(ckpt / "labels.jsonl"),
            encoder=encoder,
            classifiers=np.load(ckpt / "classifiers.npy"),
            classifier_bias=np.load(ckpt / "classifier_bias.npy"),
            centroids=np.load(ckpt / "centroids.npy"),
            scoring=meta["scoring"],
            config=meta.get("config", {}),
            fingerprint=meta.get("fingerprint", {}),
            metrics=meta.get("metrics", {}),
            validation=validation,
            extra_arrays=extra,
        )
