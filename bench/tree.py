"""Benchmark of the tree route (issues 6 and 24): the tree-based bias-corrected scorer behind
POST /v1/predict/tree, refitted on a trained checkpoint's encoder, Module III and split.

    python bench/tree.py --checkpoint CKPT --data DIR [--split val|tst] [--filter own|plain]

Prints and writes (bench/out/tree/<dataset>-<split>.json; the convergence plot
bench/out/tree/tree_convergence.png, copied to bench/tree_convergence.png unless --out points
elsewhere):
  - changes: the model and training changes of issue 24 one by one, each on top of the last
    (from issue 6's model to today's defaults): P@1 / P@5 / PSP@5 through TreeScorer.search at
    the default beam, fit seconds, single-query search p50;
  - ablation on the default model, same candidates (the beam's leaves): xi alone, log p_n
    alone, xi + log p_n; how many of the true labels the beam holds;
  - beam sweep: recall of the beam's top k against the exact top k over all labels, p50;
  - single-query search p50 at the default beam (bar <= 1 ms) next to exact scoring of all
    labels, same run;
  - convergence: P@1 against training seconds with negatives from p_n (xi + log p_n) and
    uniform negatives (xi), same model and hyper-parameters (`same_config`; bar: adversarial
    reaches uniform's final P@1 in at most a third of uniform's time, the tree's fit charged);
  - seeds: the tree route (p_n, its node term, xi) refitted on the checkpoint with each of
    --seeds, P@1 / P@5 / PSP@5 of each and their mean and range: how much of a difference
    against a peer the tree's own seed can make.

The split is the checkpoint's own: its validation documents (carved from trn by its seed,
which tuning may look at) or the whole test split. Tune on val; report tst.
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

from service.engine.metrics import ranking_metrics
from service.engine.scorers import top_k
from service.engine.tree import TreeScorer
from training.checkpoint import Checkpoint
from training.config import TrainConfig
from training.data import own_label_ids, same_data
from training.dataset import TrainingSet
from training.encoder import embed
from training.tree import LabelTree
from training.tree_config import resolve_config
from training.tree_lexical import LexicalStart, TokenRows
from training.tree_train import (
    LEXICAL_START_KEYS,
    AdversarialTree,
    classifier_from_config,
    fit_p_n,
    lexical_start_from_config,
    one_vs_all_start,
)

CPU = torch.device("cpu")
# Issue 24's changes in the order they were made, each on top of the ones before (the first
# row is issue 6's model); the last row is training.tree_config.DEFAULT_CONFIG.
ISSUE6 = {"pca_dim": 16, "lambda_n": 1.0, "lexical": False, "start": "zero", "epochs": 3, "negatives": 8,
          "lambda": 0.01, "beam": 128, "node_lexical": False, "start_centroids": 0.0}
CHANGES: list[tuple[str, dict[str, Any]]] = [
    ("issue 6's model: p_n lambda_n 1, xi from zero on the embedding, beam 128", ISSUE6),
    ("p_n's regulariser at the data's size: lambda_n 3000", {"lambda_n": 3000.0}),
    ("xi starts at Module III's w_l, b_l (the change regularised)", {"start": "one_vs_all"}),
    ("xi's lexical term, started at its one-vs-all logistic model", {"lexical": True}),
    ("beam 512", {"beam": 512}),
    ("p_n's lexical node term (xi retrained against its negatives)", {"node_lexical": True, "node_lexical_epochs": 12}),
    ("30 node epochs, xi's lambda 0.03, beam 128", {"node_lexical_epochs": 30, "lambda": 0.03, "beam": 128}),
    ("xi's start adds 10 x the label centroids (mu_l . q)", {"start_centroids": 10.0}),
]


class Split:
    """One split's documents as the tree route sees them: embeddings, tokens, truths."""

    def __init__(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, targets: list[list[int]],
                 own: np.ndarray | None) -> None:
        self.x, self.tokens, self.own = x, (ids, weights), own
        # Under the filtered protocol a document's own label is neither a target nor a prediction.
        self.truths = targets if own is None else [[t for t in tr if t != o] for tr, o in zip(targets, own,
                                                                                             strict=True)]

    def __len__(self) -> int:
        return len(self.x)

    def rows(self, start: int, stop: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        return self.x[start:stop], (self.tokens[0][start:stop], self.tokens[1][start:stop])

    def drop_own(self, ids: np.ndarray, k: int = 5) -> np.ndarray:
        """Ranked ids [N, >k] of the first N documents -> [N, k], each document's own label
        removed (the rest move up)."""
        if self.own is None:
            return ids[:, :k]
        out = np.full((len(ids), k), -1, dtype=np.int64)
        for r, row in enumerate(ids):
            kept = row[(row != self.own[r]) & (row >= 0)][:k]
            out[r, : len(kept)] = kept
        return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="checkpoint folder (`shortlist train` output)")
    ap.add_argument("--data", default=str(BENCH_DIR.parent.parent / "shared" / "data" / "debian-deps"))
    ap.add_argument("--split", default="val", choices=["val", "tst"])
    ap.add_argument("--filter", default="own", choices=["own", "plain"],
                    help="own: each document's own label left out of predictions and truth (filtered protocol)")
    ap.add_argument("--config", default="{}", help="JSON object overriding training.tree_config.DEFAULT_CONFIG")
    ap.add_argument("--parts", default="changes,ablation,beams,convergence",
                    help="comma-separated subset of changes,ablation,beams,convergence,seeds")
    ap.add_argument("--seeds", default="0,1,2", help="the seeds part's training seeds (comma-separated)")
    ap.add_argument("--curve-docs", type=int, default=1000, help="documents behind the convergence curve")
    ap.add_argument("--eval-every", type=int, default=50, help="training steps between curve points")
    ap.add_argument("--fitted", action="store_true",
                    help="ablation and beams on the checkpoint's own tree (tree.npz, e.g. from `shortlist train "
                         "--refit-tree`) instead of one fitted here with --config")
    ap.add_argument("--latency-queries", type=int, default=1000)
    ap.add_argument("--out", default=str(OUT_DIR / "tree"))
    return ap.parse_args()


