"""Label-sharded serving on Ray Serve against `shortlist serve` on this machine (issue 26).

    python bench/shards.py --bundle BUNDLE --data DATA_DIR [--shards 1 2 4] [--results]

Shards the bundle into each count (`shortlist shard`), then in one run and one Ray instance
(num_cpus 2, fractional reservations): one Serve application per count (ingress + its shard
deployments, one replica each, under /sN) beside a `shortlist serve` of the unsharded bundle.
Every round measures, interleaved: echo and predict at each connection count on every server
(closed loop, httpx). Then: memory per process (PSS, USS), each shard's label files on disk,
accuracy of the in-process sharded engine (service.engine.sharding, the code the shard
deployments run) against the unsharded bundle on the data's test split, and issue 26's bar:
(p50 with 2 shards - p50 of echo on the same Ray instance) <= 2 x (`shortlist serve` predict
p50 - its echo p50). The machine is shared: compare figures of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from _common import OUT_DIR, command_line, git_revision, read_jsonl, replace_section
from http_bench import closed_loop, process_memory_mib, query_texts

from model_export.shard import SHARED_FILES, shard_bundle
from service.engine import Predictor
from service.engine.sharding import ShardedPredictor, shard_dirs
from shortlist.testing import free_port, serve

SINGLE = "shortlist serve"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, required=True, help="an unsharded bundle directory")
    p.add_argument("--data", default=None, help="data set directory (its tst split: queries and accuracy)")
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--connections", type=int, nargs="+", default=[1, 4])
    p.add_argument("--seconds", type=float, default=5.0, help="per point and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--queries", type=int, default=2000, help="test texts for accuracy")
    p.add_argument("--name", default=None, help="the data set's name in the report (default: the bundle's)")
    p.add_argument("--results", action="store_true", help="write the section of bench/RESULTS.md")
    return p.parse_args(argv)


def accuracy(bundle: Path, sharded: dict[int, Path], data: str | None, n: int) -> dict[str, Any]:
    """P@1 / P@5 (plain: every label may be predicted) of the unsharded bundle and of each shard
    count, and the share of texts whose top 5 ids are the unsharded top 5, in order."""
    if not data:
        return {}
    split = next(p for p in (Path(data) / f"tst{ext}" for ext in (".json.gz", ".jsonl", ".json")) if p.exists())
    rows = [r for r in read_jsonl(split, limit=n) if str(r.get("title", "")).strip()]
    texts, truths = [r["title"] for r in rows], [set(r["target_ind"]) for r in rows]
    want = [[p.id for p in row] for row in Predictor.load(bundle).predict(texts, k=5)]
    out: dict[str, Any] = {"texts": len(texts), "unsharded": _precision(want, truths)}
    for count, root in sharded.items():
        got = [[p.id for p in row] for row in ShardedPredictor.load(root).predict(texts, k=5)]
        same = float(np.mean([g == w for g, w in zip(got, want, strict=True)]))
        out[f"{count} shards"] = {**_precision(got, truths), "same_top5": same}
    return out


def _precision(ids: list[list[int]], truths: list[set[int]]) -> dict[str, float]:
    p1 = np.mean([len(set(row[:1]) & t) for row, t in zip(ids, truths, strict=True)])
    p5 = np.mean([len(set(row[:5]) & t) / 5 for row, t in zip(ids, truths, strict=True)])
    return {"P@1": 100 * float(p1), "P@5": 100 * float(p5)}


def shard_files_mib(root: Path) -> list[float]:
    """Each shard's own files on disk (not the encoder and tokenizer all shards share), MiB."""
    return [sum(f.stat().st_size for f in d.iterdir() if f.name not in SHARED_FILES) / 2**20
            for d in shard_dirs(root)]


def ray_processes(app: str) -> dict[str, list[dict[str, float]]]:
    """Memory of the ingress and of each shard replica of Serve application `app`, by the
    process titles Ray gives its replicas (ray::ServeReplica:APP:DEPLOYMENT)."""
    out: dict[str, list[dict[str, float]]] = {"ingress": [], "shards": []}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            title = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            pid = int(cmdline.parent.name)
            if f"ServeReplica:{app}:ingress" in title:
                out["ingress"].append({"pid": pid, **process_memory_mib(pid)})
            elif f"ServeReplica:{app}." in title and ":shard" in title:
                out["shards"].append({"pid": pid, **process_memory_mib(pid)})
        except OSError:  # the process ended while we looked
            continue
    return out


def start_ray(stack: ExitStack, root: Path, counts: Sequence[int]) -> dict[str, str]:
    """One local Ray instance (2 CPUs) serving application sN under /sN for each shard count N;
    returns {name: url}."""
    import ray
    from ray import serve

    from service.api.ray_app import build_app

    os.environ.update({"RAY_USAGE_STATS_ENABLED": "0", "SHORTLIST_ECHO_ROUTE": "true",
                       "SHORTLIST_ACCESS_LOG": "false"})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    stack.callback(ray.shutdown)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    stack.callback(serve.shutdown)
    urls = {}
    for count in counts:
        serve.run(build_app({"bundle_root": str(root / str(count)), "shards": count, "replicas": 1}),
                  name=f"s{count}", route_prefix=f"/s{count}")
        urls[f"{count} shards (Ray Serve)"] = f"http://127.0.0.1:{port}/s{count}"
    return urls


