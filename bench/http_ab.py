"""Before/after in one run: `shortlist serve` from two source trees (git revisions, or this
working tree), the same bundle, measured alternately with wrk.

    python bench/http_ab.py --bundle-root ROOT --data ../shared/data/debian-deps [--base main]
                            [--head WORKTREE] [--connections 1 16] [--rounds 4] [--seconds 2]

Each tree serves from its own server process (echo route on, access log off, service defaults
otherwise); a revision is unpacked with `git archive` into a temporary directory and imported
from there (PYTHONPATH), with this environment's packages. Per round, every (tree, route,
connections) point runs once, the order reversed every other round, so drift on a shared
machine falls on both trees alike. Besides wrk's req/s and latency percentiles, each point
reports the server's CPU time per request (user + system, /proc/PID/stat, divided by the
requests wrk counted): what a request costs the server, much less sensitive to other jobs on
the machine than req/s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from _common import BENCH_DIR, REPO_ROOT, add_bundle_arguments, command_line, git_revision, replace_section
from http_bench import query_texts, wrk_point, wrk_script

from shortlist.testing import Server, free_port

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
ROUTES = {"echo": "/v1/echo", "predict": "/v1/predict"}


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU time of a process so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) * _TICK_S, int(fields[12]) * _TICK_S


def context_switches(pid: int) -> int:
    """Context switches of every thread of a process so far (voluntary and not)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        with contextlib.suppress(OSError):
            total += sum(int(line.split()[1]) for line in status.read_text().splitlines()
                         if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))
    return total


@contextlib.contextmanager
def source_tree(rev: str) -> Iterator[Path]:
    """A directory holding revision `rev` of this repository ("." : the working tree itself; a
    directory: that source tree)."""
    if rev == "." or Path(rev).is_dir():
        yield REPO_ROOT if rev == "." else Path(rev).resolve()
        return
    with tempfile.TemporaryDirectory(prefix="http-ab-") as tmp:
        archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=REPO_ROOT, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield Path(tmp)


@contextlib.contextmanager
def serve_tree(tree: Path, bundle_root: Path, version: str | None, env: dict[str, str],
               log_dir: Path) -> Iterator[Server]:
    """`shortlist serve` importing the service from `tree`, ready to answer."""
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SHORTLIST_")}
    full_env.update(env, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "shortlist.cli", "serve", "--bundle-root", str(bundle_root),
           "--host", "127.0.0.1", "--port", str(port), *(["--version", version] if version else [])]
    log_path = log_dir / f"server-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=tree)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        server.wait_ready(300)
        yield server
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def engine_calls(url: str) -> tuple[float, float]:
    """(engine calls, texts) of the alpha scorer so far, from /metrics."""
    found = dict.fromkeys(("count", "sum"), 0.0)
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        for what in found:
            if line.startswith(f'shortlist_engine_batch_size_{what}{{scorer="alpha"}}'):
                found[what] = float(line.split()[-1])
    return found["count"], found["sum"]


def measure(server: Server, script: Path, route: str, conns: int, seconds: int) -> dict[str, Any]:
    pid = server.proc.pid
    calls = engine_calls(server.url)
    (user, system), switches = cpu_seconds(pid), context_switches(pid)
    r = wrk_point(server.url + ROUTES[route], script, conns, seconds)
    (user_after, system_after), switches_after = cpu_seconds(pid), context_switches(pid)
    calls_after = engine_calls(server.url)
    if calls_after[0] > calls[0]:
        r["texts_per_call"] = (calls_after[1] - calls[1]) / (calls_after[0] - calls[0])
    if r["non_2xx"] or r["socket_errors"] or not r["requests"]:
        raise RuntimeError(f"{route} at {conns} connections on {server.url}: failed requests: {r}")
    r["cpu_us_per_request"] = (user_after - user + system_after - system) / r["requests"] * 1e6
    r["sys_us_per_request"] = (system_after - system) / r["requests"] * 1e6
    r["switches_per_request"] = (switches_after - switches) / r["requests"]
    return r


