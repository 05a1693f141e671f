"""HTTP throughput and latency of `shortlist serve` against the framework's floor, in one run.

    python bench/http_bench.py --bundle-root ROOT [--version V] [--data ../shared/data/debian-deps]
                         [--client wrk|httpx] [--seconds 5] [--connections 1 16]

Starts real servers (uvicorn subprocesses, echo route on): the default configuration, one
with dynamic batching off and one with a 1 ms max wait. A client measures req/s and p50/p99
at each connection count for POST /v1/predict on each server and for POST /v1/echo (same
app, same JSON parsing and middleware, no model work): predict/echo is the share of the
framework's floor that the service keeps. Also texts/s with 64 texts per request.

Clients: `wrk` (a C load generator, the default when the binary is on PATH; Debian: `apt-get
install wrk`) runs one thread (`-t1`: the server has 2 cores to itself as far as possible)
with a generated Lua script that POSTs the real query texts in rotation. `httpx` (closed-loop
Python threads, one keep-alive connection each) saturates before the server does, so its
ratios come out near 1; it also runs a paired measurement on one connection alternating echo
and predict requests. Any non-2xx response (or wrk socket error) marks its point as failed:
printed, flagged in the JSON and the table, left out of the ratios, and the exit code is 1.
The machine is shared, so every point is measured in several short interleaved rounds and
medians are reported. Figures go to stdout, bench/out/http.json and bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _common import (
    BENCH_DIR,
    OUT_DIR,
    add_bundle_arguments,
    command_line,
    git_revision,
    latency_summary,
    read_jsonl,
    replace_section,
    time_calls,
)

from shortlist.testing import free_port, serve


def query_texts(bundle_dir: Path, data: str | None, n: int, seed: int = 0) -> list[str]:
    if data:
        split = next(p for p in (Path(data) / f"tst{ext}" for ext in (".json.gz", ".jsonl", ".json")) if p.exists())
        texts = [r["title"] for r in read_jsonl(split, limit=20000) if str(r.get("title", "")).strip()]
    else:
        texts = [r["title"] for r in read_jsonl(bundle_dir / "labels.jsonl", limit=20000) if r["title"].strip()]
    rng = np.random.default_rng(seed)
    return [texts[int(i)][:2000] for i in rng.integers(0, len(texts), size=n)]



def run_connections(worker: Callable[[int], None], connections: int, seconds: float, stop: threading.Event,
                    measuring: threading.Event | None = None, warmup_s: float = 0.0) -> float:
    """worker(w) on one thread per connection: `warmup_s` unmeasured, then `seconds` with
    `measuring` set; then `stop` is set and the threads joined. Returns the measured seconds."""
    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(connections)]
    for t in threads:
        t.start()
    time.sleep(warmup_s)
    if measuring is not None:
        measuring.set()
    t0 = time.perf_counter()
    time.sleep(seconds)
    if measuring is not None:
        measuring.clear()
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join()
    return elapsed


def closed_loop(url: str, path: str, bodies: Sequence[dict[str, Any]], connections: int, seconds: float,
                warmup_s: float = 1.0) -> dict[str, Any]:
    """`connections` httpx threads, each sending requests back to back on its own keep-alive connection."""
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
                if r.status_code // 100 != 2:
                    if measuring.is_set():
                        errors.append(f"{r.status_code} {r.text[:200]}")
                    continue
                if measuring.is_set():
                    lat[w].append(dt)

    elapsed = run_connections(worker, connections, seconds, stop, measuring, warmup_s)
    samples = [x for per in lat for x in per]
    out: dict[str, Any] = {"requests": len(samples), "req_s": len(samples) / elapsed, "non_2xx": len(errors),
                           "socket_errors": 0}
    if errors:
        out["first_error"] = errors[0]
    out.update(latency_summary(samples) if samples else {"p50_ms": float("nan"), "p99_ms": float("nan"),
                                                         "mean_ms": float("nan")})
    return out


def lua_long_string(text: str) -> str:
    """`text` as a Lua long-bracket literal ([==[...]==]): no escapes are interpreted inside, so
    quotes, backslashes and UTF-8 pass through byte for byte; the level is chosen so that the
    closing bracket first occurs where it should."""
    level = 0
    while True:
        close = "]" + "=" * level + "]"
        if (text + close).find(close) == len(text):
            return f"[{'=' * level}[{text}{close}"
        level += 1


def wrk_script(bodies: Sequence[dict[str, Any]]) -> str:
    """A wrk Lua script that POSTs `bodies` as JSON in rotation (one wrk thread: one rotation)."""
    literals = ",\n".join(lua_long_string(json.dumps(b, ensure_ascii=False)) for b in bodies)
    return (
        "-- generated by bench/http_bench.py\n"
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"local bodies = {{\n{literals}\n}}\n"
        "local requests = {}\n"
        "local i = 0\n"
        # Formatting every request up front keeps the client's CPU (shared with the server) low.
        "init = function(args)\n"
        "  for k, body in ipairs(bodies) do requests[k] = wrk.format(nil, nil, nil, body) end\n"
        "end\n"
        "request = function()\n"
        "  i = i + 1\n"
        "  return requests[(i % #requests) + 1]\n"
        "end\n"
    )


_WRK_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}
_WRK_TIME = r"([\d.]+)(us|ms|s|m|h)"


def parse_wrk(output: str) -> dict[str, Any]:
    """Requests/sec, mean/p50/p99 latency (ms), request count, non-2xx responses and socket
    errors from the text `wrk --latency` prints."""
    def find(pattern: str) -> re.Match[str] | None:
        return re.search(pattern, output, re.MULTILINE)

    def ms(pattern: str) -> float:
        m = find(pattern + _WRK_TIME)
        if m is None:
            raise ValueError(f"unexpected wrk output (no {pattern!r} line):\n{output}")
        return float(m.group(1)) * _WRK_MS[m.group(2)]

    req_s, total = find(r"^Requests/sec:\s+([\d.]+)"), find(r"^\s*(\d+) requests in ")
    if not (req_s and total):
        raise ValueError(f"unexpected wrk output (no request count or Requests/sec):\n{output}")
    non_2xx = find(r"Non-2xx or 3xx responses:\s+(\d+)")
    sock = find(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")
    requests = int(total.group(1))
    nan = float("nan")
    return {
        "requests": requests,
        "req_s": float(req_s.group(1)),
        # With no response at all wrk prints no usable latencies (the point is failed anyway).
        "mean_ms": ms(r"^\s*Latency\s+") if requests else nan,
        "p50_ms": ms(r"^\s*50%\s+") if requests else nan,
        "p99_ms": ms(r"^\s*99%\s+") if requests else nan,
        "non_2xx": int(non_2xx.group(1)) if non_2xx else 0,
        "socket_errors": sum(int(x) for x in sock.groups()) if sock else 0,
        **({"socket_error_detail": sock.group(0)} if sock else {}),
    }


def wrk_command(url: str, script: Path, connections: int | str, seconds: int) -> list[str]:
    # --timeout: 64-text requests under load take tens of ms; wrk's default 2 s is fine, but a
    # stall past it would show as a socket error (a failed point), which is what we want.
    return ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "--timeout", "10s", "-s", str(script), url]


def wrk_point(url: str, script: Path, connections: int, seconds: int) -> dict[str, Any]:
    cmd = wrk_command(url, script, connections, seconds)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    return parse_wrk(proc.stdout)


def wrk_version() -> str:
    proc = subprocess.run(["wrk", "--version"], capture_output=True, text=True)
    return (proc.stdout or proc.stderr).splitlines()[0].split(" Copyright")[0].strip()


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
                    if r.status_code // 100 != 2:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                    elif measuring.is_set():
                        mine[name].append(dt)
                i += connections
        with lock:
            for name, xs in mine.items():
                lat[name].extend(xs)

    run_connections(worker, connections, seconds, stop, measuring, warmup_s)
    if errors:
        return {"failed": True, "non_2xx": len(errors), "first_error": errors[0]}
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


def sample_failure(r: dict[str, Any]) -> str:
    """'' when a measurement got only 2xx responses and no socket errors, else what went wrong."""
    what = [f"{r['non_2xx']} non-2xx"] if r["non_2xx"] else []
    what += [r.get("socket_error_detail", f"{r['socket_errors']} socket errors")] if r["socket_errors"] else []
    what += ["no responses"] if not r["requests"] else []
    what += [f"first: {r['first_error']}"] if what and r.get("first_error") else []
    return ", ".join(what)


def failure_note(rs: Sequence[dict[str, Any]]) -> str:
    """'' when every round of a point succeeded, else what failed in which round."""
    return "; ".join(f"round {rnd}: {note}" for rnd, r in enumerate(rs, 1) if (note := sample_failure(r)))




def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bundle_arguments(ap)
    ap.add_argument("--client", choices=["wrk", "httpx"], default=None,
                    help="load generator (default: wrk when the wrk binary is on PATH, else httpx)")
    ap.add_argument("--seconds", type=float, default=2.0,
                    help="measured seconds per point and round (wrk: rounded to whole seconds, at least 1)")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds (the machine is shared: "
                    "alternating short points keeps drift out of the ratios)")
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64, help="texts per request in the batch measurement")
    ap.add_argument("--queries", type=int, default=4000, help="distinct request bodies each client rotates over")
    ap.add_argument("--access-log", action="store_true",
                    help="keep the service's JSON access log on (off by default: both routes pay it alike)")
    ap.add_argument("--skip-batching-modes", action="store_true")
    ap.add_argument("--processes", type=int, default=1,
                    help="also measure predict on a server with this many processes (SHORTLIST_PROCESSES), "
                         "and each process's memory")
    ap.add_argument("--peer-run", type=Path, default=None,
                    help="a bench/peers.py run directory with napkinXC trained: measure the peer service "
                         "(bench/peer_service.py) beside Shortlist; needs --data")
    ap.add_argument("--results", type=Path, default=BENCH_DIR / "RESULTS.md",
                    help="markdown file whose 'http' section is replaced with these figures")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0 or args.queries < args.batch or min(args.connections) < 1:
        ap.error("--rounds and --connections must be >= 1, --seconds > 0 and --queries >= --batch")
    if args.processes < 1:
        ap.error("--processes must be >= 1")
    if args.peer_run is not None and (args.data is None or not (args.peer_run / "models" / "napkinxc").is_dir()):
        ap.error(f"--peer-run {args.peer_run}: needs --data and napkinXC trained there "
                 "(python bench/peers.py --systems napkinxc --out DIR)")
    if args.client is None:
        args.client = "wrk" if shutil.which("wrk") else "httpx"
        if args.client == "httpx":
            print("note: `wrk` is not on PATH, measuring with the httpx client threads instead (they saturate "
                  "before the server does, so ratios come out near 1); Debian: apt-get install wrk", flush=True)
    elif args.client == "wrk" and not shutil.which("wrk"):
        ap.error("--client wrk: the `wrk` binary is not on PATH (Debian/Ubuntu: apt-get install wrk; "
                 "or use --client httpx)")
    args.wrk_seconds = max(1, round(args.seconds))
    if args.client == "wrk" and args.wrk_seconds != args.seconds:
        print(f"note: wrk takes whole seconds: measuring {args.wrk_seconds} s per point", flush=True)
    args.point_seconds = float(args.wrk_seconds) if args.client == "wrk" else args.seconds
    root = args.bundle_root.resolve()
    versions = sorted(p.name for p in root.iterdir() if (p / "manifest.json").exists()) if root.is_dir() else []
    if not versions or (args.version and args.version not in versions):
        ap.error(f"--bundle-root {root}: no bundle {args.version or ''} there (found: {', '.join(versions) or 'none'})")
    args.root, args.bundle_dir = root, root / (args.version or versions[-1])
    return args


PATHS = {"echo": "/v1/echo", "predict": "/v1/predict", "batch": "/v1/predict"}


def request_bodies(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    texts = query_texts(args.bundle_dir, args.data, args.queries)
    return {
        "echo": [{"text": t} for t in texts],
        "predict": [{"text": t, "k": args.k} for t in texts],
        "batch": [{"texts": texts[i:i + args.batch], "k": args.k}
                  for i in range(0, len(texts) - args.batch + 1, args.batch)],
    }


def server_modes(args: argparse.Namespace,
                 state_dir: Path | None = None) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The environment every server shares and, per batching mode, its own; several processes keep
    their state in `state_dir`, which must be this run's own: a version an earlier run recorded as
    active there (under another bundle root) would be what their arbiter preloads, and failing that
    each process would load its own copy of the bundle."""
    base_env = {"SHORTLIST_ECHO_ROUTE": "true", "SHORTLIST_MAX_BATCH": str(max(128, args.batch)),
                "SHORTLIST_ACCESS_LOG": "true" if args.access_log else "false"}
    modes: dict[str, dict[str, str]] = {"batching (default)": {}}
    if not args.skip_batching_modes:
        modes["no batching"] = {"SHORTLIST_BATCHING": "false"}
        modes["batching, 1 ms wait"] = {"SHORTLIST_BATCH_MAX_WAIT_MS": "1"}
    if args.processes > 1:
        modes[f"{args.processes} processes"] = {"SHORTLIST_PROCESSES": str(args.processes),
                                                "SHORTLIST_STATE_DIR": str(state_dir or "<the run's own>")}
    return base_env, modes


