"""/v1/predict latency during a storm of bundle activations against steady state, in one run.

    python bench/swap.py --bundle DIR [--data ../shared/data/debian-deps] [--seconds 10]
                         [--connections 4] [--swap-pause 0.2]

Two versions "a" and "b" of the bundle DIR are made under a scratch root (hard links, or
copies across devices; only the manifest's version differs), a real server is started
with the admin API on, and closed-loop clients call /v1/predict for `seconds` in steady
state, then for `seconds` while an admin client activates a and b alternately (pausing
`swap-pause` seconds between activations). Prints p50/p99 of both phases and their ratio
(the bar: p99 during swaps <= 2 x steady p99), the number of swaps, failed requests, and
the activation time of the bundle (server-side load + validate + swap).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common
import httpx
import numpy as np
from http_bench import query_texts, run_connections

from shortlist.testing import serve

TOKEN = "bench-swap-token"


def make_versions(bundle: Path, root: Path, versions: Sequence[str]) -> None:
    """ROOT/v for each v: the same files as `bundle`, with the manifest renamed to v."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    for v in versions:
        dst = root / v
        dst.mkdir(parents=True)
        for f in bundle.iterdir():
            if f.name == "manifest.json" or not f.is_file():
                continue
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copy2(f, dst / f.name)
        (dst / "manifest.json").write_text(json.dumps({**manifest, "version": v}))


