"""Training from aggregated labels (EAGLE) against naive group labels and the true labels.

    python bench/aggregated.py --data ../shared/data/debian-tags [--group-sizes 2 4 8]
        [--groupings random clustered] [--protocol plain|own] [--no-second-round] [--publish]

For each group size and grouping, grouped data is made from the dataset (`shortlist data
aggregate`) and four models are trained and exported, then scored on the test split through
the served engine: (a) naive, each member gets all its group's labels; (b) EAGLE; (c) EAGLE
with a second round (re-imputed with the first model's encoder); (d) the true per-document
labels (once). Prints P@1 / P@5 / PSP@5, the share of the naive-to-true P@1 gap that EAGLE
recovers with a paired bootstrap interval, and imputation time against training time.
Every trained bundle is kept under --out, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

import _common
import numpy as np

from model_export.evaluate import filtered_pairs
from service.engine.metrics import Truths, aggregate, document_terms, label_frequencies, propensities
from service.engine.predictor import Predictor
from training import data as xc_data
from training.aggregate_data import aggregate as make_grouped
from training.config import TrainConfig

NAMES = ("P@1", "P@5", "PSP@5")


def _bundle(out: Path, name: str, build) -> tuple[Path, dict]:
    """out/name/bundle (trained by `build() -> Checkpoint` unless it exists) and its training metrics."""
    from model_export.export import export_checkpoint

    bundle, info = out / name / "bundle" / "b", out / name / "metrics.json"
    if not bundle.is_dir():
        logging.info("training %s", name)
        ckpt = build()
        export_checkpoint(ckpt.save(out / name / "ckpt"), bundle.parent, "b", n_parity=50)
        info.write_text(json.dumps(ckpt.metrics), encoding="utf-8")
    return bundle, json.loads(info.read_text(encoding="utf-8"))


def _naive_data(grouped: Path, dest: Path) -> Path:
    """An ordinary dataset: every member of a group labelled with all of the group's labels."""
    if (dest / "trn.json.gz").exists():
        return dest
    dest.mkdir(parents=True)
    groups = {r["uid"]: r["target_ind"] for _, r in xc_data.iter_rows(grouped / "groups.json.gz")}
    with gzip.open(dest / "trn.json.gz", "wt", encoding="utf-8") as f:
        for _, row in xc_data.iter_rows(grouped / "trn.json.gz"):
            f.write(json.dumps({**row, "target_ind": groups[str(row["group"])]}) + "\n")
    for name in ("lbl.json.gz", "tst.json.gz"):
        (dest / name).symlink_to((grouped / name).resolve())
    return dest


def _terms(bundle: Path, data: Path, protocol: str) -> dict[str, np.ndarray]:
    """Each test document's share of the metrics, through the served engine."""
    predictor = Predictor.load(bundle)
    labels = xc_data.load_labels(data)
    docs = xc_data.load_split(data, "tst", "title", len(labels))
    trn = xc_data.load_split(data, "trn", "title", len(labels))
    drop = filtered_pairs(protocol, docs, labels)
    truths = [[t for t in truth if t not in d] for truth, d in zip(docs.targets, drop, strict=True)]
    ids = np.concatenate([predictor.predict_ids(docs.texts[s : s + 512], k=5, exclude=drop[s : s + 512])[0]
                          for s in range(0, len(docs), 512)])
    inv = 1.0 / propensities(label_frequencies(trn.targets, len(labels)), len(trn))
    predictor.bundle.close()
    return document_terms(ids, Truths(truths, inv), ks=(1, 5))