PEER = "peer: napkinXC PLT + FastAPI"


@contextlib.contextmanager
def serve_peer(args: argparse.Namespace, log_dir: Path) -> Any:
    """bench/peer_service.py under uvicorn (uvloop, httptools) on a free loopback port: its URL."""
    port = free_port()
    env = {**os.environ, "PEER_RUN": str(args.peer_run), "PEER_DATA": str(args.data)}
    cmd = [sys.executable, "-m", "uvicorn", "peer_service:create_app", "--factory", "--app-dir", str(BENCH_DIR),
           "--host", "127.0.0.1", "--port", str(port), "--loop", "uvloop", "--http", "httptools",
           "--no-access-log", "--log-level", "warning"]
    with (log_dir / "peer.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the peer service did not start; see {log_dir / 'peer.log'}")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def process_memory_mib(pid: int) -> dict[str, float]:
    """PSS and USS (private clean + dirty) of a process, MiB (Linux smaps_rollup)."""
    text = Path(f"/proc/{pid}/smaps_rollup").read_text()

    def kib(key: str) -> float:
        m = re.search(rf"^{key}:\s+(\d+)", text, re.M)
        return float(m.group(1)) if m else 0.0

    return {"pss": kib("Pss") / 1024, "uss": (kib("Private_Clean") + kib("Private_Dirty")) / 1024,
            "rss": kib("Rss") / 1024}


