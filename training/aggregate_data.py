"""`shortlist data aggregate`: grouped data (training/grouped.py) made from an ordinary dataset, so
training from aggregated labels can be measured against the true per-document labels.

Groups of `group_size` training documents, each group labelled with the union of its members'
labels; the per-document labels are left out. grouping "random": documents in a seeded random
order; "clustered": leaves of a balanced hierarchical 2-means on the documents' TF-IDF rows (as
in the EAGLE paper), so a group's members are alike and its labels harder to tell apart.
`lbl` and `tst` are copied unchanged (the test split keeps per-document labels to measure on).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from training import data as xc_data
from training.aggregated import tfidf_features
from training.config import TrainConfig
from training.files import StagedFiles

GROUPINGS = ("random", "clustered")
_TWO_MEANS_ITERATIONS = 5


def random_groups(num_docs: int, group_size: int, seed: int) -> np.ndarray:
    """Group row of each document: consecutive runs of a seeded permutation."""
    group_of = np.empty(num_docs, dtype=np.int64)
    group_of[np.random.default_rng(seed).permutation(num_docs)] = np.arange(num_docs) // group_size
    return group_of


def clustered_groups(features: sp.csr_matrix, group_size: int, seed: int) -> np.ndarray:
    """Group row of each document: leaves of a balanced hierarchical spherical 2-means, split
    until a cluster holds at most group_size documents (left halves hold multiples of it, so
    leaves are full groups but for one per branch)."""
    rng = np.random.default_rng(seed)
    group_of = np.empty(features.shape[0], dtype=np.int64)
    stack, groups = [np.arange(features.shape[0])], 0
    while stack:
        idx = stack.pop()
        if len(idx) <= group_size:
            group_of[idx] = groups
            groups += 1
            continue
        left, right = _split_two_means(features[idx], group_size, rng)
        stack.extend((idx[right], idx[left]))
    return group_of


def _split_two_means(x: sp.csr_matrix, group_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = x.shape[0]
    left_size = group_size * -(-n // group_size // 2) if n > group_size else n
    left_size = min(max(group_size, left_size), n - 1)
    centres = x[rng.choice(n, size=2, replace=False)].toarray()
    for _ in range(_TWO_MEANS_ITERATIONS):
        order = np.argsort(-(x @ (centres[0] - centres[1])), kind="stable")
        left, right = order[:left_size], order[left_size:]
        centres = np.vstack([np.asarray(x[left].mean(axis=0)), np.asarray(x[right].mean(axis=0))])
        centres /= np.maximum(np.linalg.norm(centres, axis=1, keepdims=True), 1e-12)
    return left, right


def aggregate(data_dir: Path, out: Path, group_size: int, grouping: str, seed: int = 0) -> dict[str, int]:
    if group_size < 1:
        raise ValueError(f"group size must be >= 1, got {group_size}")
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
    if out.is_dir() and data_dir.is_dir() and os.path.samefile(out, data_dir):
        # the grouped trn.json.gz would replace the documents' own labels, the data it was made from
        raise ValueError(f"--out {out}: is the --data folder; grouped data goes to a folder of its own")
    labels = xc_data.load_labels(data_dir)
    trn_path = xc_data.find_split_file(data_dir, "trn")
    trn = xc_data.load_split(data_dir, "trn", "title", len(labels))
    if not any(trn.targets):  # every group would carry none: grouped data nothing can be imputed from
        raise ValueError(f"{trn_path}: no training document has a label (target_ind is empty in all {len(trn)})")
    if grouping == "random":
        group_of = random_groups(len(trn), group_size, seed)
    else:
        group_of = clustered_groups(tfidf_features(trn.texts, labels.texts, TrainConfig()), group_size, seed)
    out.mkdir(parents=True, exist_ok=True)
    rows = [row for _, row in xc_data.iter_rows(trn_path)]
    group_targets: dict[int, dict[int, None]] = {}
    for group, targets in zip(group_of.tolist(), trn.targets, strict=True):
        group_targets.setdefault(group, {}).update(dict.fromkeys(targets))
    documents = ({**{k: v for k, v in row.items() if k not in ("target_ind", "target_rel")}, "group": f"g{group}"}
                 for row, group in zip(rows, group_of.tolist(), strict=True))
    with StagedFiles(out) as files:  # a failure (a full disk) leaves no truncated file under its name
        files.write_gz_lines("trn.json.gz", (json.dumps(doc, ensure_ascii=False) for doc in documents))
        files.write_gz_lines("groups.json.gz", (json.dumps({"uid": f"g{g}", "target_ind": list(group_targets[g])})
                                                for g in sorted(group_targets)))
        for split in ("lbl", "tst"):
            path = xc_data.find_split_file(data_dir, split)
            if path is not None:
                files.copy(path.name, path)
    return {"documents": len(trn), "groups": len(group_targets)}


def run_cli(args: argparse.Namespace) -> int:
    counts = aggregate(Path(args.data), Path(args.out), args.group_size, args.grouping, args.seed)
    print(json.dumps({"out": args.out, "grouping": args.grouping, "group_size": args.group_size, **counts}))
    return 0
