"""HTTP throughput and latency of `shortlist serve` against the framework's floor, in one run.

    python bench/http.py --bundle-root ROOT [--version V] [--data ../shared/data/debian-deps]
                         [--seconds 5] [--connections 1 16]

Starts real servers (uvicorn subprocesses, echo route on): the default configuration, one
with dynamic batching off and one with a 1 ms max wait. Closed-loop httpx client threads
(one keep-alive connection each) measure req/s and p50/p99 at each connection count for
POST /v1/predict on each server and for POST /v1/echo (same app, same JSON parsing and
middleware, no model work): predict/echo is the share of the framework's floor that the
service keeps. Also texts/s with 64 texts per request, and a paired run on one connection
alternating echo and predict requests (a drift-free estimate of the one-connection ratio).
The machine is shared, so every point is measured in several short interleaved rounds and
medians are reported. Figures go to stdout, bench/out/http.json and bench/RESULTS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/http.py (the entry point) is named like the standard library's `http` package: take
# this folder off the path before anything imports http.client, and load the bench helpers
# by file location.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import numpy as np  # noqa: E402


def _load(name: str, path: Path):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_common = _load("_common", _HERE / "_common.py")
serve = _load("_server", _HERE.parent / "tests" / "_server.py").serve
OUT_DIR, command_line, git_revision = _common.OUT_DIR, _common.command_line, _common.git_revision
latency_summary, read_jsonl = _common.latency_summary, _common.read_jsonl


def query_texts(bundle_dir: Path, data: str | None, n: int, seed: int = 0) -> list[str]:
    if data:
        split = next(p for p in (Path(data) / f"tst{ext}" for ext in (".json.gz", ".jsonl", ".json")) if p.exists())
        texts = [r["title"] for r in read_jsonl(split, limit=20000) if str(r.get("title", "")).strip()]
    else:
        texts = [r["title"] for r in read_jsonl(bundle_dir / "labels.jsonl", limit=20000) if r["title"].strip()]
    rng = np.random.default_rng(seed)
    return [texts[int(i)][:2000] for i in rng.integers(0, len(texts), size=n)]


def closed_loop(url: str, path: str, bodies: Sequence[dict[str, Any]], connections: int, seconds: float,
                warmup_s: float = 1.0) -> dict[str, float]:
    """`connections` threads, each sending requests back to back on its own keep-alive connection."""
    stop = threading.Event()
    measuring = threading.Event()
    lat: list[list[float]] = [[] for _ in range(connections)]
    errors: list[str] = []

    def worker(w: int) -> None:
        clock = time.perf_counter
        with httpx.Client(base_url=url, timeout=30) as c:
            i = w
            while not stop.is_set():
                body = bodies[i % len(bodies)]
                i += connections
                t0 = clock()
                r = c.post(path, json=body)
                dt = clock() - t0
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
                    continue
                if measuring.is_set():
                    lat[w].append(dt)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(connections)]
    for t in threads:
        t.start()
    time.sleep(warmup_s)
    measuring.set()
    t0 = time.perf_counter()
    time.sleep(seconds)
    measuring.clear()
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} failed requests, first: {errors[0]}")
    samples = [x for per in lat for x in per]
    return {"requests": len(samples), "req_s": len(samples) / elapsed, **latency_summary(samples)}


def paired_loop(url: str, echo_bodies: Sequence[dict[str, Any]], predict_bodies: Sequence[dict[str, Any]],
                connections: int, seconds: float, warmup_s: float = 0.5) -> dict[str, Any]:
    """Each connection alternates echo and predict requests, so both routes see the same
    machine at the same moments: mean latency echo / predict estimates the req/s ratio
    free of the drift that separates sequential points on a shared machine."""
    stop = threading.Event()
    measuring = threading.Event()
    lat: dict[str, list[float]] = {"echo": [], "predict": []}
    lock = threading.Lock()
    errors: list[str] = []

    def worker(w: int) -> None:
        clock = time.perf_counter
        mine: dict[str, list[float]] = {"echo": [], "predict": []}
        with httpx.Client(base_url=url, timeout=30) as c:
            i = w
            while not stop.is_set():
                for name, path, body in (("echo", "/v1/echo", echo_bodies[i % len(echo_bodies)]),
                                         ("predict", "/v1/predict", predict_bodies[i % len(predict_bodies)])):
                    t0 = clock()
                    r = c.post(path, json=body)
                    dt = clock() - t0
                    if r.status_code != 200:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                    elif measuring.is_set():
                        mine[name].append(dt)
                i += connections
        with lock:
            for name, xs in mine.items():
                lat[name].extend(xs)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(connections)]
    for t in threads:
        t.start()
    time.sleep(warmup_s)
    measuring.set()
    time.sleep(seconds)
    measuring.clear()
    stop.set()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} failed requests, first: {errors[0]}")
    out: dict[str, Any] = {name: latency_summary(xs) for name, xs in lat.items()}
    out["ratio"] = out["echo"]["mean_ms"] / out["predict"]["mean_ms"]
    return out


def scrape_batch_sizes(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith('shortlist_engine_batch_size_sum{scorer="alpha"}'):
            total = float(line.split()[-1])
        elif line.startswith('shortlist_engine_batch_size_count{scorer="alpha"}'):
            count = float(line.split()[-1])
    return {"engine_calls": count, "mean_texts_per_call": total / count if count else 0.0}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle-root", required=True, type=Path)
    ap.add_argument("--version", default=None)
    ap.add_argument("--data", default=None, help="dataset folder: queries from its tst titles (default: label titles)")
    ap.add_argument("--seconds", type=float, default=2.0, help="measured seconds per point and round")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds (the machine is shared: "
                    "alternating short points keeps drift out of the ratios)")
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64, help="texts per request in the batch measurement")
    ap.add_argument("--skip-batching-modes", action="store_true")
    ap.add_argument("--results", type=Path, default=_HERE / "RESULTS.md",
                    help="markdown file whose 'http' section is replaced with these figures")
    args = ap.parse_args(argv)

    root = args.bundle_root.resolve()
    if not root.is_dir():
        ap.error(f"--bundle-root {root} is not a directory")
    bundle_dir = root / (args.version or sorted(p.name for p in root.iterdir() if (p / "manifest.json").exists())[-1])
    texts = query_texts(bundle_dir, args.data, 4000)
    predict_bodies = [{"text": t, "k": args.k} for t in texts]
    echo_bodies = [{"text": t} for t in texts]
    batch_bodies = [{"texts": texts[i:i + args.batch], "k": args.k}
                    for i in range(0, len(texts) - args.batch, args.batch)]
    log_dir = OUT_DIR / "http-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    base_env = {"SHORTLIST_ECHO_ROUTE": "true", "SHORTLIST_MAX_BATCH": str(max(128, args.batch))}
    modes = {"batching (default)": {}}
    if not args.skip_batching_modes:
        modes["no batching"] = {"SHORTLIST_BATCHING": "false"}
        modes["batching, 1 ms wait"] = {"SHORTLIST_BATCH_MAX_WAIT_MS": "1"}
    results: dict[str, Any] = {"command": command_line(), "revision": git_revision(), "bundle": str(bundle_dir),
                               "seconds_per_point": args.seconds, "rounds": args.rounds, "points": {}}

    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(serve(root, version=args.version, env={**base_env, **env},
                                                log_dir=log_dir, timeout=300)).url
                for name, env in modes.items()}
        print(f"serving {bundle_dir}; modes: {', '.join(modes)}", flush=True)
        main_url = urls["batching (default)"]
        plan: list[tuple[str, str, str, Sequence[dict[str, Any]], int, int]] = []
        for conns in args.connections:
            plan.append(("echo (framework floor)", main_url, "/v1/echo", echo_bodies, conns, 1))
            for name, url in urls.items():
                plan.append((f"predict, {name}", url, "/v1/predict", predict_bodies, conns, 1))
        for conns in (1, 2):
            plan.append((f"predict, {args.batch} texts/request", main_url, "/v1/predict", batch_bodies, conns,
                         args.batch))
        samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for rnd in range(args.rounds):
            order = plan if rnd % 2 == 0 else plan[::-1]
            for name, url, path, bodies, conns, per_request in order:
                r = closed_loop(url, path, bodies, conns, args.seconds, warmup_s=0.3)
                r["texts_per_request"] = per_request
                samples.setdefault((name, conns), []).append(r)
            print(f"round {rnd + 1}/{args.rounds} done", flush=True)
        results["batch_sizes_default"] = scrape_batch_sizes(main_url)
        # One connection only: with many, predict waits for engine workers that echo never
        # queues for, so mean latencies stop estimating a throughput ratio.
        paired = {1: paired_loop(main_url, echo_bodies, predict_bodies, 1, args.seconds * args.rounds)}
        results["paired"] = paired

    table = ["| point | connections | req/s | texts/s | p50 (ms) | p99 (ms) | req/s per round |",
             "|---|---|---|---|---|---|---|"]
    print(f"\n{'point':<40} {'conns':>5} {'req/s':>9} {'texts/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for (name, conns), rs in samples.items():
        req_s = float(np.median([r["req_s"] for r in rs]))
        point = {"name": name, "connections": conns, "req_s_median": req_s,
                 "req_s_rounds": [round(r["req_s"], 1) for r in rs],
                 "texts_s_median": req_s * rs[0]["texts_per_request"],
                 "p50_ms_median": float(np.median([r["p50_ms"] for r in rs])),
                 "p99_ms_median": float(np.median([r["p99_ms"] for r in rs]))}
        results["points"][f"{name} @{conns}"] = point
        print(f"{name:<40} {conns:>5} {req_s:9.1f} {point['texts_s_median']:9.1f} "
              f"{point['p50_ms_median']:8.2f} {point['p99_ms_median']:8.2f}")
        table.append(f"| {name} | {conns} | {req_s:.0f} | {point['texts_s_median']:.0f} | "
                     f"{point['p50_ms_median']:.2f} | {point['p99_ms_median']:.2f} | "
                     f"{', '.join(f'{x:.0f}' for x in point['req_s_rounds'])} |")
    print()
    ratio_lines = []
    for conns in args.connections:
        echo = samples[("echo (framework floor)", conns)]
        for name in modes:
            pred = samples[(f"predict, {name}", conns)]
            ratios = [p["req_s"] / e["req_s"] for p, e in zip(pred, echo, strict=True)]
            results[f"ratio predict ({name}) / echo @{conns}"] = float(np.median(ratios))
            line = (f"ratio predict ({name}) / echo at {conns} connections: median {np.median(ratios):.2f} "
                    f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
            print(line)
            ratio_lines.append(f"- {line}")
    paired_lines = []
    for conns, pr in paired.items():
        line = (f"paired at {conns} connection (requests alternate echo and predict): echo p50 "
                f"{pr['echo']['p50_ms']:.2f} ms, mean {pr['echo']['mean_ms']:.2f} ms; predict p50 "
                f"{pr['predict']['p50_ms']:.2f} ms, mean {pr['predict']['mean_ms']:.2f} ms; "
                f"predict/echo throughput estimate {pr['ratio']:.2f}")
        print(line)
        paired_lines.append(f"- {line}")
    print(f"engine calls on the default server: {results['batch_sizes_default']}")
    out = OUT_DIR / "http.json"
    out.write_text(json.dumps(results, indent=2))
    calls = results["batch_sizes_default"]
    section = "\n".join([
        "## HTTP service: /v1/predict against the framework floor (echo route)", "",
        f"Command: `{results['command']}`", "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {results['revision']}, 2 CPU cores "
        f"shared with other jobs; bundle `{bundle_dir}`; k={args.k}; {args.rounds} interleaved rounds of "
        f"{args.seconds:g} s per point, medians; closed-loop httpx client threads on the same machine.", "",
        *table, "", *ratio_lines, "", *paired_lines, "",
        f"Default server: {calls['engine_calls']:.0f} engine calls, {calls['mean_texts_per_call']:.1f} texts per "
        "call on average (dynamic batching plus the 64-text requests).",
    ])
    _common.replace_section(args.results, "http", section)
    print(f"wrote {out} and the 'http' section of {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
