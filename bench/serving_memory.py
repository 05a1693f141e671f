"""Where a serving process's memory goes: a bundle loaded step by step in one process, and the
processes of a multi-process server.

    python bench/serving_memory.py steps --bundle DIR [--data DIR] [--queries 1000]
    python bench/serving_memory.py processes --bundle-root ROOT [--version V] [--processes 2]
                                             [--data DIR] [--queries 2000] [--env NAME=VALUE ...]

`steps` runs in a fresh interpreter: the service's imports, then each part of the bundle as
`Bundle.open` and the first queries open it (tokenizer, label table, vector arrays, tree,
encoder session, HNSW indices, token table, predictor and canary), then `queries` single queries
and every test title in batches of 1000 (bench/peers.py's protocol). After each step: RSS, PSS and USS (private clean +
dirty) from /proc/self/smaps, the peak RSS so far (ru_maxrss), and the private memory by kind
of mapping (heap: glibc's main heap and anonymous mappings, i.e. malloc arenas, large mallocs,
Python's object arenas, onnxruntime's buffers; the bundle's files; shared libraries; the rest).

`processes` starts `shortlist serve` with SHORTLIST_PROCESSES=N (gunicorn's arbiter), sends
`queries` single-text requests round-robin over fresh connections, and prints the same figures
for the arbiter and every serving process, and the issue-22 ratio: the second process's USS
over the first's PSS.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def _kind(path: str | None, bundle: str | None) -> str:
    if not path or path.startswith("[anon") or path == "[heap]":
        return "heap"
    if path.startswith("["):
        return "stack+other"
    if bundle and path.startswith(bundle):
        return "bundle files"
    if ".so" in Path(path).name:
        return "libraries"
    return "other files"


def memory_breakdown(pid: int | str = "self", bundle: Path | str | None = None) -> dict[str, Any]:
    """RSS, PSS, USS (MiB) of a process, its private and proportional memory by kind of mapping,
    and the PSS of each bundle file it maps."""
    totals = {"rss": 0, "pss": 0, "uss": 0}
    private: dict[str, int] = {}
    pss: dict[str, int] = {}
    files: dict[str, int] = {}
    kind, name = "heap", ""
    prefix = str(Path(bundle).resolve()) if bundle else None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if _MAPPING.match(line):
                parts = line.split(None, 5)
                name = parts[5].strip() if len(parts) == 6 else ""
                kind = _kind(name, prefix)
                continue
            key, _, rest = line.partition(":")
            if key == "Rss":
                totals["rss"] += int(rest.split()[0])
            elif key == "Pss":
                kib = int(rest.split()[0])
                totals["pss"] += kib
                pss[kind] = pss.get(kind, 0) + kib
                if kind == "bundle files":
                    files[Path(name).name] = files.get(Path(name).name, 0) + kib
            elif key in ("Private_Clean", "Private_Dirty"):
                kib = int(rest.split()[0])
                totals["uss"] += kib
                private[kind] = private.get(kind, 0) + kib
    mib = lambda d: {k: round(v / 1024, 1) for k, v in sorted(d.items())}  # noqa: E731
    return {**mib(totals), "private": mib(private), "pss_by_kind": mib(pss),
            "bundle_files_pss": {k: v for k, v in mib(files).items() if v >= 0.1}}


def _peak_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _titles(data: Path | None, n: int | None, bundle: Path) -> list[str]:
    """The first `n` (None: all) test titles of `data`, else label titles of the bundle."""
    out: list[str] = []
    with gzip.open(data / "tst.json.gz", "rt", encoding="utf-8") if data else (bundle / "labels.jsonl").open() as f:
        for line in f:
            out.append(json.loads(line)["title"])
            if len(out) == n:
                break
    return out


def _report(step: str, seconds: float, bundle: Path) -> None:
    m = memory_breakdown(bundle=bundle)
    print(json.dumps({"step": step, "s": round(seconds, 3), "peak_rss": _peak_mib(), **m}), flush=True)


def run_steps(args: argparse.Namespace) -> int:
    """Each step in turn, with the figures after it (one JSON line a step)."""
    bundle_dir = args.bundle.resolve()
    texts = _titles(args.data, None, bundle_dir)
    singles = texts[: args.queries]
    _report("start (python, argparse, json)", 0.0, bundle_dir)
    steps: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
        ("imports (service.engine: numpy, onnxruntime, hnswlib, pydantic)", _import_engine),
        ("bundle: checksums, tokenizer, labels, vector arrays, tree", lambda c: _open(c, bundle_dir)),
        ("encoder session + check of every token id", lambda c: c["bundle"].encoder(1)),
        ("predictor: HNSW indices, token table, canary (Predictor.load's)", _predictor),
        (f"{len(singles)} single queries, k=5", lambda c: [c["predictor"].predict_ids([t], k=5) for t in singles]),
        (f"all {len(texts)} queries in batches of 1000, k=6",
         lambda c: [c["predictor"].predict_ids(texts[i : i + 1000], k=6) for i in range(0, len(texts), 1000)]),
        (f"{len(singles)} single tree queries", _tree_queries(singles)),
    ]
    ctx: dict[str, Any] = {}
    for name, step in steps:
        t0 = time.perf_counter()
        step(ctx)
        _report(name, time.perf_counter() - t0, bundle_dir)
    return 0


def _import_engine(ctx: dict[str, Any]) -> None:
    import service.engine.bundle  # noqa: F401
    import service.engine.predictor  # noqa: F401


def _open(ctx: dict[str, Any], path: Path) -> None:
    from service.engine.bundle import Bundle

    ctx["bundle"] = Bundle.open(path)


def _predictor(ctx: dict[str, Any]) -> None:
    from service.engine import Predictor, PredictorOptions

    # What Predictor.load does once the bundle is open: the sources, the canaries, pages handed back.
    ctx["predictor"] = Predictor.checked(ctx["bundle"], PredictorOptions(threads=1))


def _tree_queries(texts: list[str]) -> Callable[[dict[str, Any]], None]:
    def run(ctx: dict[str, Any]) -> None:
        if ctx["bundle"].has_tree:
            for t in texts:
                ctx["predictor"].predict_tree_ids([t], k=5)
    return run


def run_processes(args: argparse.Namespace) -> int:
    """A multi-process server's processes after `queries` requests: figures per process."""
    import httpx

    from shortlist.testing import serve

    root = args.bundle_root.resolve()
    version = args.version or sorted(p.name for p in root.iterdir() if (p / "manifest.json").exists())[-1]
    texts = _titles(args.data, args.queries, root / version)
    with tempfile.TemporaryDirectory(prefix="serving-memory-") as state:
        env = {"SHORTLIST_PROCESSES": str(args.processes), "SHORTLIST_STATE_DIR": state,
               "SHORTLIST_ACCESS_LOG": "false", **dict(e.split("=", 1) for e in args.env)}
        with serve(root, version=version, env=env, log_dir=Path(state), timeout=300) as server:
            _wait_for_processes(Path(state), args.processes, version)
            t0 = time.perf_counter()
            for text in texts:  # a new connection each: the kernel spreads them over the processes
                httpx.post(f"{server.url}/v1/predict", json={"text": text, "k": 10}, timeout=30).raise_for_status()
            seconds = time.perf_counter() - t0
            pids = sorted(int(p.stem) for p in (Path(state) / "processes").glob("*.json"))
            rows = [{"pid": server.proc.pid, "role": "arbiter", **memory_breakdown(server.proc.pid, root / version)}]
            rows += [{"pid": pid, "role": "serving", **memory_breakdown(pid, root / version)} for pid in pids]
    for row in rows:
        print(json.dumps(row), flush=True)
    serving = [r for r in rows if r["role"] == "serving"]
    if len(serving) >= 2:
        print(json.dumps({"queries": len(texts), "s": round(seconds, 1), "env": env | {"SHORTLIST_STATE_DIR": "tmp"},
                          "second_uss_over_first_pss": round(serving[1]["uss"] / serving[0]["pss"], 3)}))
    return 0


def _wait_for_processes(state: Path, n: int, version: str, timeout_s: float = 300.0) -> None:
    """Until `n` serving processes publish that they serve `version` (service.api.processes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = []
        for p in (state / "processes").glob("*.json"):
            try:
                records.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
        if sum(r.get("version") == version for r in records) >= n:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{n} processes did not all serve {version} within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    steps = sub.add_parser("steps")
    steps.add_argument("--bundle", type=Path, required=True)
    steps.add_argument("--data", type=Path, default=None, help="queries from its tst.json.gz titles "
                       "(default: the bundle's label titles)")
    steps.add_argument("--queries", type=int, default=1000)
    procs = sub.add_parser("processes")
    procs.add_argument("--bundle-root", type=Path, required=True)
    procs.add_argument("--version", default=None)
    procs.add_argument("--processes", type=int, default=2)
    procs.add_argument("--data", type=Path, default=None)
    procs.add_argument("--queries", type=int, default=2000)
    procs.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE", help="more server environment")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_steps(args) if args.mode == "steps" else run_processes(args)


if __name__ == "__main__":
    sys.exit(main())
