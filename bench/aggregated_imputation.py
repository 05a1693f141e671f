"""EAGLE's imputation alone, no training: the variants side by side on grouped data.

    python bench/aggregated_imputation.py --data ../shared/data/debian-deps --group-size 4 --grouping random
        [--variants paper paper:T=0 center center+text center+text:T=0 ...]

A variant is a name of flags joined by '+' (paper: none; center: centred features; text: label
texts as groups of one; expected: expected-count assignment instead of the closest member), then
optionally ':T=<iterations>' and ':lambda=<step>'. For each variant it prints:
- group-level validation (what a user without per-document labels can compute): label vectors
  fitted with 10% of the groups' labels held out; each held-out group's labels ranked by the best
  score among its members; P@1 and P@5 of that ranking against the group's labels;
- the imputed labels' precision and recall against the true per-document labels (a diagnostic
  that needs the truth: the groups are made from an ordinary dataset);
- the imputation's seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from training import data as xc_data
from training.aggregate_data import clustered_groups, random_groups
from training.aggregated import tfidf_spaces
from training.config import TrainConfig
from training.dataset import target_matrix
from training.eagle import EagleImputer

HELD_OUT = 0.1
CHUNK = 1024


@dataclass
class Variant:
    name: str
    center: bool
    text: bool
    assignment: str
    iterations: int
    step: float

    @classmethod
    def parse(cls, spec: str, cfg: TrainConfig) -> Variant:
        flags, *params = spec.split(":")
        names = set(flags.split("+")) - {"paper"}
        unknown = names - {"center", "text", "expected"}
        if unknown:
            raise ValueError(f"unknown variant flags {sorted(unknown)} in {spec!r}")
        values = dict(p.split("=", 1) for p in params)
        return cls(spec, "center" in names, "text" in names, "expected" if "expected" in names else "closest",
                   int(values.get("T", cfg.aggregated_iterations)), float(values.get("lambda", cfg.aggregated_step)))

    def imputer(self) -> EagleImputer:
        return EagleImputer(self.iterations, self.step, 0, self.assignment, self.center)


def group_validation(variant: Variant, x, z, members: sp.csr_matrix, group_labels: sp.csr_matrix,
                     seed: int = 0) -> tuple[float, float]:
    """(P@1, P@5) of held-out groups' labels ranked by their members' best label scores."""
    rng = np.random.default_rng(seed)
    held = np.sort(rng.choice(members.shape[0], max(1, int(HELD_OUT * members.shape[0])), replace=False))
    keep = np.ones(members.shape[0], np.float32)
    keep[held] = 0.0
    visible = sp.csr_matrix(sp.diags(keep) @ group_labels)
    visible.eliminate_zeros()
    imputer = variant.imputer().fit(x, members, visible, z if variant.text else None)
    known = np.diff(sp.csc_matrix(visible).indptr) > 0
    p1 = p5 = 0.0
    for s in range(0, len(held), CHUNK):
        groups = held[s : s + CHUNK]
        sub = members[groups]
        scores = imputer.scores(sub.indices)
        best = np.maximum.reduceat(scores, sub.indptr[:-1], axis=0)  # groups have members: no empty slice
        best[:, ~known] = -np.inf
        top = np.argsort(-best, axis=1)[:, :5]
        truth = group_labels[groups].toarray() > 0
        hit = np.take_along_axis(truth, top, axis=1)
        p1 += hit[:, 0].sum()
        p5 += hit.sum() / 5
    return 100 * p1 / len(held), 100 * p5 / len(held)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--grouping", default="random", choices=["random", "clustered"])
    ap.add_argument("--variants", nargs="+",
                    default=["paper", "paper:T=0", "center", "text", "center+text", "center+text:T=0",
                             "center+text+expected"])
    args = ap.parse_args(argv)
    cfg = TrainConfig()
    variants = [Variant.parse(v, cfg) for v in args.variants]
    labels = xc_data.load_labels(args.data)
    trn = xc_data.load_split(args.data, "trn", "title", len(labels))
    truth = target_matrix(trn.targets, len(labels))
    truth.data[:] = 1.0
    x, z = tfidf_spaces(trn.texts, labels.texts, cfg)
    group_of = (random_groups(len(trn), args.group_size, 0) if args.grouping == "random"
                else clustered_groups(x, args.group_size, 0))
    members = sp.csr_matrix((np.ones(len(trn), np.float32), (group_of, np.arange(len(trn)))))
    group_labels = sp.csr_matrix(members @ truth)
    group_labels.data[:] = 1.0
    print(f"{args.data.name} {args.grouping}-{args.group_size}: {members.shape[0]} groups, {group_labels.nnz} "
          f"(group, label) pairs; naive precision {_naive_precision(members, group_labels, truth):.3f}")
    print("| variant | T | group P@1 | group P@5 | imputed precision | imputed recall | imputation (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for v in variants:
        g1, g5 = group_validation(v, x, z, members, group_labels)
        started = time.monotonic()
        rows = v.imputer().fit(x, members, group_labels, z if v.text else None).impute()
        seconds = time.monotonic() - started
        imputed = target_matrix(rows, len(labels))
        hits = imputed.multiply(truth).sum()
        print(f"| {v.name} | {v.iterations} | {g1:.2f} | {g5:.2f} | {hits / imputed.sum():.3f} | "
              f"{hits / truth.sum():.3f} | {seconds:.1f} |", flush=True)
    return 0


def _naive_precision(members: sp.csr_matrix, group_labels: sp.csr_matrix, truth: sp.csr_matrix) -> float:
    naive = sp.csr_matrix(members.T @ group_labels)
    return float(naive.multiply(truth).sum() / naive.sum())


if __name__ == "__main__":
    sys.exit(main())