def server_memory(name: str, server: Any, env: dict[str, str]) -> list[dict[str, float]]:
    """Each serving process's memory: the server itself, or the processes it supervises."""
    state = env.get("SHORTLIST_STATE_DIR")
    pids = sorted(int(p.stem) for p in (Path(state) / "processes").glob("*.json")) if state else [server.proc.pid]
    return [{"pid": pid, **process_memory_mib(pid)} for pid in pids]


def _measure(args: argparse.Namespace, scripts: dict[str, Path], bodies: dict[str, list[dict[str, Any]]],
             url: str, route: str, conns: int) -> dict[str, Any]:
    if args.client == "wrk":
        r = wrk_point(url + PATHS[route], scripts[route], conns, args.wrk_seconds)
        if r["non_2xx"]:
            # wrk counts bad statuses without keeping one: replay a body to show the answer.
            reply = httpx.post(url + PATHS[route], json=bodies[route][0], timeout=30)
            r["first_error"] = f"(replayed) {reply.status_code} {reply.text[:200]}"
        return r
    return closed_loop(url, PATHS[route], bodies[route], conns, args.point_seconds, warmup_s=0.3)


def run_points(args: argparse.Namespace, bodies: dict[str, list[dict[str, Any]]], client_desc: str,
               results: dict[str, Any]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Every point of the plan in interleaved rounds, against real servers (one per batching mode)."""
    log_dir = OUT_DIR / "http-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        state_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="http-bench-state-")))
        base_env, modes = server_modes(args, state_dir)
        script_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="http-bench-wrk-")))
        scripts = {route: script_dir / f"{route}.lua" for route in bodies}
        for route, path in scripts.items():
            path.write_text(wrk_script(bodies[route]), encoding="utf-8")
        servers = {name: stack.enter_context(serve(args.root, version=args.version, env={**base_env, **env},
                                                   log_dir=log_dir, timeout=300)) for name, env in modes.items()}
        urls = {name: server.url for name, server in servers.items()}
        peer = stack.enter_context(serve_peer(args, log_dir)) if args.peer_run else None
        print(f"serving {args.bundle_dir}; modes: {', '.join(modes)}; client: {client_desc}", flush=True)
        main_url = urls["batching (default)"]
        if args.client == "wrk":  # wrk has no warm-up phase: one untimed second per server and route first
            for name, url in urls.items():
                for route in ("echo", "predict") if name == "batching (default)" else ("predict",):
                    wrk_point(url + PATHS[route], scripts[route], max(args.connections), 1)
        plan: list[tuple[str, str, str, int, int]] = []
        for conns in args.connections:
            plan.append(("echo (framework floor)", main_url, "echo", conns, 1))
            plan += [(f"predict, {name}", url, "predict", conns, 1) for name, url in urls.items()]
            plan += [(PEER, peer[0], "predict", conns, 1)] if peer else []
        plan += [(f"predict, {args.batch} texts/request", main_url, "batch", conns, args.batch) for conns in (1, 2)]
        samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for rnd in range(args.rounds):
            for name, url, route, conns, per_request in plan if rnd % 2 == 0 else plan[::-1]:
                r = _measure(args, scripts, bodies, url, route, conns)
                r["texts_per_request"] = per_request
                samples.setdefault((name, conns), []).append(r)
                if note := sample_failure(r):
                    print(f"FAILED: {name} at {conns} connections, round {rnd + 1}: {note}", flush=True)
            print(f"round {rnd + 1}/{args.rounds} done", flush=True)
        results["batch_sizes_default"] = scrape_batch_sizes(main_url)
        results["memory"] = {name: server_memory(name, server, {**base_env, **modes[name]})
                             for name, server in servers.items()}
        if peer:
            results["memory"][PEER] = [{"pid": peer[1], **process_memory_mib(peer[1])}]
        # One connection only: with many, predict waits for engine workers that echo never queues
        # for, so mean latencies stop estimating a throughput ratio. wrk's Lua API has no
        # per-request clock, so this one exists only with the httpx client.
        results["paired"] = ({1: paired_loop(main_url, bodies["echo"], bodies["predict"], 1,
                                             args.point_seconds * args.rounds)} if args.client == "httpx" else {})
    return samples


def point_table(samples: dict[tuple[str, int], list[dict[str, Any]]], results: dict[str, Any]
                ) -> tuple[list[str], dict[tuple[str, int], str]]:
    """The markdown table of medians (printed too) and the failed points."""
    table = ["| point | connections | req/s | texts/s | p50 (ms) | p99 (ms) | req/s per round |",
             "|---|---|---|---|---|---|---|"]
    print(f"\n{'point':<40} {'conns':>5} {'req/s':>9} {'texts/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    failed: dict[tuple[str, int], str] = {}
    for (name, conns), rs in samples.items():
        note = failure_note(rs)
        rounds_s = ", ".join(f"{r['req_s']:.0f}" for r in rs)
        if note:
            failed[(name, conns)] = note
            results["failed_points"][f"{name} @{conns}"] = {"rounds": rs, "failure": note}
            print(f"{name:<40} {conns:>5} FAILED: {note}")
            table.append(f"| {name} | {conns} | FAILED: {note.replace('|', '/')} | | | | {rounds_s} |")
            continue
        req_s = float(np.median([r["req_s"] for r in rs]))
        point = {"name": name, "connections": conns, "req_s_median": req_s,
                 "req_s_rounds": [round(r["req_s"], 1) for r in rs], "requests_rounds": [r["requests"] for r in rs],
                 "texts_s_median": req_s * rs[0]["texts_per_request"],
                 "p50_ms_median": float(np.median([r["p50_ms"] for r in rs])),
                 "p99_ms_median": float(np.median([r["p99_ms"] for r in rs]))}
        results["points"][f"{name} @{conns}"] = point
        print(f"{name:<40} {conns:>5} {req_s:9.1f} {point['texts_s_median']:9.1f} "
              f"{point['p50_ms_median']:8.2f} {point['p99_ms_median']:8.2f}")
        table.append(f"| {name} | {conns} | {req_s:.0f} | {point['texts_s_median']:.0f} | "
                     f"{point['p50_ms_median']:.2f} | {point['p99_ms_median']:.2f} | {rounds_s} |")
    print()
    return table, failed


def ratio_lines(args: argparse.Namespace, samples: dict[tuple[str, int], list[dict[str, Any]]],
                failed: dict[tuple[str, int], str], results: dict[str, Any]) -> list[str]:
    """Predict / echo req/s per mode and connection count (median of the rounds' ratios)."""
    lines = []
    echo_name = "echo (framework floor)"
    for conns in args.connections:
        for name in server_modes(args)[1]:
            pred_name = f"predict, {name}"
            if (echo_name, conns) in failed or (pred_name, conns) in failed:
                lines.append(f"ratio predict ({name}) / echo at {conns} connections: not computed (a point failed)")
                continue
            pairs = zip(samples[(pred_name, conns)], samples[(echo_name, conns)], strict=True)
            ratios = [p["req_s"] / e["req_s"] for p, e in pairs]
            ratio = float(np.median(ratios))
            results[f"ratio predict ({name}) / echo @{conns}"] = ratio
            lines.append(f"ratio predict ({name}) / echo at {conns} connections: median {ratio:.2f} "
                         f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    for line in lines:
        print(line)
    return [f"- {line}" for line in lines]


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def bar_lines(args: argparse.Namespace, results: dict[str, Any]) -> list[str]:
    """Issue 22's bars, from this run's medians (a bar whose points failed or were not measured is skipped)."""
    points, lines = results["points"], []

    def get(name: str, conns: int, key: str) -> float | None:
        return points.get(f"{name} @{conns}", {}).get(key)

    main, echo = "predict, batching (default)", "echo (framework floor)"
    pred1, echo1, peer1 = (get(n, 1, "p50_ms_median") for n in (main, echo, PEER))
    engine = results["engine_p50_ms"]
    if pred1 is not None and echo1 is not None:
        limit = echo1 + engine + 0.15
        ok = pred1 <= limit and (peer1 is None or pred1 <= peer1)
        lines.append(f"bar, 1 connection: predict p50 {pred1:.3f} ms <= echo p50 {echo1:.3f} + in-process engine p50 "
                     f"{engine:.3f} + 0.15 = {limit:.3f} ms" + (f", and <= the peer's {peer1:.3f} ms" if peer1 else "")
                     + f": {_met(ok)}")
    ratio = results.get(f"ratio predict (batching (default)) / echo @{max(args.connections)}")
    conns = max(args.connections)
    req, p99, peer_req, peer_p99 = (get(main, conns, "req_s_median"), get(main, conns, "p99_ms_median"),
                                    get(PEER, conns, "req_s_median"), get(PEER, conns, "p99_ms_median"))
    if ratio is not None and req is not None and p99 is not None:
        ok = ratio >= 0.7 and (peer_req is None or (req >= peer_req and p99 <= (peer_p99 or 0.0)))
        peer_text = f"; req/s {req:.0f} >= the peer's {peer_req:.0f}, p99 {p99:.2f} <= the peer's {peer_p99:.2f} ms" \
            if peer_req is not None else ""
        lines.append(f"bar, {conns} connections: predict/echo req/s {ratio:.2f} >= 0.7{peer_text}: {_met(ok)}")
    many = results.get("memory", {}).get(f"{args.processes} processes", [])
    if len(many) >= 2:
        ratio = many[1]["uss"] / many[0]["pss"]
        lines.append(f"bar, {len(many)} processes: the second's USS {many[1]['uss']:.0f} MiB / the first's PSS "
                     f"{many[0]['pss']:.0f} MiB = {ratio:.2f} <= 0.40: {_met(ratio <= 0.40)}")
    for line in lines:
        print(line)
    return [f"- {line}" for line in lines]


def memory_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    for name, procs in results.get("memory", {}).items():
        each = "; ".join(f"pid {m['pid']}: RSS {m['rss']:.0f}, PSS {m['pss']:.0f}, USS {m['uss']:.0f}" for m in procs)
        lines.append(f"- memory after the run, {name} (MiB): {each}")
    return lines


def engine_p50_ms(bundle_dir: Path, texts: Sequence[str], k: int) -> float:
    """In-process single-query p50 of the engine the server runs (one thread, the bundle's scoring)."""
    from service.engine.predictor import Predictor

    predictor = Predictor.load(bundle_dir)
    seconds, _ = time_calls(lambda t: predictor.predict([t], k=k), list(texts)[:2000])
    predictor.bundle.close()
    return latency_summary(seconds)["p50_ms"]


def paired_lines(results: dict[str, Any]) -> list[str]:
    out = []
    for conns, pr in results["paired"].items():
        if pr.get("failed"):
            line = f"paired at {conns} connection: FAILED, {pr['non_2xx']} non-2xx, first: {pr['first_error']}"
        else:
            line = (f"paired at {conns} connection (requests alternate echo and predict): echo p50 "
                    f"{pr['echo']['p50_ms']:.2f} ms, mean {pr['echo']['mean_ms']:.2f} ms; predict p50 "
                    f"{pr['predict']['p50_ms']:.2f} ms, mean {pr['predict']['mean_ms']:.2f} ms; "
                    f"predict/echo throughput estimate {pr['ratio']:.2f}")
        print(line)
        out.append(f"- {line}")
    return out


def section_text(args: argparse.Namespace, bodies: dict[str, list[dict[str, Any]]], client_desc: str,
                 results: dict[str, Any], lines: list[str]) -> str:
    """The RESULTS.md 'http' section: setup, client, the table and ratio lines given."""
    manifest = json.loads((args.bundle_dir / "manifest.json").read_text())
    calls, shortlist = results["batch_sizes_default"], manifest.get("scoring", {}).get("shortlist", {})
    base_env, modes = server_modes(args)
    env_text = " ".join(f"{k}={v}" for k, v in base_env.items())
    mode_text = "; ".join(f"{name}: {' '.join(f'{k}={v}' for k, v in env.items()) or 'service defaults'}"
                          for name, env in modes.items())
    if args.client == "wrk":
        client_text = (f"Client: {client_desc} (one wrk thread, C connections) with a generated Lua script "
                       f"POSTing {len(bodies['predict'])} JSON bodies from the query texts in rotation "
                       f"(`{{\"text\": ..., \"k\": {args.k}}}` to /v1/predict, `{{\"text\": ...}}` to /v1/echo, "
                       f"{len(bodies['batch'])} bodies of {args.batch} texts for the batch points), on the same "
                       "2 cores as the servers; one untimed second per server first. The echo route costs "
                       "a fraction of a millisecond, less than the engine alone takes per query (bench/latency.py), "
                       "so a low predict/echo ratio says the engine, not the framework, bounds throughput.")
    else:
        client_text = (f"Client: closed-loop httpx client threads (one keep-alive connection each) rotating over "
                       f"{len(bodies['predict'])} query texts, on the same 2 cores as the servers; they saturate "
                       "before the server does, so ratios come out near 1 (use wrk).")
    return "\n".join([
        f"## HTTP service: /v1/predict against the framework floor (echo route), measured with {args.client}", "",
        f"Command: `{results['command']}`", "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {results['revision']}, 2 CPU cores "
        f"shared with other jobs; bundle `{args.bundle_dir}` (L={manifest.get('num_labels', 0):,}, "
        f"D={manifest.get('dim')}, shortlists w/mu/head/tok {shortlist.get('k_w')}/{shortlist.get('k_mu')}/"
        f"{shortlist.get('k_head')}/{shortlist.get('k_tok', 0)}); "
        f"queries from {'the tst titles of ' + args.data if args.data else 'label titles'};"
        f" k={args.k}; {args.rounds} interleaved rounds of {args.point_seconds:g} s per point, medians.", "",
        f"Servers: `shortlist serve` with {env_text} and service defaults otherwise (2 engine workers); "
        f"per mode: {mode_text}.", "",
        client_text, "", *lines,
        f"Default server: {calls['engine_calls']:.0f} engine calls, {calls['mean_texts_per_call']:.1f} texts per "
        f"call on average (dynamic batching plus the {args.batch}-text requests).",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    bodies = request_bodies(args)
    base_env, modes = server_modes(args)
    client_desc = (f"{wrk_version()}, `{' '.join(wrk_command('URL', Path('SCRIPT.lua'), 'C', args.wrk_seconds))}`"
                   if args.client == "wrk" else "closed-loop httpx client threads")
    results: dict[str, Any] = {"command": command_line(), "revision": git_revision(), "bundle": str(args.bundle_dir),
                               "client": args.client, "client_detail": client_desc,
                               "seconds_per_point": args.point_seconds, "rounds": args.rounds,
                               "distinct_bodies": {k: len(v) for k, v in bodies.items()},
                               "server_env": {name: {**base_env, **env} for name, env in modes.items()},
                               "points": {}, "failed_points": {}}
    results["engine_p50_ms"] = engine_p50_ms(args.bundle_dir, [b["text"] for b in bodies["predict"]], args.k)
    samples = run_points(args, bodies, client_desc, results)
    table, failed = point_table(samples, results)
    ratios = ratio_lines(args, samples, failed, results)
    bars = bar_lines(args, results) + memory_lines(results)
    paired = paired_lines(results)
    print(f"engine calls on the default server: {results['batch_sizes_default']}")
    out = OUT_DIR / "http.json"
    out.write_text(json.dumps(results, indent=2))
    engine = (f"- in-process engine p50 (service.engine.Predictor, one text, k={args.k}, one thread): "
              f"{results['engine_p50_ms']:.3f} ms")
    peer = (f"- {PEER}: bench/peer_service.py on {args.peer_run} (uvicorn, uvloop, httptools, orjson; the "
            "model called inline in the route)") if args.peer_run else ""
    lines = [*table, "", engine, *([peer] if peer else []), *ratios, "", *([*bars, ""] if bars else []),
             *([*paired, ""] if paired else [])]
    replace_section(args.results, "http", section_text(args, bodies, client_desc, results, lines))
    print(f"wrote {out} and the 'http' section of {args.results}")
    if failed:
        print(f"{len(failed)} point(s) FAILED (non-2xx responses or socket errors): see above and "
              f"{OUT_DIR / 'http-logs'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
