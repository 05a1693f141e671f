"""HTTP throughput and latency of `shortlist serve` against the framework's floor, in one run.

    python bench/http.py --bundle-root ROOT [--version V] [--data ../shared/data/debian-deps]
                         [--seconds 5] [--connections 1 16]

Starts a real server (uvicorn subprocess, echo route on) and, with closed-loop httpx client
threads (one keep-alive connection each), measures req/s and p50/p99 at each connection
count for POST /v1/predict and for POST /v1/echo (same app, same JSON parsing and
middleware, no model work): the ratio predict/echo is the share of the framework's floor
that the service keeps. Then texts/s with 64 texts per request, and predict at the highest
connection count with dynamic batching off and with a 1 ms max wait, to say whether
batching raises throughput. Figures go to stdout and bench/out/http.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named like the standard library's `http` package: take its folder off the
# path before anything imports http.client, then load the bench helpers by file location.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
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
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per point")
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64, help="texts per request in the batch measurement")
    ap.add_argument("--skip-batching-modes", action="store_true")
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
    results: dict[str, Any] = {"command": command_line(), "revision": git_revision(), "bundle": str(bundle_dir),
                               "seconds_per_point": args.seconds, "points": []}

    def point(name: str, url: str, path: str, bodies: Sequence[dict[str, Any]], conns: int,
              texts_per_request: int = 1) -> dict[str, Any]:
        r = closed_loop(url, path, bodies, conns, args.seconds)
        r.update({"name": name, "path": path, "connections": conns, "texts_s": r["req_s"] * texts_per_request})
        results["points"].append(r)
        print(f"{name:<34} conns={conns:<3} {r['req_s']:8.1f} req/s  {r['texts_s']:8.1f} texts/s  "
              f"p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms", flush=True)
        return r

    with serve(root, version=args.version, env=base_env, log_dir=log_dir, timeout=300) as s:
        print(f"serving {bundle_dir} at {s.url}", flush=True)
        for conns in args.connections:
            echo = point("echo (framework floor)", s.url, "/v1/echo", echo_bodies, conns)
            pred = point("predict (batching, wait 0)", s.url, "/v1/predict", predict_bodies, conns)
            ratio = pred["req_s"] / echo["req_s"]
            results[f"ratio_predict_over_echo_c{conns}"] = ratio
            print(f"  ratio predict/echo at {conns} connections: {ratio:.2f}", flush=True)
        results["batch_sizes_default"] = scrape_batch_sizes(s.url)
        print(f"  engine calls so far: {results['batch_sizes_default']}", flush=True)
        for conns in (1, 2):
            point(f"predict, {args.batch} texts/request", s.url, "/v1/predict", batch_bodies, conns, args.batch)

    if not args.skip_batching_modes:
        conns = max(args.connections)
        for label, env in (("predict (no batching)", {"SHORTLIST_BATCHING": "false"}),
                           ("predict (batching, wait 1 ms)", {"SHORTLIST_BATCH_MAX_WAIT_MS": "1"})):
            with serve(root, version=args.version, env={**base_env, **env}, log_dir=log_dir, timeout=300) as s:
                point(label, s.url, "/v1/predict", predict_bodies, conns)

    out = OUT_DIR / "http.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
