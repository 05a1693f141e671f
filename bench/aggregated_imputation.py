"""EAGLE's imputation alone, no training: the variants side by side on grouped data.

    python bench/aggregated_imputation.py --data ../shared/data/debian-deps --group-size 4 --grouping random
        [--variants paper center+text center+text+relative+auto center+text+relative:r=0.5 ...]

A variant is flags joined by '+' (paper: none; center: centred features; text: label texts as
groups of one; expected: expected-count assignment instead of the closest member; relative: the
relative assignment; auto: the iterations, and the relative assignment's keep ratio unless given,
chosen on held-out groups), then optionally ':T=<iterations>' (default 10), ':lambda=<step>'
(default 0.5) and ':r=<keep ratio>'. For each variant it prints:
- the group-level validation (what a user without per-document labels can compute): the labels
  of 10% of the groups held out while the vectors are learnt, each held-out group's labels
  ranked by the best score among its members; its P@1 after 0, 1, ..., T iterations, and the
  iterations the variant uses (with auto the best of those, the fewest on ties; else T) and the
  keep ratio of the relative assignment;
- the imputed labels' precision and recall against the true per-document labels (a diagnostic
  that needs the truth: the groups are made from an ordinary dataset), and the seconds taken.
With --token-lookup-baseline each variant is also imputed with every (pair, member) score looked up
token by token (training.eagle_space.BLOCK_FILL past any run's fill: no sparse product of a
group's members with its labels), in the same run: the seconds both ways, their ratio, and
whether the two imputations are identical.
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
from training import eagle_space
from training.aggregate_data import clustered_groups, random_groups
from training.aggregated import tfidf_spaces
from training.config import TrainConfig
from training.dataset import target_matrix
from training.eagle import EagleImputer

HELD_OUT = 0.1


@dataclass
class Variant:
    name: str
    center: bool
    text: bool
    assignment: str
    auto: bool
    iterations: int
    step: float
    keep_ratio: float | None

    @classmethod
    def parse(cls, spec: str) -> Variant:
        flags, *params = spec.split(":")
        names = set(flags.split("+")) - {"paper"}
        unknown = names - {"center", "text", "expected", "relative", "auto"}
        if unknown:
            raise ValueError(f"unknown variant flags {sorted(unknown)} in {spec!r}")
        values = dict(p.split("=", 1) for p in params)
        assignment = next((a for a in ("expected", "relative") if a in names), "closest")
        ratio = float(values["r"]) if "r" in values else None
        return cls(spec, "center" in names, "text" in names, assignment, "auto" in names, int(values.get("T", 10)),
                   float(values.get("lambda", 0.5)), ratio)

    def imputer(self, validation: float) -> EagleImputer:
        return EagleImputer(self.iterations, self.step, 0, self.assignment, self.center, validation,
                            self.keep_ratio)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--grouping", default="random", choices=["random", "clustered"])
    ap.add_argument("--variants", nargs="+",
                    default=["paper", "center+text+expected+auto", "center+text+relative+auto"])
    ap.add_argument("--token-lookup-baseline", action="store_true",
                    help="also impute with every score looked up token by token, and compare")
    args = ap.parse_args(argv)
    variants = [Variant.parse(v) for v in args.variants]
    labels = xc_data.load_labels(args.data)
    trn = xc_data.load_split(args.data, "trn", "title", len(labels))
    truth = target_matrix(trn.targets, len(labels))
    truth.data[:] = 1.0
    x, z = tfidf_spaces(trn.texts, labels.texts, TrainConfig())
    group_of = (random_groups(len(trn), args.group_size, 0) if args.grouping == "random"
                else clustered_groups(x, args.group_size, 0))
    members = sp.csr_matrix((np.ones(len(trn), np.float32), (group_of, np.arange(len(trn)))))
    group_labels = sp.csr_matrix(members @ truth)
    group_labels.data[:] = 1.0
    naive = sp.csr_matrix(members.T @ group_labels)
    print(f"{args.data.name} {args.grouping}-{args.group_size}: {members.shape[0]} groups, {group_labels.nnz} "
          f"(group, label) pairs; naive precision {naive.multiply(truth).sum() / naive.sum():.3f}")
    print("| variant | group P@1 after 0, 1, ..., T iterations | iterations used | keep ratio | imputed precision | "
          "imputed recall | imputation (s) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for v in variants:
        curve = EagleImputer(v.iterations, v.step, 0, "closest", v.center, HELD_OUT).fit(
            x, members, group_labels, z if v.text else None).validation_scores_
        imputer, labels_imputed, seconds = _impute(v, x, members, group_labels, z)
        imputed = target_matrix(labels_imputed, len(labels))
        hits = imputed.multiply(truth).sum()
        ratio = imputer.keep_ratio_ if v.assignment == "relative" else ""
        print(f"| {v.name} | {' '.join(f'{100 * p:.1f}' for p in curve)} | {imputer.iterations_} | {ratio} | "
              f"{hits / imputed.sum():.3f} | {hits / truth.sum():.3f} | {seconds:.1f} |", flush=True)
        if args.token_lookup_baseline:
            product_way = eagle_space.BLOCK_FILL
            eagle_space.BLOCK_FILL = float("inf")
            try:
                _, baseline_labels, baseline_s = _impute(v, x, members, group_labels, z)
            finally:
                eagle_space.BLOCK_FILL = product_way
            same = baseline_labels == labels_imputed
            print(f"  {v.name}: token by token {baseline_s:.1f} s, by products {seconds:.1f} s "
                  f"({baseline_s / seconds:.2f}x); identical imputations: {same}", flush=True)
    return 0


def _impute(v: Variant, x: sp.csr_matrix, members: sp.csr_matrix, group_labels: sp.csr_matrix,
            z: sp.csr_matrix) -> tuple[EagleImputer, list[list[int]], float]:
    started = time.monotonic()
    imputer = v.imputer(HELD_OUT if v.auto else 0.0).fit(x, members, group_labels, z if v.text else None)
    imputed = imputer.impute()
    return imputer, imputed, time.monotonic() - started


if __name__ == "__main__":
    sys.exit(main())
