"""`make load`: a headless locust step ramp against a deployed Shortlist, then load at 50/70/90% of
the saturation it found; CSV + HTML reports per step and a summary in bench/RESULTS.md.

    python bench/load/run.py --url http://host:8000                # any deployed instance
    python bench/load/run.py [--bundle DIR] [--compare-bare]       # starts the container itself

Without --url the image (IMAGE, default shortlist:cpu; `make image`) is started on the bundle
DIR (default: the one `make demo` builds, built first if missing) with the bundle's root
mounted read-only. --compare-bare also measures `shortlist serve` run directly on this
machine, in the same run, and reports the container's overhead as ratios. The load generator
runs on the same machine as the server unless --url points elsewhere: say so when quoting.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/_common
import _common  # noqa: E402

from shortlist.testing import free_port, serve  # noqa: E402

CONTAINERS: dict[str, str] = {}  # base URL -> container name, while it runs
ROUTES = ("/v1/predict", "/v1/predict [16]", "/v1/predict/tree", "/readyz", "Aggregated")


def locust(url: str, users: int, seconds: float, prefix: Path, rate: float | None = None) -> dict[str, dict]:
    """One headless locust run; per route: req/s, p50/p95/p99 (ms), failure share."""
    if importlib.util.find_spec("locust") is None:
        raise SystemExit(f"locust is not installed in {sys.prefix}: `make load` installs it (the load extra)")
    env = {**os.environ, **({"LOADTEST_RATE": str(rate)} if rate else {})}
    cmd = [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless", "--host", url,
           "--users", str(users), "--spawn-rate", str(users), "--run-time", f"{int(seconds)}s",
           "--csv", str(prefix), "--html", f"{prefix}.html", "--only-summary", "--loglevel", "WARNING"]
    subprocess.run(cmd, env=env, check=False, stdout=subprocess.DEVNULL, timeout=seconds + 120)
    out = {}
    with open(f"{prefix}_stats.csv", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            count = float(row["Request Count"]) or 1.0
            out[row["Name"]] = {"rps": float(row["Requests/s"]), "p50": float(row["50%"]), "p95": float(row["95%"]),
                                "p99": float(row["99%"]), "fail": float(row["Failure Count"]) / count}
    return out


def ramp(url: str, steps: list[int], seconds: float, out: Path, tag: str) -> tuple[list[tuple[int, dict]], float]:
    """Closed-loop users in steps; saturation = the highest aggregate req/s seen."""
    results = []
    for users in steps:
        stats = locust(url, users, seconds, out / f"{tag}-users{users}")
        results.append((users, stats))
        agg = stats["Aggregated"]
        print(f"{tag}: {users:3d} users  {agg['rps']:8.1f} req/s  p50 {agg['p50']:.1f} ms  p99 {agg['p99']:.1f} ms  "
              f"failures {100 * agg['fail']:.2f}%", flush=True)
    return results, max(stats["Aggregated"]["rps"] for _, stats in results)


def paced(url: str, saturation: float, seconds: float, out: Path, tag: str, users: int = 16) -> list[tuple[int, dict]]:
    """Load at 50/70/90% of saturation: `users` users each paced to their share of the rate."""
    results = []
    for share in (50, 70, 90):
        stats = locust(url, users, seconds, out / f"{tag}-at{share}", rate=saturation * share / 100 / users)
        results.append((share, stats))
        agg = stats["Aggregated"]
        print(f"{tag}: {share}% of saturation  {agg['rps']:8.1f} req/s  p50 {agg['p50']:.1f} ms  "
              f"p99 {agg['p99']:.1f} ms  failures {100 * agg['fail']:.2f}%", flush=True)
    return results


@contextmanager
def container(bundle: Path, image: str, **env: str) -> Iterator[str]:
    """The image serving `bundle` (its root mounted read-only), healthy: its base URL (the
    container's name is CONTAINERS[url] while it runs)."""
    name, port = f"shortlist-load-{uuid.uuid4().hex[:8]}", free_port()
    env = {"SHORTLIST_VERSION": bundle.name, **env}
    subprocess.run(["docker", "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000",
                    *(arg for key, value in env.items() for arg in ("-e", f"{key}={value}")),
                    "-v", f"{bundle.parent.resolve()}:/bundles:ro", image], check=True, stdout=subprocess.DEVNULL)
    CONTAINERS[f"http://127.0.0.1:{port}"] = name
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status = subprocess.run(["docker", "inspect", "--format", "{{.State.Health.Status}}", name],
                                    capture_output=True, text=True).stdout.strip()
            if status == "healthy":
                break
            if status == "unhealthy" or not status:
                logs = subprocess.run(["docker", "logs", "--tail", "20", name], capture_output=True, text=True)
                raise RuntimeError(f"container {name} {status or 'exited'} (is the bundle readable by uid 10001?):\n"
                                   f"{logs.stdout}{logs.stderr}")
            time.sleep(1)
        else:
            raise RuntimeError(f"container {name} not healthy after 300 s")
        yield f"http://127.0.0.1:{port}"
    finally:
        subprocess.run(["docker", "rm", "-f", name], check=False, stdout=subprocess.DEVNULL)


def demo_bundle() -> Path:
    root = _common.REPO_ROOT / ".demo" / "bundles"
    if not root.is_dir() or not any(root.iterdir()):
        subprocess.run([sys.executable, "-m", "shortlist.cli", "demo", "--workdir", str(root.parent), "--build-only"],
                       check=True)
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))[-1]