def load(args: argparse.Namespace) -> dict[str, Any]:
    """The checkpoint's training documents and the evaluated split, embedded by its encoder."""
    t = time.perf_counter()
    ckpt = Checkpoint.load(args.checkpoint)
    cfg = TrainConfig.from_dict({**ckpt.config, "progress": False})
    data = TrainingSet.load(args.data, cfg, ckpt.text_field, np.random.default_rng(cfg.seed))
    if not same_data(args.data, data.fingerprint, ckpt.fingerprint):
        raise SystemExit(f"{args.data}: not the data {args.checkpoint} was trained on")
    docs, texts = (data.val, data.val_texts) if args.split == "val" else (data.tst, data.tst_texts)
    own = own_label_ids(docs.uids, data.labels.uids) if args.filter == "own" else None
    out = {
        "ckpt": ckpt, "num_labels": data.num_labels, "inv_prop": data.inv_propensity,
        "trn_x": embed(ckpt.encoder, data.docs, CPU), "trn_targets": data.trn.targets,
        "tokens": TokenRows(data.docs.ids.numpy(), data.docs.weights.numpy(), data.label_texts.ids.numpy(),
                            data.tokenizer.vocab_size),
        "eval": Split(embed(ckpt.encoder, texts, CPU), texts.ids.numpy(), texts.weights.numpy(), docs.targets, own),
    }
    print(f"data: {len(data.trn)} train docs, {args.split} {len(docs)} docs ({args.filter}), {data.num_labels} "
          f"labels ({time.perf_counter() - t:.1f}s)", flush=True)
    return out


def lexical_of(d: dict[str, Any], cfg: dict[str, Any], seed: int) -> tuple[LexicalStart, float]:
    """The lexical term's start for cfg and the seconds it took to fit, as training fits it: it
    depends on a few keys only, so it is fitted once per run and seed and shared by the fits
    that need it."""
    key = json.dumps([seed, *(cfg[k] for k in LEXICAL_START_KEYS)])
    cache = d.setdefault("lexical_starts", {})
    if key not in cache:
        t = time.perf_counter()
        start = lexical_start_from_config(cfg, seed, d["tokens"], d["trn_targets"], d["num_labels"])
        cache[key] = (start, time.perf_counter() - t)
    return cache[key]