def measure(urls: dict[str, str], texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved rounds of echo and predict at each connection count on every server; the
    median over rounds of each point's p50, p99 and req/s."""
    bodies = {"echo": [{"text": t} for t in texts], "predict": [{"text": t, "k": 10} for t in texts]}
    samples: dict[str, list[dict[str, Any]]] = {}
    plan = [(name, route, conns) for conns in args.connections for name in urls for route in ("echo", "predict")]
    for rnd in range(args.rounds):
        for name, route, conns in plan if rnd % 2 == 0 else plan[::-1]:
            r = closed_loop(urls[name], f"/v1/{route}", bodies[route], conns, args.seconds, warmup_s=0.5)
            if r["non_2xx"]:
                raise RuntimeError(f"{name} {route}: {r['first_error']}")
            samples.setdefault(f"{name}|{route}|{conns}", []).append(r)
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    return {key: {m: float(np.median([r[m] for r in rs])) for m in ("p50_ms", "p99_ms", "req_s")}
            for key, rs in samples.items()}


def bar(points: dict[str, Any]) -> dict[str, float | bool]:
    """Issue 26's fan-out bar, at one connection."""
    def p50(name: str, route: str) -> float:
        return points[f"{name}|{route}|1"]["p50_ms"]

    ray2 = "2 shards (Ray Serve)"
    fanout = p50(ray2, "predict") - p50(ray2, "echo")
    single = p50(SINGLE, "predict") - p50(SINGLE, "echo")
    return {"fanout_ms": fanout, "single_ms": single, "ratio": fanout / single, "met": fanout <= 2 * single}


def report(args: argparse.Namespace, result: dict[str, Any]) -> str:
    lines = [f"`{command_line()}` at {git_revision()}; one run, 2 cores shared with other agents (noisy).",
             f"Bundle {args.bundle} ({result['labels']} labels). Ray {result['ray_version']}, one Ray instance "
             "(num_cpus 2; ingress 0.2, each shard replica 0.1 CPU), 1 replica per shard.", "",
             "| server | route | conns | p50 ms | p99 ms | req/s |", "|---|---|---|---|---|---|"]
    for key, m in result["points"].items():
        name, route, conns = key.split("|")
        lines.append(f"| {name} | {route} | {conns} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | {m['req_s']:.0f} |")
    lines += ["", "Memory (MiB, PSS / USS per process) and each shard's own label files on disk (MiB):", ""]
    lines.append(f"- {SINGLE}: " + ", ".join(f"{p['pss']:.0f} / {p['uss']:.0f}" for p in result["memory"][SINGLE]))
    for count in args.shards:
        mem = result["memory"][f"s{count}"]
        lines.append(f"- {count} shards: ingress " + ", ".join(f"{p['pss']:.0f} / {p['uss']:.0f}" for p in
                     mem["ingress"]) + "; shards " + ", ".join(f"{p['pss']:.0f} / {p['uss']:.0f}" for p in
                     mem["shards"]) + "; files " + ", ".join(f"{x:.2f}" for x in result["shard_files"][str(count)]))
    if result["accuracy"]:
        lines += ["", f"Accuracy on {result['accuracy']['texts']} test texts (plain, in-process sharded engine):", ""]
        lines += [f"- {name}: " + ", ".join(f"{k} {v:.3f}" if k == "same_top5" else f"{k} {v:.2f}"
                                            for k, v in m.items()) for name, m in result["accuracy"].items()
                  if name != "texts"]
    b = result["bar"]
    lines += ["", f"Fan-out bar (1 connection): 2 shards predict - Ray echo = {b['fanout_ms']:.2f} ms; "
              f"`shortlist serve` predict - echo = {b['single_ms']:.2f} ms; ratio {b['ratio']:.2f} "
              f"(bar <= 2): {'met' if b['met'] else 'NOT met'}."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    bundle = args.bundle.resolve()
    work = Path(tempfile.mkdtemp(prefix="shards-", dir=OUT_DIR))
    sharded = {count: shard_bundle(bundle, count, work / str(count)) for count in args.shards}
    result: dict[str, Any] = {"labels": Predictor.load(bundle).num_labels,
                              "accuracy": accuracy(bundle, sharded, args.data, args.queries),
                              "shard_files": {str(c): shard_files_mib(p) for c, p in sharded.items()}}
    print(json.dumps(result["accuracy"], indent=1), flush=True)
    texts = query_texts(bundle, args.data, 2000)
    with ExitStack() as stack:
        import ray

        result["ray_version"] = ray.__version__
        urls = start_ray(stack, work, args.shards)
        single = stack.enter_context(serve(bundle.parent, version=bundle.name, env={"SHORTLIST_ECHO_ROUTE": "true",
                                           "SHORTLIST_ACCESS_LOG": "false"}, log_dir=work, timeout=300))
        urls = {SINGLE: single.url, **urls}
        result["points"] = measure(urls, texts, args)
        result["memory"] = {SINGLE: [{"pid": single.proc.pid, **process_memory_mib(single.proc.pid)}],
                            **{f"s{c}": ray_processes(f"s{c}") for c in args.shards}}
    result["bar"] = bar(result["points"])
    text = report(args, result)
    print(text)
    name = args.name or bundle.name
    (OUT_DIR / f"shards-{name}.json").write_text(json.dumps(result, indent=1))
    if args.results:
        replace_section(Path(__file__).parent / "RESULTS.md", f"shards-{name}", f"## Sharded serving on Ray Serve: "
                        f"{name}\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
