"""The whole path as the number of labels grows: train, export, load, serve, accuracy, HTTP.

    python bench/scale.py [--labels 10000,100000,1000000] [--out bench/out/scale] [--config FILE]
                          [--sample 1000] [--redo STAGE,...] [--swap] [--no-publish]

For each L, data from `shortlist generate-data --profile scale` (N = L training documents,
L / 10 test documents; Zipf 1.1 label frequencies, clusters of related labels), then these
stages, each in its own process, each result saved as OUT/L<L>/<stage>.json. A run skips every
stage whose result is there, so an interrupted run continues from the last finished stage
(`--redo` forces stages again):

  data     generate the dataset (wall time)
  train    `shortlist train`: wall time and peak RSS of the process, each training stage's wall
           time and peak RSS (the checkpoint's metrics)
  export   `shortlist export`: wall time, peak RSS, bytes of each bundle file
  serve    a fresh process: Predictor.load (time, RSS and PSS after), in-process single-query
           p50/p99 and batch queries/s on a sample of test documents, the same sample on the
           tree route, then PSS (memory-mapped pages count once touched) with the bundle files
           resident and whether the HNSW indices are served; accuracy of the served top 5
           against exact scoring over all L labels (P@1, P@5 of both, overlap of the top 5)
  sources  recall of each shortlist source, and of the served union, against the exact top 5
  http     `shortlist serve`: HTTP p50/p99 of /v1/predict at one connection
  swap     (--swap) bench/swap.py on the bundle: zero failed requests while it is swapped

Then a table (bench/RESULTS.md, section "scale") and a log-log plot of each cost against L
with its slope (bench/scale.png).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _common import BENCH_DIR, OUT_DIR, REPO_ROOT, command_line, git_revision, latency_summary, replace_section

STAGES = ("data", "train", "export", "serve", "sources", "http", "swap")
CLI = [sys.executable, "-m", "shortlist.cli"]
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
K = 5
# The commit measured: a run from a snapshot of the tree (no .git) names it in BENCH_REVISION.
REVISION = os.environ.get("BENCH_REVISION") or git_revision()


class BenchError(RuntimeError):
    pass


# --------------------------------------------------------------------------- subprocesses


def run_measured(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> dict[str, float]:
    """Run cmd (output appended to log); its wall time and peak RSS (from wait4)."""
    with log.open("a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        start = time.perf_counter()
        # PYTHONPATH: this checkout's code, also when it is a snapshot beside the installed one
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})})
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise BenchError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}); see {log}")
    return {"wall_s": round(wall, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024.0, 1)}


def memory_of(pid: int | str = "self", under: Path | None = None) -> dict[str, Any]:
    """RSS and PSS of a process (MiB), and the PSS of each file under `under` it maps."""
    rss = pss = 0
    files: dict[str, float] = {}
    path = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else None
            elif line.startswith("Rss:"):
                rss += int(line.split()[1])
            elif line.startswith("Pss:"):
                kib = int(line.split()[1])
                pss += kib
                if under is not None and path and path.startswith(str(under)):
                    name = Path(path).name
                    files[name] = files.get(name, 0.0) + kib / 1024.0
    return {"rss_mib": round(rss / 1024.0, 1), "pss_mib": round(pss / 1024.0, 1),
            "bundle_files_pss_mib": {k: round(v, 1) for k, v in sorted(files.items()) if v >= 0.05}}


# --------------------------------------------------------------------------- stages


def stage_data(ctx: dict[str, Any]) -> dict[str, Any]:
    data = Path(ctx["data"])
    if (data / "tst.json.gz").is_file():
        return {"reused": str(data)}
    cmd = [*CLI, "generate-data", "--profile", "scale", "--labels", str(ctx["labels"]), "--out", str(data),
           "--seed", str(ctx["seed"])]
    return run_measured(cmd, ctx["log"])


def stage_train(ctx: dict[str, Any]) -> dict[str, Any]:
    cmd = [*CLI, "train", "--data", ctx["data"], "--out", ctx["checkpoint"], "--seed", str(ctx["seed"])]
    if ctx["config"]:
        cmd += ["--config", ctx["config"]]
    out = run_measured(cmd, ctx["log"])
    metrics = json.loads((Path(ctx["checkpoint"]) / "checkpoint.json").read_text())["metrics"]
    return {**out, "stages": metrics.get("times", {}), "stage_peak_rss_mib": metrics.get("peak_rss_mib", {}),
            "losses": metrics.get("losses"), "validation": metrics.get("validation"),
            "module1": metrics.get("module1"), "module3": metrics.get("module3")}


def stage_export(ctx: dict[str, Any]) -> dict[str, Any]:
    bundle = Path(ctx["bundle"])
    if bundle.exists():
        import shutil

        shutil.rmtree(bundle)
    out = run_measured([*CLI, "export", ctx["checkpoint"], "--out", str(bundle.parent), "--version", bundle.name],
                       ctx["log"])
    sizes = {f.name: f.stat().st_size for f in sorted(bundle.iterdir())}
    manifest = json.loads((bundle / "manifest.json").read_text())
    return {**out, "files_bytes": sizes, "bundle_bytes": sum(sizes.values()), "scoring": manifest["scoring"]}


def stage_worker(name: str):
    def run(ctx: dict[str, Any]) -> dict[str, Any]:
        spec = Path(ctx["dir"]) / f"spec-{name}.json"
        result = Path(ctx["dir"]) / f"worker-{name}.json"
        result.unlink(missing_ok=True)
        spec.write_text(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in ctx.items()}))
        out = run_measured([sys.executable, str(Path(__file__).resolve()), f"_{name}", str(spec), str(result)],
                           ctx["log"], ONE_THREAD)
        return {**json.loads(result.read_text()), "process": out}
    return run


def stage_swap(ctx: dict[str, Any]) -> dict[str, Any]:
    results = Path(ctx["dir"]) / "swap-results.md"
    cmd = [sys.executable, str(BENCH_DIR / "swap.py"), "--bundle", ctx["bundle"], "--data", ctx["data"],
           "--seconds", "20", "--connections", "4", "--swap-pause", "1", "--results", str(results)]
    try:
        run_measured(cmd, ctx["log"])
        ok = True
    except BenchError:
        ok = False  # swap.py exits 1 on a failed request or activation: the figures say which
    return {"ok": ok, **json.loads((OUT_DIR / "swap.json").read_text())}


# --------------------------------------------------------------------------- workers (fresh processes)


def _sample(ctx: dict[str, Any]) -> tuple[list[str], list[list[int]]]:
    from training.data import load_split

    tst = load_split(ctx["data"], "tst", "title", int(ctx["labels"]))
    rng = np.random.default_rng(0)
    rows = rng.choice(len(tst), size=min(int(ctx["sample"]), len(tst)), replace=False)
    return [tst.texts[i] for i in rows], [tst.targets[i] for i in rows]


def _timed(call, texts: Sequence[str], warmup: int = 50) -> dict[str, float]:
    for t in texts[:warmup]:
        call(t)
    seconds = []
    for t in texts:
        t0 = time.perf_counter()
        call(t)
        seconds.append(time.perf_counter() - t0)
    return {k: round(v, 4) for k, v in latency_summary(seconds).items()}


def worker_serve(ctx: dict[str, Any]) -> dict[str, Any]:
    from service.engine import Predictor, PredictorOptions
    from service.engine.metrics import ranking_metrics

    texts, truths = _sample(ctx)
    bundle = Path(ctx["bundle"]).resolve()
    t0 = time.perf_counter()
    predictor = Predictor.load(bundle, PredictorOptions(threads=1))
    out: dict[str, Any] = {"load_s": round(time.perf_counter() - t0, 3), "after_load": memory_of(under=bundle)}
    out["single"] = _timed(lambda t: predictor.predict_ids([t], k=K), texts)
    # The same queries again, the label rows they read resident: at 10^6 labels a first pass's rows
    # are mostly first touches of pages of 512 MB memory-mapped arrays (7eae4ae: 0.205 vs 0.202 ms).
    out["single_again"] = _timed(lambda t: predictor.predict_ids([t], k=K), texts, warmup=0)
    t0 = time.perf_counter()
    served = np.vstack([predictor.predict_ids(texts[i : i + 256], k=K)[0] for i in range(0, len(texts), 256)])
    out["batch_qps"] = round(len(texts) / (time.perf_counter() - t0), 1)
    if predictor.bundle.has_tree:
        out["tree_single"] = _timed(lambda t: predictor.predict_tree_ids([t], k=K), texts)
        tree_ids = predictor.predict_tree_ids(texts, k=K)[0]
        out["tree"] = {k: round(v, 3) for k, v in ranking_metrics(tree_ids, truths, (1, 5)).items()}
    spec = predictor.scoring.shortlist
    out["after_serving"] = {**memory_of(under=bundle), "hnsw_served": spec.searches_hnsw,
                            "shortlist": spec.model_dump()}
    t0 = time.perf_counter()
    exact = np.vstack([predictor.predict_exact_ids(texts[i : i + 64], k=K)[0] for i in range(0, len(texts), 64)])
    out["exact_s_per_query"] = round((time.perf_counter() - t0) / len(texts), 4)
    out["served"] = {k: round(v, 3) for k, v in ranking_metrics(served, truths, (1, 5)).items()}
    out["exact"] = {k: round(v, 3) for k, v in ranking_metrics(exact, truths, (1, 5)).items()}
    overlap = [len(set(a) & set(b)) / K for a, b in zip(served, exact, strict=True)]
    out["top5_overlap"] = round(float(np.mean(overlap)), 4)
    np.save(Path(ctx["dir"]) / "exact_top5.npy", exact)
    return out


def _recall(cands: Sequence[np.ndarray], exact: np.ndarray) -> dict[str, float]:
    hits = [np.isin(e[e >= 0], c).mean() if (e >= 0).any() else 1.0 for c, e in zip(cands, exact, strict=False)]
    return {"recall@exact5": round(float(np.mean(hits)), 4), "mean_size": round(float(np.mean([len(c) for c in cands])),
                                                                                  1)}


def worker_sources(ctx: dict[str, Any]) -> dict[str, Any]:
    """Recall of each source alone (HNSW at the served size, or PROBE when not served) and of
    the served union, against the exact top 5 saved by the serve stage."""
    from service.engine import Predictor, PredictorOptions
    from service.engine.bundle import Bundle

    texts, _ = _sample(ctx)
    exact = np.load(Path(ctx["dir"]) / "exact_top5.npy")
    bundle = Bundle.open(Path(ctx["bundle"]).resolve())
    spec = bundle.manifest.scoring.shortlist
    probe = int(ctx["probe"])
    out: dict[str, Any] = {"served": spec.model_dump()}
    union = Predictor(bundle)
    out["union"] = _recall(union.shortlist(texts), exact)
    head = union.sources.head
    out["head"] = _recall([head] * len(texts), exact)
    choices = {"token_rows": {"k_w": 0, "k_mu": 0, "k_tok": spec.k_tok or 10, "k_head": 0},
               "hnsw_w": {"k_w": spec.k_w or probe, "k_mu": 0, "k_tok": 0, "k_head": 0},
               "hnsw_mu": {"k_w": 0, "k_mu": spec.k_mu or probe, "k_tok": 0, "k_head": 0}}
    out["index_recall@50"] = _index_recall(bundle, union, texts[:200], probe)
    for name, sizes in choices.items():
        if name == "token_rows" and bundle.token_table() is None:
            continue
        t0 = time.perf_counter()
        cands = Predictor(bundle, PredictorOptions(lexical_weight=0.0, **sizes)).shortlist(texts)
        out[name] = {**_recall(cands, exact), "sizes": sizes, "s_per_query": round((time.perf_counter() - t0)
                                                                                   / len(texts), 5)}
    return out


EF_PROBES = (50, 100, 200, 400)


def _index_recall(bundle: Any, predictor: Any, texts: Sequence[str], k: int) -> dict[str, Any]:
    """Each HNSW index's own recall: its top k against the exact top k by inner product, at the
    bundle's ef_search and at each of EF_PROBES (one query at a time: ms per search)."""
    from service.engine import schema

    q = predictor.encode(texts)
    out: dict[str, Any] = {}
    every = np.arange(bundle.manifest.num_labels)
    w, mu = (bundle.vector_rows(name, every) for name in (schema.CLASSIFIERS, schema.CENTROIDS))
    for name, vectors, queries in (("hnsw_w", np.hstack([w, bundle.classifier_bias[:, None]]),
                                    np.hstack([q, np.ones((len(q), 1), np.float32)])),
                                   ("hnsw_mu", mu, q)):
        dense = np.asarray(vectors, dtype=np.float32)
        exact = np.vstack([np.argpartition(-(queries[i : i + 50] @ dense.T), k, axis=1)[:, :k]
                           for i in range(0, len(queries), 50)])
        index = bundle.index(name.removeprefix("hnsw_"))
        by_ef = {}
        # One loaded copy, its breadth changed in place (bundle.index(name, ef) would load a copy per ef).
        for ef in (*EF_PROBES, index.ef_search):
            index._index.set_ef(ef)
            t0 = time.perf_counter()
            found = np.vstack([index.search(queries[i : i + 1], k) for i in range(len(queries))])
            ms = (time.perf_counter() - t0) / len(queries) * 1e3
            recall = float(np.mean([np.isin(e, f).mean() for e, f in zip(exact, found, strict=True)]))
            by_ef[ef] = {"recall": round(recall, 4), "ms": round(ms, 3)}
        out[name] = by_ef[index.ef_search]["recall"]
        out[f"{name}_by_ef"] = by_ef
    return out


