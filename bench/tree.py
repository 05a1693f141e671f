"""Benchmark of the tree-based bias-corrected scorer (issue 6) on an XC dataset's titles.

Prints and writes (bench/out/tree/tree.json, bench/out/tree/tree_convergence.png, copied to
bench/tree_convergence.png unless --out points elsewhere):
  - P@1, P@5, PSP@5 on the test split of: xi alone, log p_n alone, xi + log p_n (exact over
    all labels) and xi + log p_n by beam search at the default beam;
  - recall of the beam top-k against the exact top-k (ties counted as found) over a beam sweep;
  - convergence: P@1 against training seconds for adversarial (p_n) negatives vs uniform
    negatives, same model, same epochs and negatives per positive; the time adversarial takes
    to reach uniform's final P@1, as a fraction of uniform's total time (bar <= 1/3);
  - single-query TreeScorer.search p50 at the default beam (bar <= 1 ms), next to exact
    scoring of one query over all labels measured in the same run.

Document embeddings come from a checkpoint's trained encoder (`shortlist train` output):
  python bench/tree.py --checkpoint CKPT_DIR [--data ../shared/data/debian-deps]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import BENCH_DIR, OUT_DIR, command_line, git_revision, latency_summary

from service.engine.metrics import label_frequencies, propensities, ranking_metrics
from service.engine.tree import TreeScorer
from training import data as xc_data
from training.checkpoint import Checkpoint
from training.encoder import EncodedTexts, embed
from training.tree import LabelTree
from training.tree_train import (
    DEFAULT_CONFIG,
    TreeClassifier,
    classifier_from_config,
    resolve_config,
    tree_from_config,
)

CPU = torch.device("cpu")


def embed_texts(ckpt: Checkpoint, texts: list[str]) -> np.ndarray:
    return embed(ckpt.encoder, EncodedTexts.of(ckpt.tokenizer, texts), CPU)


def chunked_log_pn(scorer: TreeScorer, q: np.ndarray, chunk: int = 128) -> np.ndarray:
    return np.vstack([scorer.log_pn(q[i : i + chunk]).astype(np.float32) for i in range(0, len(q), chunk)])


def top(scores: np.ndarray, k: int) -> np.ndarray:
    part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, part, 1), axis=1, kind="stable")
    return np.take_along_axis(part, order, 1)


def metrics_of(ids: np.ndarray, truths: list[list[int]], inv_prop: np.ndarray) -> dict[str, float]:
    m = ranking_metrics(ids, truths, ks=(1, 5), inv_propensity=inv_prop)
    return {name: round(float(m[name]), 3) for name in ("P@1", "P@5", "PSP@5")}


def beam_recall(beam_scores: np.ndarray, exact_scores: np.ndarray, k: int) -> float:
    """Fraction of the beam's top k whose score reaches the exact k-th best (ties count as found)."""
    kth = -np.partition(-exact_scores, k - 1, axis=1)[:, k - 1 : k]
    return float((beam_scores[:, :k] >= kth - 1e-4 * np.maximum(1.0, np.abs(kth))).mean())


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="checkpoint folder (its encoder embeds the documents)")
    ap.add_argument("--data", default=str(BENCH_DIR.parent.parent / "shared" / "data" / "debian-deps"))
    ap.add_argument("--test-docs", type=int, default=4000, help="test documents evaluated (first N)")
    ap.add_argument("--curve-docs", type=int, default=1000, help="test documents behind the convergence curve")
    ap.add_argument("--epochs", type=int, default=int(DEFAULT_CONFIG["epochs"]))
    ap.add_argument("--eval-every", type=int, default=40, help="training steps between curve points")
    ap.add_argument("--config", default="{}", help="JSON object overriding training.tree_train.DEFAULT_CONFIG")
    ap.add_argument("--latency-queries", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT_DIR / "tree"))
    return ap.parse_args()


def load(args: argparse.Namespace) -> dict[str, Any]:
    """The documents embedded by the checkpoint's encoder, their truths and the propensities."""
    t = time.perf_counter()
    ckpt = Checkpoint.load(args.checkpoint)
    num_labels = len(xc_data.load_labels(args.data))
    trn = xc_data.load_split(args.data, "trn", num_labels=num_labels)
    tst = xc_data.load_split(args.data, "tst", num_labels=num_labels)
    tst = tst.subset(list(range(min(args.test_docs, len(tst)))))
    d = {"num_labels": num_labels, "trn": trn, "tst": tst, "x_trn": embed_texts(ckpt, trn.texts),
         "x_tst": embed_texts(ckpt, tst.texts),
         "inv_prop": 1.0 / propensities(label_frequencies(trn.targets, num_labels), len(trn))}
    print(f"data: {len(trn)} train / {len(tst)} test docs, {num_labels} labels, D={d['x_trn'].shape[1]} "
          f"({time.perf_counter() - t:.1f}s)", flush=True)
    return d