def run(args: argparse.Namespace) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    texts = query_texts(args.bundle_dir, args.data, args.queries)
    env = {"SHORTLIST_ECHO_ROUTE": "true", "SHORTLIST_ACCESS_LOG": "false"}
    samples: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="http-ab-run-") as tmp, contextlib.ExitStack() as stack:
        log_dir = Path(tmp)
        scripts = {}
        for route, body in (("echo", lambda t: {"text": t}), ("predict", lambda t: {"text": t, "k": args.k})):
            scripts[route] = log_dir / f"{route}.lua"
            scripts[route].write_text(wrk_script([body(t) for t in texts]), encoding="utf-8")
        servers = {}
        for name, rev, extra in (("base", args.base, args.base_env), ("head", args.head, args.head_env)):
            tree = stack.enter_context(source_tree(rev))
            servers[name] = stack.enter_context(serve_tree(tree, args.root, args.version, {**env, **extra}, log_dir))
        for server in servers.values():  # warm-up, untimed
            for route in args.routes:
                wrk_point(server.url + ROUTES[route], scripts[route], max(args.connections), 1)
        plan = [(name, route, conns) for conns in args.connections for route in args.routes for name in servers]
        for rnd in range(args.rounds):
            for name, route, conns in plan if rnd % 2 == 0 else plan[::-1]:
                r = measure(servers[name], scripts[route], route, conns, args.seconds)
                samples.setdefault((name, route, conns), []).append(r)
            print(f"round {rnd + 1}/{args.rounds} done ({os.getloadavg()[0]:.1f} load)", flush=True)
    return samples


def report(args: argparse.Namespace, samples: dict[tuple[str, str, int], list[dict[str, Any]]]) -> str:
    med = statistics.median
    envs = "".join(f" ({name} with {env})" for name, env in (("base", args.base_env), ("head", args.head_env)) if env)
    lines = [f"Command: `{command_line()}` (at {git_revision()}); base {args.base}, head "
             f"{'the working tree' if args.head == '.' else args.head}{envs}; bundle {args.bundle_dir.name}; "
             f"wrk -t1 on the same 2 cores; {args.rounds} alternated rounds of {args.seconds} s, medians; load average "
             f"{args.load_before:.1f} before, {os.getloadavg()[0]:.1f} after.", "",
             "| route | conns | tree | req/s | p50 (ms) | p99 (ms) | server CPU / req (us) | of which sys | "
             "switches / req | texts / engine call | req/s rounds |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (name, route, conns), rs in samples.items():
        rounds = ", ".join(f"{r['req_s']:.0f}" for r in rs)
        batch = f"{med(r['texts_per_call'] for r in rs):.1f}" if all("texts_per_call" in r for r in rs) else ""
        lines.append(f"| {route} | {conns} | {name} | {med(r['req_s'] for r in rs):.0f} | "
                     f"{med(r['p50_ms'] for r in rs):.3f} | {med(r['p99_ms'] for r in rs):.2f} | "
                     f"{med(r['cpu_us_per_request'] for r in rs):.0f} | "
                     f"{med(r['sys_us_per_request'] for r in rs):.0f} | "
                     f"{med(r['switches_per_request'] for r in rs):.2f} | {batch} | {rounds} |")
    lines.append("")
    for conns in args.connections:
        if "echo" in args.routes and "predict" in args.routes:
            for name in ("base", "head"):
                ratios = [p["req_s"] / e["req_s"] for p, e in zip(samples[(name, "predict", conns)],
                                                                  samples[(name, "echo", conns)], strict=True)]
                lines.append(f"- {name}, {conns} connections: predict/echo req/s median {med(ratios):.2f} "
                             f"(rounds {', '.join(f'{x:.2f}' for x in ratios)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bundle_arguments(ap)
    ap.add_argument("--base", default="main",
                    help="git revision measured as 'before' ('.': the working tree; or a source directory)")
    ap.add_argument("--head", default=".",
                    help="git revision or directory measured as 'after' (default: the working tree)")
    ap.add_argument("--base-env", nargs="*", default=[], metavar="NAME=VALUE",
                    help="settings of the 'before' server only (e.g. SHORTLIST_WORKERS=1)")
    ap.add_argument("--head-env", nargs="*", default=[], metavar="NAME=VALUE",
                    help="settings of the 'after' server only")
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--routes", nargs="+", choices=sorted(ROUTES), default=["echo", "predict"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=int, default=2)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--queries", type=int, default=4000)
    ap.add_argument("--publish", metavar="SECTION", default=None,
                    help="also write the table into this <!-- SECTION --> of bench/RESULTS.md (made where missing)")
    ap.add_argument("--title", default="Before/after", help="the published section's heading")
    args = ap.parse_args(argv)
    args.base_env, args.head_env = (dict(kv.split("=", 1) for kv in env) for env in (args.base_env, args.head_env))
    args.root = args.bundle_root.resolve()
    args.bundle_dir = args.root / args.version if args.version else max(
        p for p in args.root.iterdir() if (p / "manifest.json").exists())
    args.load_before = os.getloadavg()[0]
    text = report(args, run(args))
    print(text)
    if args.publish:
        replace_section(BENCH_DIR / "RESULTS.md", args.publish, f"### {args.title}\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