def worker_http(ctx: dict[str, Any]) -> dict[str, Any]:
    import httpx

    from shortlist.testing import serve

    texts, _ = _sample(ctx)
    bundle = Path(ctx["bundle"]).resolve()
    with serve(bundle.parent, version=bundle.name, log_dir=Path(ctx["dir"]), timeout=3600) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            def call(text: str) -> None:
                r = client.post("/v1/predict", json={"text": text, "k": K})
                if r.status_code != 200:
                    raise BenchError(f"HTTP {r.status_code}: {r.text[:200]}")
            out = {"http_single": _timed(call, texts[:500])}
        out["server"] = memory_of(server.proc.pid, bundle)
    return out


WORKERS = {"_serve": worker_serve, "_sources": worker_sources, "_http": worker_http}
RUNNERS = {"data": stage_data, "train": stage_train, "export": stage_export, "serve": stage_worker("serve"),
           "sources": stage_worker("sources"), "http": stage_worker("http"), "swap": stage_swap}


# --------------------------------------------------------------------------- driver


def run_level(args: argparse.Namespace, labels: int) -> dict[str, Any]:
    """Every stage at one L, skipping those whose result is saved; returns all results."""
    run_dir = args.out / f"L{labels}"
    run_dir.mkdir(parents=True, exist_ok=True)
    ctx = {"labels": labels, "seed": args.seed, "sample": args.sample, "probe": args.probe,
           "dir": str(run_dir), "log": run_dir / "log.txt", "data": str(args.out / f"data-{labels}"),
           "checkpoint": str(run_dir / "checkpoint"), "bundle": str(run_dir / "bundles" / "scale"),
           "config": str(Path(args.config).resolve()) if args.config else ""}
    results: dict[str, Any] = {}
    for stage in STAGES:
        if (stage == "swap" and not args.swap) or (args.stages and stage not in args.stages):
            continue
        path = run_dir / f"{stage}.json"
        if path.is_file() and stage not in args.redo:
            results[stage] = json.loads(path.read_text())
            continue
        print(f"L={labels}: {stage} ...", flush=True)
        t0 = time.perf_counter()
        result = {**RUNNERS[stage](ctx), "revision": REVISION, "finished": time.strftime("%Y-%m-%d %H:%M")}
        path.write_text(json.dumps(result, indent=1))
        results[stage] = result
        print(f"L={labels}: {stage} done in {time.perf_counter() - t0:.0f} s", flush=True)
    return results


