"""Label-sharded serving on Ray Serve against `shortlist serve` on this machine (issue 26).

    python bench/shards.py --bundle BUNDLE --data DATA_DIR [--shards 1 2 4] [--ray-mode low-latency]

Shards the bundle into each count (`shortlist shard`), then in one run and one Ray instance
(num_cpus 2, fractional reservations): one Serve application per count (ingress + its shard
deployments, one replica each, under /sN) beside a `shortlist serve` of the unsharded bundle,
and Ray Serve's own cost of a fan-out, measured on minimal applications of the same instance: an
echo ingress alone (/ray-echo), and an ingress that sends the request body to N echo deployments
through deployment handles at once and answers the first (/ray-hopN). Every round measures,
interleaved: echo and predict at each connection count on every server (closed loop, httpx).
Then: memory per process (PSS, USS), each shard's own files on disk, accuracy of the in-process
sharded engine (service.engine.sharding, the code the shard deployments run) against the
unsharded bundle on the data's test split (plain, and with --filter own the XC filtered
protocol), and issue 26's bar: (p50 with 2 shards - p50 of echo on the same Ray instance) <= 2 x
(`shortlist serve` predict p50 - its echo p50), split into Ray's part (ray-hop2 - ray-echo) and
ours (the rest). --ray-mode: Ray Serve's low-latency layout (service.api.ray_serve_cli.LOW_LATENCY_ENV,
what `shortlist serve-ray` starts) or Ray's defaults. The machine is shared: compare figures of
one run only; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from _common import OUT_DIR, command_line, git_revision, replace_section
from fastapi import Body, FastAPI
from http_bench import closed_loop, process_memory_mib, query_texts

from model_export.evaluate import filtered_pairs
from model_export.shard import SHARED_FILES, shard_bundle
from service.engine import Predictor
from service.engine.sharding import ShardedPredictor, shard_dirs
from shortlist.testing import free_port, serve
from training.data import load_labels, load_split

SINGLE = "shortlist serve"
RAY_MODES = ("low-latency", "default")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, required=True, help="an unsharded bundle directory")
    p.add_argument("--data", default=None, help="data set directory (its tst split: queries and accuracy)")
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--connections", type=int, nargs="+", default=[1, 4])
    p.add_argument("--seconds", type=float, default=5.0, help="per point and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--queries", type=int, default=2000, help="test texts for accuracy")
    p.add_argument("--filter", default="plain", choices=["plain", "own"],
                   help="own: also the XC filtered protocol (a document's own label left out)")
    p.add_argument("--ray-mode", default=RAY_MODES[0], choices=RAY_MODES,
                   help="low-latency: service.api.ray_serve_cli.LOW_LATENCY_ENV (serve-ray's); default: Ray's defaults")
    p.add_argument("--work", type=Path, default=None,
                   help="where the shard sets go (WORK/N/VERSION); sets already there are reused (default: a new "
                        "directory under bench/out)")
    p.add_argument("--name", default=None, help="the data set's name in the report (default: the bundle's)")
    p.add_argument("--results", action="store_true", help="write the section of bench/RESULTS.md")
    return p.parse_args(argv)


def accuracy(bundle: Path, sharded: dict[int, Path], data: str | None, n: int, protocol: str) -> dict[str, Any]:
    """P@1 / P@5 of the unsharded bundle and of each shard count, under each protocol (plain; own:
    a document's own label left out of its predictions, through the engine's exclude, and of its
    truth), and the share of texts whose top 5 ids are the unsharded top 5, in order."""
    if not data:
        return {}
    parent = Predictor.load(bundle)
    docs = load_split(data, "tst", parent.bundle.manifest.text_field, num_labels=parent.num_labels)
    docs = docs.subset([i for i in range(len(docs)) if docs.texts[i].strip()][:n])
    engines = {"unsharded": parent, **{f"{c} shards": ShardedPredictor.load(root) for c, root in sharded.items()}}
    out: dict[str, Any] = {"texts": len(docs)}
    for name in ("plain", "own") if protocol == "own" else ("plain",):
        left_out = filtered_pairs(name, docs, load_labels(data, parent.bundle.manifest.text_field)
                                  if name == "own" else None, parent.num_labels)
        truths = [set(t) - set(d) for t, d in zip(docs.targets, left_out, strict=True)]
        answers = {engine: _top5(e, parent, docs.texts, left_out) for engine, e in engines.items()}
        want = answers["unsharded"]
        out[name] = {engine: {**_precision(got, truths), "same_top5": float(np.mean(
            [g == w for g, w in zip(got, want, strict=True)]))} for engine, got in answers.items()}
    return out


def _top5(engine: Predictor | ShardedPredictor, parent: Predictor, texts: list[str],
          left_out: list[list[int]]) -> list[list[int]]:
    """Each text's top 5 ids, its left-out labels excluded (the sharded engine excludes by uid, as
    its HTTP API does: one request per text that has some)."""
    if isinstance(engine, Predictor):
        return [row[row >= 0].tolist() for b in range(0, len(texts), 256)
                for row in engine.predict_ids(texts[b:b + 256], k=5, exclude=left_out[b:b + 256])[0]]
    out: list[list[int]] = []
    for b in range(0, len(texts), 256):
        batch, drops = texts[b:b + 256], left_out[b:b + 256]
        plain = engine.predict(batch, k=5)
        for text, drop, row in zip(batch, drops, plain, strict=True):
            if drop:
                row = engine.predict([text], k=5, exclude=[parent.bundle.labels.row(i)[0] for i in drop])[0]
            out.append([p.id for p in row])
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


def hop_application(fanout: int) -> Any:
    """A minimal Ray Serve application: POST /v1/echo sends the JSON body to `fanout` echo
    deployments through deployment handles at once and answers the first answer (fanout 0: the
    ingress answers the body itself). Defined here so that Ray pickles it by value."""
    from ray import serve

    api = FastAPI()

    @serve.deployment(name="echo", ray_actor_options={"num_cpus": 0.05})
    class Echo:
        def echo(self, body: dict[str, Any]) -> dict[str, Any]:  # sync, as a shard's predict: Serve's thread pool
            return body

    @serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0.05})
    @serve.ingress(api)
    class HopIngress:
        def __init__(self, *bound: Any) -> None:
            # Handles made here, as the sharded ingress makes its own: a handle bound in the driver
            # keeps the driver's Ray settings (actor calls, not the low-latency layout's gRPC).
            app = serve.get_replica_context().app_name
            self.handles = [serve.get_deployment_handle(f"echo{i}", app) for i in range(len(bound))]

        @api.post("/v1/echo")
        async def echo(self, body: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008  FastAPI's way
            if not self.handles:
                return body
            return (await asyncio.gather(*(h.echo.remote(body) for h in self.handles)))[0]

    return HopIngress.bind(*(Echo.options(name=f"echo{i}").bind() for i in range(fanout)))


def start_ray(stack: ExitStack, root: Path, counts: Sequence[int], mode: str) -> dict[str, str]:
    """One local Ray instance (2 CPUs) serving application sN under /sN for each shard count N, and
    the hop applications; returns {name: url}."""
    from service.api.ray_serve_cli import LOW_LATENCY_ENV

    os.environ.update({"RAY_USAGE_STATS_ENABLED": "0", "SHORTLIST_ECHO_ROUTE": "true",
                       "SHORTLIST_ACCESS_LOG": "false",
                       **{k: "1" if mode == "low-latency" else "0" for k in LOW_LATENCY_ENV}})
    import ray
    from ray import serve

    from service.api.ray_app import build_app

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
    for fanout in (0, *counts):
        name = "ray-echo" if fanout == 0 else f"ray-hop{fanout}"
        serve.run(hop_application(fanout), name=name, route_prefix=f"/{name}")
        urls[name] = f"http://127.0.0.1:{port}/{name}"
    return urls


def measure(urls: dict[str, str], texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved rounds of echo and predict at each connection count on every server (echo only
    on the hop applications); the median over rounds of each point's p50, p99 and req/s, and the
    load average (1 min) after each round."""
    bodies = {"echo": [{"text": t} for t in texts], "predict": [{"text": t, "k": 10} for t in texts]}
    samples: dict[str, list[dict[str, Any]]] = {}
    plan = [(name, route, conns) for conns in args.connections for name in urls
            for route in (("echo",) if name.startswith("ray-") else ("echo", "predict"))]
    loads = []
    for rnd in range(args.rounds):
        for name, route, conns in plan if rnd % 2 == 0 else plan[::-1]:
            r = closed_loop(urls[name], f"/v1/{route}", bodies[route], conns, args.seconds, warmup_s=0.5)
            if r["non_2xx"]:
                raise RuntimeError(f"{name} {route}: {r['first_error']}")
            samples.setdefault(f"{name}|{route}|{conns}", []).append(r)
        loads.append(os.getloadavg()[0])
        print(f"round {rnd + 1}/{args.rounds} done, load average {loads[-1]:.1f}", flush=True)
    points = {key: {m: float(np.median([r[m] for r in rs])) for m in ("p50_ms", "p99_ms", "req_s")}
              for key, rs in samples.items()}
    return {"points": points, "load_average": loads}