def convergence_runs(d: dict[str, Any], tree: LabelTree, cfg: dict[str, Any], args: argparse.Namespace
                     ) -> tuple[dict[str, list[tuple[float, float]]], dict[str, TreeClassifier]]:
    """P@1 on the first test documents against training seconds, per sampler.

    The same model and hyper-parameters for both samplers; plus uniform without the xi^2
    regulariser, since uniform's optimal xi (log p - log(1/L), ~ +7 here) is far from 0 and the
    regulariser handicaps it. Adversarial is compared with the better of the two uniform runs.
    """
    num_labels, x_trn, x_tst, tst = d["num_labels"], d["x_trn"], d["x_tst"], d["tst"]
    zero_w = np.zeros((num_labels, x_trn.shape[1]), np.float32)
    pn_only = TreeScorer.from_arrays({**tree.arrays(), "classifier_weights": zero_w,
                                      "classifier_bias": np.zeros(num_labels, np.float32)})
    curve_q, curve_truth = x_tst[: args.curve_docs], tst.targets[: args.curve_docs]
    curve_logpn = chunked_log_pn(pn_only, curve_q)
    runs = {"adversarial": ("adversarial", cfg), "uniform": ("uniform", cfg),
            "uniform, lambda=0": ("uniform", {**cfg, "lambda": 0.0})}
    curves: dict[str, list[tuple[float, float]]] = {}
    models: dict[str, TreeClassifier] = {}
    for name, (sampler, run_cfg) in runs.items():
        points: list[tuple[float, float]] = []
        correction = curve_logpn if sampler == "adversarial" else 0.0

        def record(elapsed: float, step: int, w: np.ndarray, b: np.ndarray, points=points, corr=correction) -> None:
            scores = curve_q @ w.T + b + corr
            p1 = ranking_metrics(scores.argmax(1)[:, None], curve_truth, ks=(1,))["P@1"]
            points.append((elapsed, float(p1)))

        # Before any step xi = 0: adversarial scores log p_n alone, uniform scores all labels alike.
        record(0.0, 0, zero_w, np.zeros(num_labels, np.float32))
        clf = classifier_from_config(run_cfg, args.seed, sampler)
        clf.fit(x_trn, d["trn"].targets, num_labels, tree, callback=record, callback_every=args.eval_every)
        curves[name], models[name] = points, clf
        print(f"{name}: {clf.fit_stats_['steps']} steps in {clf.fit_stats_['train_seconds']:.1f}s, "
              f"final curve P@1 {points[-1][1]:.2f}, masked negatives "
              f"{100 * clf.fit_stats_['masked_negative_fraction']:.2f}%", flush=True)
    return curves, models


