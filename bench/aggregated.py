"""Training from aggregated labels (EAGLE) against naive group labels and the true labels.

    python bench/aggregated.py --data ../shared/data/debian-tags [--group-sizes 2 4 8]
        [--groupings random clustered] [--protocol plain|own] [--systems naive eagle-paper eagle eagle-hard eagle-2]
        [--config FILE] [--route alpha|tree] [--publish]

For each group size and grouping, grouped data is made from the dataset (`shortlist data
aggregate`) and models are trained and exported, then scored on the test split through the
served engine: naive (each member gets all its group's labels); eagle-paper (the paper's
Algorithm 1 on TF-IDF and Algorithm 2: closest member); eagle (the defaults: centred features,
label texts as groups of one, the relative assignment with soft labels; training/eagle.py);
eagle-hard (eagle with every imputed label weighing 1, as before soft labels); eagle-2 (a second
round: eagle's labels imputed again by models trained on them, by default each member's posteriors
under models of the other folds of groups, then trained again); and the true per-document
labels (once). Prints P@1 / P@5 / PSP@5, the share of the naive-to-true P@1 gap each system
recovers with a 95% paired bootstrap interval, imputation time against training time, and the
imputed labels' precision and recall against the true ones (a diagnostic: no choice of the
method looks at them). Every trained bundle is kept under --out, so an interrupted run resumes.
--route tree scores the tree route (POST /v1/predict/tree) of the same bundles instead of the
alpha route (POST /v1/predict): a config with the tree off trains bundles without one.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import sys
from collections.abc import Callable
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
SYSTEMS = ("naive", "eagle-paper", "eagle", "eagle-hard", "eagle-2")
# The paper's method: Algorithm 1 with T = 10, lambda = 0.5 (set before any measurement) on raw
# (uncentred) TF-IDF without label texts, Algorithm 2's single closest member.
PAPER = {"aggregated_iterations": 10, "aggregated_step": 0.5, "aggregated_validation": 0.0,
         "aggregated_assignment": "closest", "aggregated_center": False, "aggregated_label_texts": False}


def _bundle(out: Path, name: str, build: Callable | None) -> tuple[Path, dict] | None:
    """out/name/bundle (trained by `build() -> Checkpoint` unless it exists; None when it does not
    and build is None) and its training metrics."""
    from model_export.export import export_checkpoint

    bundle, info = out / name / "bundle" / "b", out / name / "metrics.json"
    if not info.is_file():
        if build is None:
            return None
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


def _terms(bundle: Path, data: Path, protocol: str, route: str) -> dict[str, np.ndarray]:
    """Each test document's share of the metrics, through the served engine's route."""
    predictor = Predictor.load(bundle)
    if route == "tree" and predictor.bundle.tree is None:
        raise SystemExit(f"{bundle}: no tree route to score (trained with tree_enabled false)")
    predict = predictor.predict_ids if route == "alpha" else predictor.predict_tree_ids
    labels = xc_data.load_labels(data)
    docs = xc_data.load_split(data, "tst", "title", len(labels))
    trn = xc_data.load_split(data, "trn", "title", len(labels))
    drop = filtered_pairs(protocol, docs, labels, predictor.num_labels)
    truths = [[t for t in truth if t not in d] for truth, d in zip(docs.targets, drop, strict=True)]
    ids = np.concatenate([predict(docs.texts[s : s + 512], k=5, exclude=drop[s : s + 512])[0]
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
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--config", type=Path, default=None, help="training config JSON (default: the defaults)")
    ap.add_argument("--route", default="alpha", choices=["alpha", "tree"], help="the served route scored")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--publish", action="store_true", help="write the table into bench/RESULTS.md and the plot")
    ap.add_argument("--no-train", action="store_true",
                    help="score the bundles already trained under --out, list the others as not run")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = args.out or _common.OUT_DIR / f"aggregated-{args.data.name}"
    cfg = TrainConfig.from_json(args.config) if args.config else TrainConfig()
    rows, table = [], {}
    found = _bundle(out, "true", None if args.no_train else lambda: _train(args.data, cfg))
    if found is None:
        ap.error(f"{out}/true: the true labels' model is not trained yet (run without --no-train)")
    true_bundle, true_info = found
    table["true"] = _terms(true_bundle, args.data, args.protocol, args.route)
    for size in args.group_sizes:
        for grouping in args.groupings:
            rows.append(_setting(args, cfg, out, size, grouping, table, true_info))
    body = _report(args, rows, table, cfg)
    print(body)
    if args.publish:
        suffix = "" if args.route == "alpha" else "-tree"  # each route its own section and plot
        _plot(args, rows, table, _common.BENCH_DIR / f"aggregated-{args.data.name}{suffix}.png")
        _common.replace_section(_common.BENCH_DIR / "RESULTS.md", f"aggregated:{args.data.name}{suffix}", body)
    return 0


def _train(data: Path, cfg: TrainConfig, rounds: int = 0):
    """A model of `data`: trained as ordinary data (rounds 0) or grouped data with `rounds` rounds."""
    from training.aggregated import train_aggregated
    from training.pipeline import train

    return train_aggregated(data, replace(cfg, aggregated_rounds=rounds)) if rounds else train(data, cfg)


def _setting(args, cfg: TrainConfig, out: Path, size: int, grouping: str, table: dict, true_info: dict) -> dict:
    grouped = out / f"data-{grouping}-{size}"
    if not (grouped / "groups.json.gz").exists():
        make_grouped(args.data, grouped, size, grouping, seed=0)
    tag = f"{grouping}-{size}"
    builds = {"naive": lambda: _train(_naive_data(grouped, out / f"data-naive-{tag}"), cfg),
              "eagle-paper": lambda: _train(grouped, replace(cfg, **PAPER), rounds=1),
              "eagle": lambda: _train(grouped, cfg, rounds=1),
              "eagle-hard": lambda: _train(grouped, replace(cfg, aggregated_soft_labels=False), rounds=1),
              "eagle-2": lambda: _train(grouped, cfg, rounds=2)}
    row = {"setting": tag, "true_train_s": true_info["times"]["total_s"], "systems": [],
           "imputed": _imputation_quality(args.data, grouped, cfg, out / f"eagle-{tag}" / "ckpt",
                                          out / f"imputed-{tag}.json")}
    for name in args.systems:
        found = _bundle(out, f"{name}-{tag}", None if args.no_train else builds[name])
        if found is None:
            continue
        bundle, info = found
        row["systems"].append(name)
        table[(name, tag)] = _terms(bundle, args.data, args.protocol, args.route)
        if "aggregated" in info:
            row[f"{name}_imputation_s"] = sum(info["aggregated"]["imputation_s"])
            row[f"{name}_iterations"] = info["aggregated"].get("iterations")
            row[f"{name}_keep_ratio"] = info["aggregated"].get("keep_ratio")
            row[f"{name}_train_s"] = sum(t or 0 for t in info["aggregated"]["training_s"])
        else:
            row[f"{name}_train_s"] = info["times"]["total_s"]
    for name in row["systems"]:
        if name != "naive" and "naive" in row["systems"]:
            row[f"{name}_gap"] = _gap_recovered(table[(name, tag)], table[("naive", tag)], table["true"])
    return row


def _imputation_quality(data: Path, grouped_dir: Path, cfg: TrainConfig, eagle_ckpt: Path,
                        cache: Path) -> dict[str, tuple]:
    """Precision and recall of each system's imputed training labels against the true ones, soft
    labels counting by their weights (kept in `cache`; eagle-2's once eagle's model exists, when
    one model on every group re-imputes, aggregated_posterior_folds 1: eagle's is that model)."""
    has_eagle = (eagle_ckpt / "checkpoint.json").exists() and cfg.aggregated_posterior_folds == 1
    if cache.is_file():
        quality = json.loads(cache.read_text(encoding="utf-8"))
        if "eagle-2" in quality or not has_eagle:
            return quality
    import torch

    from training.aggregated import as_lists, fit_imputer, fold_posteriors, impute, tfidf_spaces
    from training.checkpoint import Checkpoint
    from training.encoder import EncodedTexts, embed
    from training.grouped import load_grouped

    labels = xc_data.load_labels(data)
    truth = {u: set(t) for u, t in zip(*_uids_targets(data, len(labels)), strict=True)}
    grouped = load_grouped(grouped_dir, "title", len(labels))
    x, z = tfidf_spaces(grouped.texts, labels.texts, cfg)
    eagle = fit_imputer(grouped, x, len(labels), cfg, z)
    imputed = {"naive": [grouped.group_targets[g] for g in grouped.group_of],
               "eagle-paper": impute(grouped, x, len(labels), replace(cfg, **PAPER), z), "eagle": eagle.impute()}
    weights = {name: [[1.0] * len(r) for r in rows] for name, rows in imputed.items()}
    if cfg.aggregated_soft_labels:
        weights["eagle"] = eagle.impute_weights()
    if has_eagle and cfg.aggregated_reimpute == "model":
        every_group = np.arange(len(grouped.group_uids))
        imputed["eagle-2"], weights["eagle-2"] = as_lists(fold_posteriors(
            Checkpoint.load(eagle_ckpt), grouped, every_group, len(labels), cfg.aggregated_min_posterior))
    elif has_eagle:
        ckpt = Checkpoint.load(eagle_ckpt)
        with torch.no_grad():
            emb, label_emb = (embed(ckpt.encoder, EncodedTexts.of(ckpt.tokenizer, t), torch.device("cpu"))
                              for t in (grouped.texts, labels.texts))
        imputed["eagle-2"] = impute(grouped, emb, len(labels), cfg, label_emb)
        weights["eagle-2"] = [[1.0] * len(r) for r in imputed["eagle-2"]]
    quality = {}
    for name, rows in imputed.items():  # soft labels count by their weights
        hits = sum(w for u, r, ws in zip(grouped.uids, rows, weights[name], strict=True)
                   for label, w in zip(r, ws, strict=True) if label in truth[u])
        total = sum(sum(ws) for ws in weights[name])
        quality[name] = (hits / max(1e-9, total), hits / max(1, sum(map(len, truth.values()))))
    cache.write_text(json.dumps(quality), encoding="utf-8")
    return quality


def _uids_targets(data: Path, num_labels: int) -> tuple[list[str], list[list[int]]]:
    trn = xc_data.load_split(data, "trn", "title", num_labels)
    return trn.uids, trn.targets


def _report(args, rows: list[dict], table: dict, cfg: TrainConfig) -> str:
    true = aggregate(table["true"], names=NAMES)
    route = "" if args.route == "alpha" else ", the tree route"
    lines = [f"## Aggregated labels (EAGLE) on {args.data.name}, protocol {args.protocol}{route}",
             "", f"Command: `{_common.command_line()}` (commit {_common.git_revision()}); "
             f"eagle: T in 0..{cfg.aggregated_iterations} and the keep ratio r in 1.0..0.0 chosen on "
             f"{100 * cfg.aggregated_validation:.0f}% of the groups held out (column T / r), lambda = "
             f"{cfg.aggregated_step}; eagle-paper: T = "
             f"{PAPER['aggregated_iterations']}, lambda = {PAPER['aggregated_step']}.", "",
             "| setting | system | P@1 | P@5 | PSP@5 | P@1 gap recovered (95% CI) | imputed P / R | T / r | "
             "imputation / training (s) |",
             "|---|---|---:|---:|---:|---|---|---|---|",
             f"| - | true labels | {true['P@1']:.2f} | {true['P@5']:.2f} | {true['PSP@5']:.2f} | | 1.00 / 1.00 | | |"]
    for row in rows:
        tag = row["setting"]
        for name in row["systems"]:
            m = aggregate(table[(name, tag)], names=NAMES)
            gap = row.get(f"{name}_gap")
            gap_s = f"{100 * gap[0]:.0f}% ({100 * gap[1]:.0f}..{100 * gap[2]:.0f})" if gap else ""
            quality = row["imputed"].get("eagle" if name == "eagle-hard" else name)  # the same labels
            quality_s = f"{quality[0]:.2f} / {quality[1]:.2f}" if quality else ""
            times = (f"{row[f'{name}_imputation_s']:.1f} / {row[f'{name}_train_s']:.0f} "
                     f"({100 * row[f'{name}_imputation_s'] / row[f'{name}_train_s']:.1f}%)"
                     if f"{name}_imputation_s" in row else "")
            iterations = ", ".join(map(str, row.get(f"{name}_iterations") or []))
            ratios = [r for r in row.get(f"{name}_keep_ratio") or [] if r is not None]
            iterations += f" / {', '.join(map(str, ratios))}" if ratios else ""
            lines.append(f"| {tag} | {name} | {m['P@1']:.2f} | {m['P@5']:.2f} | {m['PSP@5']:.2f} | {gap_s} | "
                         f"{quality_s} | {iterations} | {times} |")
    return "\n".join(lines)


def _plot(args, rows: list[dict], table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    true = aggregate(table["true"], names=["P@1"])["P@1"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(rows), 3.6))
    width = 0.8 / len(args.systems)
    for k, name in enumerate(args.systems):
        values = [aggregate(table[(name, r["setting"])], names=["P@1"])["P@1"] for r in rows]
        ax.bar(np.arange(len(rows)) + (k - (len(args.systems) - 1) / 2) * width, values, width, label=name)
    ax.axhline(true, color="black", linestyle="--", linewidth=1, label="true labels")
    ax.set_xticks(np.arange(len(rows)), [r["setting"] for r in rows])
    ax.set_ylabel(f"test P@1 ({args.protocol})")
    ax.set_title(f"Aggregated labels on {args.data.name}")
    low = min(aggregate(t, names=["P@1"])["P@1"] for t in table.values())
    ax.set_ylim(max(0.0, low - 5), true + 3)
    ax.legend(fontsize=7, ncol=3, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