def _get(d: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


# name -> (unit, path into a level's results): the costs plotted against L
COSTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "training (s)": ("s", ("train", "wall_s")),
    "training peak RSS (MiB)": ("MiB", ("train", "peak_rss_mib")),
    "export (s)": ("s", ("export", "wall_s")),
    "bundle on disk (MiB)": ("MiB", ("export", "bundle_mib")),
    "load (s)": ("s", ("serve", "load_s")),
    "serving PSS (MiB)": ("MiB", ("serve", "after_serving", "pss_mib")),
    "single query p50 (ms)": ("ms", ("serve", "single", "p50_ms")),
    "single query p50, rows resident (ms)": ("ms", ("serve", "single_again", "p50_ms")),
    "HTTP p50 (ms)": ("ms", ("http", "http_single", "p50_ms")),
}


def slope(ls: Sequence[int], values: Sequence[float | None]) -> float | None:
    pts = [(np.log(x), np.log(v)) for x, v in zip(ls, values, strict=False) if v]
    if len(pts) < 2:
        return None
    x, y = np.array(pts).T
    return float(np.polyfit(x, y, 1)[0])


def cost_series(levels: dict[int, dict[str, Any]]) -> dict[str, list[float | None]]:
    for res in levels.values():
        if "export" in res:
            res["export"]["bundle_mib"] = res["export"]["bundle_bytes"] / 2**20
    return {name: [_get(levels[L], *path) for L in levels] for name, (_, path) in COSTS.items()}