def fit(d: dict[str, Any], cfg: dict[str, Any], seed: int | None = None) -> tuple[TreeScorer, float]:
    """The tree route fitted with cfg (and seed: the checkpoint's unless given), and the seconds
    a whole fit takes (the shared lexical start's included)."""
    seed = d["ckpt"].seed if seed is None else seed
    lexical, lexical_s = lexical_of(d, cfg, seed) if cfg["lexical"] else (None, 0.0)
    t = time.perf_counter()
    clf = d["ckpt"].classifiers
    model = AdversarialTree(cfg, seed).fit(d["trn_x"], d["trn_targets"], d["num_labels"], tokens=d["tokens"],
                                           module3=(clf.weights_, clf.bias_), lexical=lexical,
                                           centroids=d["ckpt"].centroids.vectors_)
    return TreeScorer.from_arrays(model.arrays_), time.perf_counter() - t + lexical_s


def metrics_of(ids: np.ndarray, split: Split, inv_prop: np.ndarray) -> dict[str, float]:
    m = ranking_metrics(split.drop_own(ids), split.truths, ks=(1, 5), inv_propensity=inv_prop)
    return {name: round(float(m[name]), 2) for name in ("P@1", "P@5", "PSP@5")}


def searched(scorer: TreeScorer, split: Split, k: int, beam: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    parts = [scorer.search(*split.rows(i, i + 256)[:1], k, beam, split.rows(i, i + 256)[1])
             for i in range(0, len(split), 256)]
    return np.vstack([p[0] for p in parts]), np.vstack([p[1] for p in parts])


def single_query_times(scorer: TreeScorer, split: Split, count: int, beam: int | None = None) -> list[float]:
    times = []
    for i in range(min(count, len(split)) + 10):
        q, tokens = split.rows(i % len(split), i % len(split) + 1)
        t0 = time.perf_counter()
        scorer.search(q, 10, beam, tokens)
        if i >= 10:  # warm-up calls not counted
            times.append(time.perf_counter() - t0)
    return times


def changes(d: dict[str, Any], base: dict[str, Any], args: argparse.Namespace
            ) -> tuple[list[dict[str, Any]], tuple[dict[str, Any], TreeScorer, float]]:
    """Each change on top of the ones before it, fitted and measured (a change of the beam
    alone searches the model before it: the same fit)."""
    rows, cfg, last = [], {}, None
    for name, change in CHANGES:
        cfg = {**cfg, **change}
        run_cfg = resolve_config({**base, **cfg})
        trained = {key: value for key, value in run_cfg.items() if key != "beam"}
        if last is not None and last[0] == trained:
            scorer, fit_s = TreeScorer.from_arrays({**last[1].to_arrays(), "default_beam": run_cfg["beam"]}), last[2]
        else:
            scorer, fit_s = fit(d, run_cfg)
        last = (trained, scorer, fit_s)
        m = metrics_of(searched(scorer, d["eval"], 6)[0], d["eval"], d["inv_prop"])
        p50 = latency_summary(single_query_times(scorer, d["eval"], min(300, args.latency_queries)))["p50_ms"]
        rows.append({"change": name, "config": run_cfg, **m, "fit_s": round(fit_s, 1), "search_p50_ms": round(p50, 3)})
        print(f"  {name}: {m} fit {fit_s:.1f}s p50 {p50:.3f} ms", flush=True)
    assert last is not None
    return rows, (run_cfg, last[1], last[2])


def ablation(d: dict[str, Any], scorer: TreeScorer) -> dict[str, Any]:
    """The beam's leaves ranked by xi alone, log p_n alone and xi + log p_n."""
    split, ranked = d["eval"], {"xi alone": [], "log p_n alone": [], "xi + log p_n": []}
    held = []
    for i in range(0, len(split), 256):
        q, tokens = split.rows(i, i + 256)
        labels, logp = scorer.beam_leaves(q, scorer.default_beam, tokens)
        valid = labels >= 0
        xi = scorer.candidate_scores(q, np.maximum(labels, 0), tokens)
        for name, s in (("xi alone", xi), ("log p_n alone", logp), ("xi + log p_n", xi + logp)):
            order = np.argsort(-np.where(valid, s, -np.inf), axis=1, kind="stable")[:, :6]
            ranked[name].append(np.take_along_axis(labels, order, 1))
        for row, truth in zip(labels, split.truths[i : i + 256], strict=True):
            if truth:
                held.append(len(set(truth) & set(row.tolist())) / len(truth))
    out: dict[str, Any] = {name: metrics_of(np.vstack(v), split, d["inv_prop"]) for name, v in ranked.items()}
    out["true labels in the beam"] = round(100 * float(np.mean(held)), 2)
    for name, m in out.items():
        print(f"  {name:28s} {m}", flush=True)
    return out


def exact_top(scorer: TreeScorer, split: Split, k: int) -> np.ndarray:
    """Exact k-th best score over all labels per document [N, 1]."""
    out = []
    for i in range(0, len(split), 128):
        q, tokens = split.rows(i, i + 128)
        s = scorer.exact_scores(q, tokens)
        out.append(-np.partition(-s, k - 1, axis=1)[:, k - 1 : k])
    return np.vstack(out)


def beams(d: dict[str, Any], scorer: TreeScorer, args: argparse.Namespace) -> dict[str, Any]:
    """Recall of the beam's top k against the exact top k, and one query's search time, per beam;
    then the default beam against exact scoring of all labels, same run."""
    split, sweep = d["eval"], {}
    kth = {k: exact_top(scorer, split, k) for k in (5, 10)}
    for beam in sorted({8, 16, 32, 64, 128, 256, scorer.default_beam}):
        r = {}
        for k in (5, 10):
            scores = searched(scorer, split, k, beam)[1]
            r[f"recall@{k}"] = round(float((scores >= kth[k] - 1e-4 * np.maximum(1.0, np.abs(kth[k]))).mean()), 4)
        r["search_p50_ms"] = round(latency_summary(single_query_times(scorer, split, 200, beam))["p50_ms"], 3)
        sweep[beam] = r
        print(f"  beam {beam:4d}: {r}", flush=True)
    exact_times = []
    for i in range(min(200, len(split))):
        q, tokens = split.rows(i, i + 1)
        t0 = time.perf_counter()
        np.argsort(-scorer.exact_scores(q, tokens)[0])[:10]
        exact_times.append(time.perf_counter() - t0)
    default = latency_summary(single_query_times(scorer, split, args.latency_queries))
    latency = {"search_default_beam": {k: round(v, 4) for k, v in default.items()},
               "exact_all_labels": {k: round(v, 4) for k, v in latency_summary(exact_times).items()}}
    print(f"  single query, default beam {scorer.default_beam}: {latency}", flush=True)
    return {"sweep": sweep, "latency_ms": latency}


def curve_runs(d: dict[str, Any], cfg: dict[str, Any], args: argparse.Namespace, tree: LabelTree
               ) -> dict[str, list[tuple[float, float]]]:
    """P@1 on the first documents against training seconds, adversarial vs uniform negatives."""
    split = d["eval"]
    n = min(args.curve_docs, len(split))
    q, tokens = split.rows(0, n)
    zeros = {"classifier_weights": np.zeros((d["num_labels"], q.shape[1]), np.float32),
             "classifier_bias": np.zeros(d["num_labels"], np.float32)}
    logpn = TreeScorer.from_arrays({**tree.arrays(), **zeros}).log_pn(q, tokens)
    clf = d["ckpt"].classifiers
    lexical = lexical_of(d, cfg, d["ckpt"].seed)[0] if cfg["lexical"] else None  # one start for both samplers
    curves: dict[str, list[tuple[float, float]]] = {}
    for sampler in ("adversarial", "uniform"):
        points: list[tuple[float, float]] = []

        def record(elapsed: float, step: int, arrays: dict[str, np.ndarray], points=points, sampler=sampler) -> None:
            xi = TreeScorer.from_arrays({**tree.arrays(), **{k: np.asarray(v) for k, v in arrays.items()}})
            scores = xi.classifier_scores(q, tokens) + (logpn if sampler == "adversarial" else 0.0)
            top6 = top_k(scores, 6)[0]  # a partition: whole sorts dominated a 4,000-document curve
            p1 = ranking_metrics(split.drop_own(top6), split.truths[:n], ks=(1,))["P@1"]
            points.append((elapsed, float(p1)))

        model = classifier_from_config(cfg, d["ckpt"].seed, sampler)
        model.fit(d["trn_x"], d["trn_targets"], d["num_labels"], tree, callback=record,
                  callback_every=args.eval_every, tokens=d["tokens"], lexical=lexical,
                  start=one_vs_all_start(cfg, (clf.weights_, clf.bias_), d["ckpt"].centroids.vectors_)
                  if cfg["start"] == "one_vs_all" else None)
        curves[sampler] = points
        print(f"  {sampler}: {model.fit_stats_['steps']} steps in {model.fit_stats_['train_seconds']:.1f}s, "
              f"P@1 {points[0][1]:.2f} -> {points[-1][1]:.2f}", flush=True)
    return curves


def convergence(d: dict[str, Any], cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    t = time.perf_counter()
    tree = fit_p_n(cfg, d["ckpt"].seed, d["trn_x"], d["trn_targets"], d["num_labels"], d["tokens"])
    tree_s = time.perf_counter() - t
    curves = curve_runs(d, cfg, args, tree)
    uniform_final, uniform_s = curves["uniform"][-1][1], curves["uniform"][-1][0]
    reach = next((s for s, p in curves["adversarial"] if p >= uniform_final), None)
    out = {"tree_fit_seconds": round(tree_s, 2), "curves": curves, "same_config": {
        "uniform_final_P@1": uniform_final, "uniform_seconds": round(uniform_s, 2),
        "adversarial_start_P@1": curves["adversarial"][0][1], "adversarial_final_P@1": curves["adversarial"][-1][1],
        "adversarial_seconds_to_uniform_final": None if reach is None else round(reach, 2),
        "fraction_incl_tree_fit": None if reach is None else round((reach + tree_s) / uniform_s, 4)}}
    print(f"  convergence: {out['same_config']}", flush=True)
    return out


def seeds(d: dict[str, Any], cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The tree route refitted with each seed on the same checkpoint: each seed's metrics, then
    every metric's mean, lowest and highest over the seeds."""
    runs = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        scorer, fit_s = fit(d, cfg, seed)
        ranked = searched(scorer, d["eval"], 6)[0]
        runs[seed] = {**metrics_of(ranked, d["eval"], d["inv_prop"]), "fit_s": round(fit_s, 1)}
        print(f"  seed {seed}: {runs[seed]}", flush=True)
    summary = {name: {"mean": round(float(np.mean(v)), 2), "min": min(v), "max": max(v)}
               for name in ("P@1", "P@5", "PSP@5") for v in [[r[name] for r in runs.values()]]}
    print(f"  over seeds {args.seeds}: {summary}", flush=True)
    return {"runs": runs, "summary": summary}


def plot(curves: dict[str, list[tuple[float, float]]], summary: dict[str, Any], title: str, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, label in (("adversarial", "negatives from p_n (xi + log p_n)"), ("uniform", "uniform negatives (xi)")):
        xs, ys = zip(*curves[name], strict=True)
        ax.plot(xs, ys, marker=".", label=label)
    ax.axhline(summary["uniform_final_P@1"], color="grey", linestyle=":", linewidth=1)
    if summary["adversarial_seconds_to_uniform_final"] is not None:
        ax.axvline(summary["adversarial_seconds_to_uniform_final"], color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("training time (s, evaluation excluded)")
    ax.set_ylabel("P@1 (%)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    args = parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    parts = set(args.parts.split(","))
    base = json.loads(args.config)
    cfg = resolve_config(base)
    d = load(args)
    result: dict[str, Any] = {"command": command_line(), "git": git_revision(), "data": args.data,
                              "checkpoint": args.checkpoint, "split": args.split, "filter": args.filter,
                              "config": cfg}
    last = None
    if "changes" in parts:
        result["changes"], last = changes(d, base, args)
    if parts & {"ablation", "beams"}:
        if args.fitted:
            if d["ckpt"].tree is None:
                raise SystemExit(f"{args.checkpoint}: no tree.npz (--fitted)")
            scorer = TreeScorer.from_arrays(d["ckpt"].tree.arrays_)
            result["config"] = resolve_config(d["ckpt"].config.get("tree", {}))
        elif last is not None and last[0] == cfg:  # the last change's model is the default one
            scorer, result["fit_seconds"] = last[1], last[2]
        else:
            scorer, result["fit_seconds"] = fit(d, cfg)
        if "ablation" in parts:
            result["ablation"] = ablation(d, scorer)
        if "beams" in parts:
            result["beams"] = beams(d, scorer, args)
    if "convergence" in parts:
        result["convergence"] = convergence(d, cfg, args)
        png = out_dir / "tree_convergence.png"
        title = f"{Path(args.data).name} {args.split}: adversarial vs uniform negatives, same config"
        plot(result["convergence"]["curves"], result["convergence"]["same_config"], title, png)
        if out_dir.resolve() == (OUT_DIR / "tree").resolve():  # side runs (--out) leave the published plot
            shutil.copyfile(png, BENCH_DIR / "tree_convergence.png")
    if "seeds" in parts:
        result["seeds"] = seeds(d, cfg, args)
    path = out_dir / f"{Path(args.data).name}-{args.split}.json"
    path.write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