def bar(points: dict[str, Any]) -> dict[str, float | bool]:
    """Issue 26's fan-out bar, at one connection, and its split into Ray's part and ours."""
    def p50(name: str, route: str = "echo") -> float:
        return points[f"{name}|{route}|1"]["p50_ms"]

    ray2 = "2 shards (Ray Serve)"
    fanout = p50(ray2, "predict") - p50(ray2)
    single = p50(SINGLE, "predict") - p50(SINGLE)
    rays = p50("ray-hop2") - p50("ray-echo")
    return {"fanout_ms": fanout, "single_ms": single, "ratio": fanout / single, "met": fanout <= 2 * single,
            "ray_hop2_ms": rays, "ray_hop1_ms": p50("ray-hop1") - p50("ray-echo") if "ray-hop1|echo|1" in points
            else float("nan"), "ours_ms": fanout - rays, "ours_ratio": (fanout - rays) / single}


def report(args: argparse.Namespace, result: dict[str, Any]) -> str:
    loads = ", ".join(f"{x:.1f}" for x in result["load_average"])
    lines = [f"`{command_line()}` at {git_revision()}; one run, 2 cores shared with other agents; load average "
             f"(1 min) after each round: {loads}; before: {result['load_before']}.",
             f"Bundle {args.bundle} ({result['labels']} labels). Ray {result['ray_version']}, one Ray instance "
             f"(num_cpus 2; ingress 0.2, each shard replica 0.1 CPU), 1 replica per shard, Ray mode "
             f"{args.ray_mode}.", "",
             "| server | route | conns | p50 ms | p99 ms | req/s |", "|---|---|---|---|---|---|"]
    for key, m in result["points"].items():
        name, route, conns = key.split("|")
        lines.append(f"| {name} | {route} | {conns} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | {m['req_s']:.0f} |")
    lines += ["", "Memory (MiB, PSS / USS per process) and each shard's own files on disk (MiB):", ""]
    lines.append(f"- {SINGLE}: " + ", ".join(f"{p['pss']:.0f} / {p['uss']:.0f}" for p in result["memory"][SINGLE]))
    for count in args.shards:
        mem = result["memory"][f"s{count}"]
        lines.append(f"- {count} shards: ingress " + ", ".join(f"{p['pss']:.0f} / {p['uss']:.0f}" for p in
                     mem["ingress"]) + "; shards " + ", ".join(f"{p['pss']:.0f} / {p['uss']:.0f}" for p in
                     mem["shards"]) + "; files " + ", ".join(f"{x:.2f}" for x in result["shard_files"][str(count)]))
    lines += accuracy_lines(result["accuracy"])
    b = result["bar"]
    lines += ["", f"Fan-out bar (1 connection): 2 shards predict - their echo = {b['fanout_ms']:.2f} ms; "
              f"`shortlist serve` predict - echo = {b['single_ms']:.2f} ms; ratio {b['ratio']:.2f} "
              f"(bar <= 2): {'met' if b['met'] else 'NOT met'}. Of the {b['fanout_ms']:.2f} ms, Ray Serve's own "
              f"two parallel handle calls (ray-hop2 - ray-echo) {b['ray_hop2_ms']:.2f} ms (one call: "
              f"{b['ray_hop1_ms']:.2f} ms); the rest, ours (encode once, two shards' scoring, their arguments and "
              f"answers, the merge): {b['ours_ms']:.2f} ms = {b['ours_ratio']:.2f} x `shortlist serve`'s."]
    return "\n".join(lines)