def plot(levels: dict[int, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ls = sorted(levels)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=80)
    for name, values in cost_series({L: levels[L] for L in ls}).items():
        pts = [(x, v) for x, v in zip(ls, values, strict=False) if v]
        if len(pts) < 2:
            continue
        s = slope(ls, values)
        ax.plot(*zip(*pts, strict=False), marker="o", label=f"{name}: slope {s:.2f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("labels L (N = L training documents)")
    ax.set_title("Shortlist costs against L (log-log; slope = growth exponent)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


TRAIN_STAGES = ("data", "module1", "module3", "token_shortlist", "indices", "tuning", "tree")


def training_table(levels: dict[int, dict[str, Any]]) -> list[str]:
    rows = ["| L | training (s) | " + " | ".join(TRAIN_STAGES) + " (s) | training peak RSS (MiB) | peak by stage "
            "(MiB) | export (s) | export peak RSS (MiB) | bundle (MiB) |",
            "|---|---|" + "---|" * len(TRAIN_STAGES) + "---|---|---|---|---|"]
    for L, res in levels.items():
        tr, ex = res.get("train", {}), res.get("export", {})
        stages = [fmt(_get(tr, "stages", f"{s}_s")) for s in TRAIN_STAGES]
        peaks = ", ".join(f"{k} {v:.0f}" for k, v in (tr.get("stage_peak_rss_mib") or {}).items())
        rows.append(f"| {L:,} | {fmt(tr.get('wall_s'), 0)} | " + " | ".join(stages)
                    + f" | {fmt(tr.get('peak_rss_mib'), 0)} | {peaks or '-'} | {fmt(ex.get('wall_s'), 0)} | "
                    f"{fmt(ex.get('peak_rss_mib'), 0)} | {fmt(ex.get('bundle_mib'), 0)} |")
    return rows


def serving_table(levels: dict[int, dict[str, Any]]) -> list[str]:
    rows = ["| L | load (s) | PSS after load / after serving (MiB) | bytes per label | HNSW served | single p50 / p99 "
            "(ms) | again, rows resident: p50 (ms) | batch (q/s) | tree p50 (ms) | HTTP p50 / p99 (ms) | "
            "served P@1 / P@5 | exact P@1 / P@5 | top-5 overlap |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for L, res in levels.items():
        sv, ht = res.get("serve", {}), res.get("http", {})
        pss = _get(sv, "after_serving", "pss_mib")
        rows.append(
            f"| {L:,} | {fmt(sv.get('load_s'), 2)} | {fmt(_get(sv, 'after_load', 'pss_mib'), 0)} / {fmt(pss, 0)} | "
            f"{fmt(pss * 2**20 / L if pss else None, 0)} | {fmt(_get(sv, 'after_serving', 'hnsw_served'))} | "
            f"{fmt(_get(sv, 'single', 'p50_ms'), 3)} / {fmt(_get(sv, 'single', 'p99_ms'), 3)} | "
            f"{fmt(_get(sv, 'single_again', 'p50_ms'), 3)} | "
            f"{fmt(sv.get('batch_qps'), 0)} | {fmt(_get(sv, 'tree_single', 'p50_ms'), 3)} | "
            f"{fmt(_get(ht, 'http_single', 'p50_ms'), 2)} / {fmt(_get(ht, 'http_single', 'p99_ms'), 2)} | "
            f"{fmt(_get(sv, 'served', 'P@1'), 2)} / {fmt(_get(sv, 'served', 'P@5'), 2)} | "
            f"{fmt(_get(sv, 'exact', 'P@1'), 2)} / {fmt(_get(sv, 'exact', 'P@5'), 2)} | "
            f"{fmt(sv.get('top5_overlap'), 3)} |")
    return rows


def sources_table(levels: dict[int, dict[str, Any]]) -> list[str]:
    names = ("token_rows", "hnsw_w", "hnsw_mu", "head", "union")
    rows = ["| L | served sizes | " + " | ".join(f"{n}: recall (mean size)" for n in names)
            + " | HNSW's own recall@50, w / mu | by ef_search: recall w / mu (ms a search) |",
            "|---|---|" + "---|" * (len(names) + 2)]
    for L, res in levels.items():
        src = res.get("sources", {})
        served = src.get("served", {})
        cells = [f"{fmt(_get(src, n, 'recall@exact5'), 3)} ({fmt(_get(src, n, 'mean_size'), 0)})" for n in names]
        sizes = ", ".join(f"{k}={served[k]}" for k in ("k_tok", "k_w", "k_mu", "k_head") if k in served)
        own = src.get("index_recall@50", {})
        w_ef, mu_ef = own.get("hnsw_w_by_ef", {}), own.get("hnsw_mu_by_ef", {})
        by_ef = "; ".join(
            f"{ef}: {fmt(_get(w_ef, ef, 'recall'), 3)} / {fmt(_get(mu_ef, ef, 'recall'), 3)}"
            f" ({fmt(_get(w_ef, ef, 'ms'), 2)} / {fmt(_get(mu_ef, ef, 'ms'), 2)})"
            for ef in (str(e) for e in EF_PROBES) if ef in w_ef)
        rows.append(f"| {L:,} | {sizes or '-'} | " + " | ".join(cells)
                    + f" | {fmt(own.get('hnsw_w'), 3)} / {fmt(own.get('hnsw_mu'), 3)} | {by_ef or '-'} |")
    return rows


def render(args: argparse.Namespace, levels: dict[int, dict[str, Any]]) -> str:
    ls = list(levels)
    series = cost_series(levels)
    slopes = [f"{name} {fmt(slope(ls, v), 2)}" for name, v in series.items()]
    query_slope = " and ".join(f"{_tail_slope(ls, series[name])} ({label})" for name, label in (
        ("single query p50 (ms)", "first pass"), ("single query p50, rows resident (ms)", "rows resident")))
    revisions = sorted({r.get("revision", "?") for res in levels.values() for r in res.values() if isinstance(r, dict)})
    return "\n".join([
        "## Scale: the whole path from 10^4 to 10^6 labels", "",
        f"Command: `{command_line()}`; commits {', '.join(revisions)}; data `shortlist generate-data --profile scale` "
        "(N = L training documents, L / 10 test; Zipf 1.1 label frequencies, 1-10 labels a document, clusters of "
        f"related labels), D = 256, a sample of {args.sample} test documents. 2 CPU cores shared with other agents: "
        "times are this run's, compare within a column.", "",
        "Training and export:", "", *training_table(levels), "",
        "Serving (in-process single query: one thread; PSS counts memory-mapped pages once touched, after the sample "
        "was served on both routes; accuracy: the served top 5 against exact scoring of all L labels):", "",
        *serving_table(levels), "",
        "Recall of each shortlist source against the exact top 5 (sources not served probed at "
        f"{args.probe}):", "", *sources_table(levels), "",
        f"Log-log slopes over L: {'; '.join(slopes)}. Single-query p50 slope from 10^5 to 10^6: {query_slope} "
        "(bar < 0.2). Plot: bench/scale.png.",
    ])


def _tail_slope(ls: Sequence[int], values: Sequence[float | None]) -> str:
    """The log-log slope of values over L from 10^5 up ("-" with fewer than two points)."""
    tail = [(L, v) for L, v in zip(ls, values, strict=False) if L >= 100_000 and v]
    return fmt(slope(*zip(*tail, strict=False)), 2) if len(tail) >= 2 else "-"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--labels", default="10000,100000,1000000", help="comma-separated label counts")
    ap.add_argument("--out", type=Path, default=OUT_DIR / "scale")
    ap.add_argument("--config", default=None, help="training config JSON for every L")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample", type=int, default=1000, help="test documents served and scored exactly")
    ap.add_argument("--probe", type=int, default=50, help="HNSW size when a source is not served")
    ap.add_argument("--redo", default="", help=f"comma-separated stages to run again ({', '.join(STAGES)})")
    ap.add_argument("--stages", default="", help=f"comma-separated stages to run (default: all of {', '.join(STAGES)})")
    ap.add_argument("--swap", action="store_true", help="also run bench/swap.py on each bundle")
    ap.add_argument("--no-publish", action="store_true", help="do not write bench/RESULTS.md and bench/scale.png")
    args = ap.parse_args(argv)
    try:
        args.levels = [int(x) for x in args.labels.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--labels {args.labels!r}: expected comma-separated integers")
    args.redo = {s for s in args.redo.split(",") if s}
    args.stages = {s for s in args.stages.split(",") if s}
    unknown = (args.redo | args.stages) - set(STAGES)
    if unknown:
        ap.error(f"unknown stages {sorted(unknown)}; known: {', '.join(STAGES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in WORKERS:
        ctx = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(json.dumps(WORKERS[argv[0]](ctx)))
        return 0
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    levels: dict[int, dict[str, Any]] = {}
    for labels in args.levels:
        levels[labels] = run_level(args, labels)
    text = render(args, levels)
    print(text)
    (args.out / "scale.md").write_text(text)
    if not args.no_publish:
        plot(levels, BENCH_DIR / "scale.png")
        replace_section(BENCH_DIR / "RESULTS.md", "scale", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