def _reach(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((s for s, p in curve if p >= target), None)


def convergence_summary(curves: dict[str, list[tuple[float, float]]], tree_s: float) -> dict[str, Any]:
    """How soon adversarial negatives reach uniform's final P@1 (the tree's fit charged to them)."""
    best_uniform = max(("uniform", "uniform, lambda=0"), key=lambda n: curves[n][-1][1])
    uniform_final, uniform_time = curves[best_uniform][-1][1], curves[best_uniform][-1][0]
    reach = _reach(curves["adversarial"], uniform_final)
    same_final, same_time = curves["uniform"][-1][1], curves["uniform"][-1][0]
    same_reach = _reach(curves["adversarial"], same_final)
    return {
        "uniform_run_compared": best_uniform,
        "uniform_final_P@1 (all runs)": {n: curves[n][-1][1] for n in curves if n != "adversarial"},
        "uniform_final_P@1": uniform_final,
        "uniform_seconds": round(uniform_time, 2),
        "adversarial_final_P@1": curves["adversarial"][-1][1],
        "adversarial_seconds": round(curves["adversarial"][-1][0], 2),
        "adversarial_seconds_to_uniform_final": None if reach is None else round(reach, 2),
        "fraction_of_uniform_time": None if reach is None else round(reach / uniform_time, 4),
        "fraction_incl_tree_fit": None if reach is None else round((reach + tree_s) / uniform_time, 4),
        # "the same model and budget": uniform with the adversarial run's own hyper-parameters
        "same_config": {
            "uniform_final_P@1": same_final,
            "uniform_seconds": round(same_time, 2),
            "adversarial_seconds_to_uniform_final": None if same_reach is None else round(same_reach, 2),
            "fraction_incl_tree_fit": None if same_reach is None else round((same_reach + tree_s) / same_time, 4),
        },
    }


def quality(d: dict[str, Any], scorer: TreeScorer, models: dict[str, TreeClassifier]) -> tuple[dict, np.ndarray]:
    """P@1/P@5/PSP@5 of xi, log p_n, their sum (exact and by beam), and uniform's xi; the exact scores."""
    x_tst, truths, inv_prop = d["x_tst"], d["tst"].targets, d["inv_prop"]
    clf = models["adversarial"]
    xi = x_tst @ clf.weights_.T + clf.bias_
    logpn = chunked_log_pn(scorer, x_tst)
    exact = xi + logpn
    out = {
        "xi alone": metrics_of(top(xi, 5), truths, inv_prop),
        "log p_n alone": metrics_of(top(logpn, 5), truths, inv_prop),
        "xi + log p_n (exact)": metrics_of(top(exact, 5), truths, inv_prop),
        "xi + log p_n (beam, default)": metrics_of(scorer.search(x_tst, 5)[0], truths, inv_prop),
        **{f"{name}: xi": metrics_of(top(x_tst @ m.weights_.T + m.bias_, 5), truths, inv_prop)
           for name, m in models.items() if name != "adversarial"},
    }
    for name, m in out.items():
        print(f"  {name:32s} {m}", flush=True)
    return out, exact


def _search_times(scorer: TreeScorer, queries: np.ndarray, beam: int | None, warmup: int = 10) -> list[float]:
    for i in range(warmup):
        scorer.search(queries[i : i + 1], 10, beam)
    times = []
    for i in range(len(queries)):
        t0 = time.perf_counter()
        scorer.search(queries[i : i + 1], 10, beam)
        times.append(time.perf_counter() - t0)
    return times


def beam_sweep(scorer: TreeScorer, x_tst: np.ndarray, exact: np.ndarray, default_beam: int) -> dict[int, dict]:
    """Recall of the beam's top k against the exact top k, and one query's search time, per beam."""
    recall = {}
    for beam in sorted({8, 16, 32, 64, 128, 256, default_beam}):
        r = {f"recall@{k}": round(beam_recall(scorer.search(x_tst, k, beam)[1], exact, k), 4) for k in (5, 10)}
        r["search_p50_ms"] = round(latency_summary(_search_times(scorer, x_tst[:200], beam))["p50_ms"], 4)
        recall[beam] = r
        print(f"  beam {beam:4d}: {r}", flush=True)
    return recall


def latency(scorer: TreeScorer, queries: np.ndarray) -> dict[str, Any]:
    """Single-query search at the default beam against exact scoring of all labels, same run."""
    exact_times = []
    for i in range(min(200, len(queries))):
        t0 = time.perf_counter()
        top(scorer.exact_scores(queries[i : i + 1]), 10)
        exact_times.append(time.perf_counter() - t0)
    out = {"search_default_beam": {k: round(v, 4) for k, v in latency_summary(_search_times(scorer, queries, None,
                                                                                           20)).items()},
           "exact_all_labels": {k: round(v, 4) for k, v in latency_summary(exact_times).items()}}
    out["exact_over_search_p50"] = round(out["exact_all_labels"]["p50_ms"] / out["search_default_beam"]["p50_ms"], 2)
    return out


def plot(curves: dict[str, list[tuple[float, float]]], convergence: dict[str, Any], args: argparse.Namespace,
         png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, label in (("adversarial", "negatives from p_n (xi + log p_n)"),
                        ("uniform", "uniform negatives (xi), same config"),
                        ("uniform, lambda=0", "uniform negatives (xi), lambda=0")):
        xs, ys = zip(*curves[name], strict=True)
        ax.plot(xs, ys, marker=".", label=label)
    ax.axhline(convergence["uniform_final_P@1"], color="grey", linestyle=":", linewidth=1)
    if convergence["adversarial_seconds_to_uniform_final"] is not None:
        ax.axvline(convergence["adversarial_seconds_to_uniform_final"], color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("training time (s, evaluation excluded)")
    ax.set_ylabel(f"P@1 (%), first {args.curve_docs} test docs")
    ax.set_title(f"{Path(args.data).name} titles: adversarial vs uniform negative sampling")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    args = parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    cfg = resolve_config({**json.loads(args.config), "epochs": args.epochs})
    d = load(args)
    t = time.perf_counter()
    tree = tree_from_config(cfg, args.seed).fit(d["x_trn"], d["trn"].targets, d["num_labels"])
    tree_s = time.perf_counter() - t
    print(f"tree p_n: fitted in {tree_s:.1f}s, depth {tree.depth_}, rounds per level {tree.rounds_per_level_}",
          flush=True)
    curves, models = convergence_runs(d, tree, cfg, args)
    convergence = convergence_summary(curves, tree_s)
    print(f"convergence: {convergence}", flush=True)
    clf = models["adversarial"]
    scorer = TreeScorer.from_arrays({**tree.arrays(), "classifier_weights": clf.weights_,
                                     "classifier_bias": clf.bias_, "default_beam": np.asarray(cfg["beam"])})
    scores, exact = quality(d, scorer, models)
    recall = beam_sweep(scorer, d["x_tst"], exact, int(cfg["beam"]))
    lat = latency(scorer, d["x_tst"][: args.latency_queries])
    print(f"single-query latency (k=10, beam {cfg['beam']}): {lat}", flush=True)
    png = out_dir / "tree_convergence.png"
    plot(curves, convergence, args, png)
    if out_dir.resolve() == (OUT_DIR / "tree").resolve():  # side runs (--out) leave the published plot alone
        shutil.copyfile(png, BENCH_DIR / "tree_convergence.png")
    result = {"command": command_line(), "git": git_revision(), "data": args.data, "checkpoint": args.checkpoint,
              "config": cfg, "tree_fit_seconds": round(tree_s, 2), "quality": scores, "beam_recall": recall,
              "convergence": convergence, "curves": curves, "latency_ms": lat}
    (out_dir / "tree.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(f"wrote {out_dir / 'tree.json'} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