def accuracy_lines(acc: dict[str, Any]) -> list[str]:
    if not acc:
        return []
    lines = ["", f"Accuracy on {acc['texts']} test texts (in-process sharded engine; own: a document's own label "
             "left out of predictions and truth):", ""]
    for protocol in ("plain", "own"):
        for name, m in acc.get(protocol, {}).items():
            lines.append(f"- {protocol}, {name}: P@1 {m['P@1']:.2f}, P@5 {m['P@5']:.2f}, same top 5 as unsharded "
                         f"{m['same_top5']:.3f}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    bundle = args.bundle.resolve()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="shards-", dir=OUT_DIR))
    sharded = {count: work / str(count) / bundle.name if (work / str(count) / bundle.name).is_dir()
               else shard_bundle(bundle, count, work / str(count)) for count in args.shards}
    result: dict[str, Any] = {"labels": Predictor.load(bundle).num_labels,
                              "accuracy": accuracy(bundle, sharded, args.data, args.queries, args.filter),
                              "shard_files": {str(c): shard_files_mib(p) for c, p in sharded.items()}}
    print(json.dumps(result["accuracy"], indent=1), flush=True)
    texts = query_texts(bundle, args.data, 2000)
    result["load_before"] = f"{os.getloadavg()[0]:.1f}"
    with ExitStack() as stack:
        urls = start_ray(stack, work, args.shards, args.ray_mode)
        import ray

        result["ray_version"] = ray.__version__
        single = stack.enter_context(serve(bundle.parent, version=bundle.name, env={"SHORTLIST_ECHO_ROUTE": "true",
                                           "SHORTLIST_ACCESS_LOG": "false"}, log_dir=work, timeout=300))
        urls = {SINGLE: single.url, **urls}
        result.update(measure(urls, texts, args))
        result["memory"] = {SINGLE: [{"pid": single.proc.pid, **process_memory_mib(single.proc.pid)}],
                            **{f"s{c}": ray_processes(f"s{c}") for c in args.shards}}
    result["bar"] = bar(result["points"])
    text = report(args, result)
    print(text)
    name = args.name or bundle.name
    (OUT_DIR / f"shards-{name}-{args.ray_mode}.json").write_text(json.dumps(result, indent=1))
    if args.results:
        # Inside "Sharded serving on Ray Serve (issue 26)" where the markers are; else appended.
        replace_section(Path(__file__).parent / "RESULTS.md", f"shards-{name}-{args.ray_mode}", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