def load_phase(url: str, bodies: Sequence[dict[str, Any]], connections: int, seconds: float,
               during: threading.Event | None = None) -> tuple[list[float], list[str], set[str]]:
    stop = threading.Event()
    lat: list[list[float]] = [[] for _ in range(connections)]
    errors: list[str] = []
    versions: set[str] = set()

    def worker(w: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            i = w
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    r = c.post("/v1/predict", json=bodies[i % len(bodies)])
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))
                    continue
                dt = time.perf_counter() - t0
                i += connections
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
                    continue
                versions.add(r.json()["version"])
                lat[w].append(dt)

    run_connections(worker, connections, seconds, stop)
    return [x for per in lat for x in per], errors, versions


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True, type=Path, help="a bundle directory")
    ap.add_argument("--data", default=None, help="dataset folder: queries from its tst titles")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--swap-pause", type=float, default=0.2, help="seconds between activations")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--server-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra SHORTLIST_* settings for the server, e.g. SHORTLIST_LOADER_NICE=0 (A/B runs)")
    ap.add_argument("--results", type=Path, default=_common.BENCH_DIR / "RESULTS.md",
                    help="markdown file whose 'swap' section gets this run (one line per swap pause)")
    args = ap.parse_args(argv)
    bundle = args.bundle.resolve()
    if not (bundle / "manifest.json").is_file():
        ap.error(f"--bundle {bundle} is not a bundle directory (no manifest.json)")

    server_env = {}
    for item in args.server_env:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("SHORTLIST_"):
            ap.error(f"--server-env {item!r}: expected SHORTLIST_<NAME>=value")
        server_env[key] = value

    texts = query_texts(bundle, args.data, 4000)
    bodies = [{"text": t, "k": args.k} for t in texts]
    log_dir = _common.OUT_DIR / "swap-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="swap-", dir=_common.OUT_DIR))
    try:
        root = scratch / "bundles"
        make_versions(bundle, root, ("a", "b"))
        env = {**server_env, "SHORTLIST_ADMIN_TOKEN": TOKEN}
        with serve(root, version="a", env=env, log_dir=log_dir, timeout=600) as s:
            load_phase(s.url, bodies, args.connections, 2.0)  # warm-up
            steady, steady_err, _ = load_phase(s.url, bodies, args.connections, args.seconds)

            activations: list[dict[str, Any]] = []
            storm_done = threading.Event()

            def storm() -> None:
                with httpx.Client(base_url=s.url, timeout=600,
                                  headers={"authorization": f"Bearer {TOKEN}"}) as admin:
                    i = 0
                    while not storm_done.is_set():
                        v = ("b", "a")[i % 2]
                        t0 = time.perf_counter()
                        r = admin.post("/admin/bundles/activate", json={"version": v})
                        wall = time.perf_counter() - t0
                        activations.append({"version": v, "status": r.status_code, "wall_s": wall,
                                            "server_s": r.json().get("seconds")})
                        i += 1
                        time.sleep(args.swap_pause)

            swapper = threading.Thread(target=storm, daemon=True)
            swapper.start()
            swapping, swap_err, seen = load_phase(s.url, bodies, args.connections, args.seconds)
            storm_done.set()
            swapper.join()

        steady_s = _common.latency_summary(steady)
        swap_s = _common.latency_summary(swapping)
        ok = [a for a in activations if a["status"] == 200]
        server_times = np.array([a["server_s"] for a in ok])
        result = {
            "command": _common.command_line(), "revision": _common.git_revision(), "bundle": str(bundle),
            "connections": args.connections, "seconds": args.seconds, "swap_pause_s": args.swap_pause,
            "server_env": server_env,
            "steady": {**steady_s, "requests": len(steady), "failed": len(steady_err)},
            "during_swaps": {**swap_s, "requests": len(swapping), "failed": len(swap_err),
                             "versions_seen": sorted(seen)},
            "p99_ratio": swap_s["p99_ms"] / steady_s["p99_ms"],
            "swaps": len(ok), "failed_activations": len(activations) - len(ok),
            "activation_s": {"p50": float(np.median(server_times)) if len(ok) else None,
                             "max": float(server_times.max()) if len(ok) else None},
        }
        print(f"bundle {bundle} ({args.connections} connections, {args.seconds:.0f} s per phase)")
        print(f"steady        : {len(steady):6d} req  p50 {steady_s['p50_ms']:6.2f} ms  "
              f"p99 {steady_s['p99_ms']:6.2f} ms  failed {len(steady_err)}")
        print(f"during swaps  : {len(swapping):6d} req  p50 {swap_s['p50_ms']:6.2f} ms  "
              f"p99 {swap_s['p99_ms']:6.2f} ms  failed {len(swap_err)}  versions seen {sorted(seen)}")
        print(f"p99 ratio swaps/steady: {result['p99_ratio']:.2f} (bar <= 2.0); swaps {len(ok)}, "
              f"refused {len(activations) - len(ok)}")
        if len(ok):
            print(f"activation time (load + validate + swap, server side): p50 {np.median(server_times):.3f} s, "
                  f"max {server_times.max():.3f} s")
        out = _common.OUT_DIR / "swap.json"
        out.write_text(json.dumps(result, indent=2))
        _record(args.results, result)
        print(f"wrote {out} and the 'swap' section of {args.results}")
        return 0 if not steady_err and not swap_err and len(ok) == len(activations) else 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _record(results_md: Path, result: dict[str, Any]) -> None:
    """One table row per swap pause, keeping rows of other pauses from earlier runs."""
    start, end = "<!-- swap -->", "<!-- /swap -->"
    text = results_md.read_text(encoding="utf-8") if results_md.exists() else ""
    rows: dict[str, str] = {}
    if start in text and end in text:
        for line in text.split(start, 1)[1].split(end, 1)[0].splitlines():
            if line.startswith("| ") and not line.startswith("| swap pause") and "---" not in line:
                rows[line.split("|")[1].strip()] = line
    st, sw, act = result["steady"], result["during_swaps"], result["activation_s"]
    key = f"{result['swap_pause_s']:g} s"
    rows[key] = (f"| {key} | {result['swaps']} | {st['p50_ms']:.2f} / {st['p99_ms']:.2f} | "
                 f"{sw['p50_ms']:.2f} / {sw['p99_ms']:.2f} | {result['p99_ratio']:.2f} | "
                 f"{st['failed'] + sw['failed']} | {act['p50']:.3f} / {act['max']:.3f} | "
                 f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} {result['revision']} |")
    body = "\n".join([
        "## Hot swap: /v1/predict latency during activation storms", "",
        f"Command: `{result['command']}` (rows: one per `--swap-pause`); bundle `{result['bundle']}`, "
        f"{result['connections']} closed-loop connections, {result['seconds']:g} s per phase, 2 CPU cores shared "
        "with other jobs. Bar: p99 during swaps <= 2 x steady p99.", "",
        "| swap pause | swaps | steady p50 / p99 (ms) | during swaps p50 / p99 (ms) | p99 ratio | failed requests "
        "| activation p50 / max (s) | run |",
        "|---|---|---|---|---|---|---|---|",
        *sorted(rows.values(), key=lambda r: float(r.split("|")[1].split()[0])),
    ])
    _common.replace_section(results_md, "swap", body)


if __name__ == "__main__":
    sys.exit(main())