def _gap_recovered(eagle: dict, naive: dict, true: dict, resamples: int = 1000) -> tuple[float, float, float]:
    """(E - N) / (T - N) on P@1, with a 95% paired bootstrap interval over test documents."""
    def ratio(rows: np.ndarray | None) -> float:
        e, n, t = (aggregate(s, rows, ["P@1"])["P@1"] for s in (eagle, naive, true))
        return (e - n) / (t - n) if t != n else float("nan")

    size = len(eagle["P@1"])
    rng = np.random.default_rng(0)
    draws = [ratio(rng.integers(0, size, size)) for _ in range(resamples)]
    low, high = np.nanpercentile(draws, [2.5, 97.5])
    return ratio(None), float(low), float(high)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--groupings", nargs="+", default=["random", "clustered"], choices=["random", "clustered"])
    ap.add_argument("--protocol", default="plain", choices=["plain", "own"])
    ap.add_argument("--config", type=Path, default=None, help="training config JSON (default: the defaults)")
    ap.add_argument("--no-second-round", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--publish", action="store_true", help="write the table into bench/RESULTS.md")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = args.out or _common.OUT_DIR / f"aggregated-{args.data.name}"
    cfg = TrainConfig.from_json(args.config) if args.config else TrainConfig()
    rows, table = [], {}
    true_bundle, true_info = _bundle(out, "true", lambda: _train(args.data, cfg))
    table["true"] = _terms(true_bundle, args.data, args.protocol)
    for size in args.group_sizes:
        for grouping in args.groupings:
            rows.append(_setting(args, cfg, out, size, grouping, table, true_info))
    body = _report(args, rows, table)
    print(body)
    if args.publish:
        _common.replace_section(_common.BENCH_DIR / "RESULTS.md", f"aggregated:{args.data.name}", body)
    return 0


def _train(data: Path, cfg: TrainConfig, aggregated_rounds: int = 0):
    from training.aggregated import train_aggregated
    from training.pipeline import train

    if aggregated_rounds:
        return train_aggregated(data, replace(cfg, aggregated_rounds=aggregated_rounds))
    return train(data, cfg)


def _setting(args, cfg: TrainConfig, out: Path, size: int, grouping: str, table: dict, true_info: dict) -> dict:
    grouped = out / f"data-{grouping}-{size}"
    if not (grouped / "groups.json.gz").exists():
        make_grouped(args.data, grouped, size, grouping, seed=0)
    tag = f"{grouping}-{size}"
    systems = {"naive": lambda: _train(_naive_data(grouped, out / f"data-naive-{tag}"), cfg),
               "eagle": lambda: _train(grouped, cfg, 1)}
    if not args.no_second_round:
        systems["eagle-2"] = lambda: _train(grouped, cfg, 2)
    row = {"setting": tag, "train_s": true_info["times"]["total_s"]}
    for name, build in systems.items():
        bundle, info = _bundle(out, f"{name}-{tag}", build)
        table[(name, tag)] = _terms(bundle, args.data, args.protocol)
        if "aggregated" in info:
            row[f"{name}_imputation_s"] = sum(info["aggregated"]["imputation_s"])
            row[f"{name}_train_s"] = sum(t or 0 for t in info["aggregated"]["training_s"])
    for name in systems:
        if name != "naive":
            row[f"{name}_gap"] = _gap_recovered(table[(name, tag)], table[("naive", tag)], table["true"])
    return row


def _report(args, rows: list[dict], table: dict) -> str:
    true = aggregate(table["true"], names=NAMES)
    lines = [f"## Aggregated labels (EAGLE) on {args.data.name}, protocol {args.protocol}",
             "", f"Command: `{_common.command_line()}` (commit {_common.git_revision()})", "",
             "| setting | system | P@1 | P@5 | PSP@5 | P@1 gap recovered (95% CI) | imputation / training (s) |",
             "|---|---|---:|---:|---:|---|---|",
             f"| - | true labels | {true['P@1']:.2f} | {true['P@5']:.2f} | {true['PSP@5']:.2f} | | |"]
    for row in rows:
        for key, terms in table.items():
            if key == "true" or key[1] != row["setting"]:
                continue
            name, tag = key
            m = aggregate(terms, names=NAMES)
            gap = row.get(f"{name}_gap")
            gap_s = f"{100 * gap[0]:.0f}% ({100 * gap[1]:.0f}..{100 * gap[2]:.0f})" if gap else ""
            times = (f"{row[f'{name}_imputation_s']:.1f} / {row[f'{name}_train_s']:.0f}"
                     if f"{name}_imputation_s" in row else "")
            lines.append(f"| {tag} | {name} | {m['P@1']:.2f} | {m['P@5']:.2f} | {m['PSP@5']:.2f} | {gap_s} | {times} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