def _table(title: str, rows: list[tuple[str, dict]]) -> list[str]:
    lines = [f"**{title}**", "", "| load | route | req/s | p50 (ms) | p95 (ms) | p99 (ms) | errors |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for load, stats in rows:
        for route in ROUTES:
            if route in stats:
                s = stats[route]
                lines.append(f"| {load} | {route} | {s['rps']:.1f} | {s['p50']:.0f} | {s['p95']:.0f} | "
                             f"{s['p99']:.0f} | {100 * s['fail']:.2f}% |")
    return [*lines, ""]


def measure(url: str, args: argparse.Namespace, tag: str) -> tuple[float, list[str]]:
    steps, saturation = ramp(url, args.steps, args.step_seconds, args.out, tag)
    at = paced(url, saturation, args.step_seconds, args.out, tag)
    lines = _table(f"{tag}: step ramp (closed loop), saturation {saturation:.0f} req/s",
                   [(f"{users} users", stats) for users, stats in steps])
    lines += _table(f"{tag}: paced at a share of saturation (16 users)", [(f"{s}%", stats) for s, stats in at])
    return saturation, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a deployed instance; default: start the container")
    ap.add_argument("--bundle", type=Path, default=None, help="bundle directory (default: the demo's)")
    ap.add_argument("--image", default=os.environ.get("IMAGE", "shortlist:cpu"))
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--step-seconds", type=float, default=20.0)
    ap.add_argument("--compare-bare", action="store_true", help="also `shortlist serve` outside the container")
    ap.add_argument("--out", type=Path, default=_common.OUT_DIR / "load")
    ap.add_argument("--publish", action="store_true", help="write the summary into bench/RESULTS.md")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"Command: `{_common.command_line()}` (commit {_common.git_revision()}); locust on the same "
             f"{os.cpu_count()} cores as the server unless the URL is remote.", ""]
    if args.url:
        lines += measure(args.url, args, "deployed")[1]
    else:
        bundle = (args.bundle or demo_bundle()).resolve()
        if not (bundle / "manifest.json").is_file():
            raise SystemExit(f"{bundle}: not a bundle directory (no manifest.json)")
        lines += [f"Bundle {bundle}.", ""]
        with container(bundle, args.image) as url:
            in_container, text = measure(url, args, "container")
        lines += text
        if args.compare_bare:
            with serve(bundle.parent, version=bundle.name, log_dir=args.out) as server:
                bare, text = measure(server.url, args, "bare")
            lines += [*text, f"Container saturation / bare: {in_container / bare:.2f}.", ""]
    body = "\n".join(["## Load test (locust)", "", *lines])
    print(body)
    if args.publish:
        _common.replace_section(_common.BENCH_DIR / "RESULTS.md", "load", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
