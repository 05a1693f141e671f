"""Where one /v1/predict request's time goes, at one connection: each stage of the route timed
on its own (the same functions the route calls), beside the request over HTTP and the echo
route (the framework's floor: HTTP, middleware, parsing and validating a body, writing JSON).

    python bench/request_path.py --bundle-root ROOT [--version V] [--data ../shared/data/debian-deps]

Stages, medians of many calls in this process (one text, k=10, the bundle's own scoring):
  validate   the request model on the JSON body (FastAPI's share beyond it is in echo's floor)
  lease      the registry's lease on the serving bundle (enter + exit)
  hand-off   EngineRunner.submit_one with an engine call that does nothing: the batcher's
             queue, the dispatcher task, the hop to the engine thread and back to the loop
  engine     Predictor.predict_ids on the calling thread (tokenize, encode, shortlist, score, top k)
  naming     the answer's labels named as the response's dicts (service.api.predict.named_rows)
  response   the body's JSON (orjson)
Over HTTP (a real `shortlist serve`, echo route on, access log off, wrk -c1): echo p50 and
predict p50; "unexplained" = predict - echo - (the stages beyond the floor), the time the
stages cost together that they do not cost apart (thread wake-ups, the GIL passed between the
loop and the engine thread, caches). The machine is shared: every figure is a median of rounds
alternated in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from _common import BENCH_DIR, add_bundle_arguments, command_line, git_revision, replace_section
from http_bench import query_texts, wrk_point, wrk_script

from service.api.batching import EngineRunner
from service.api.predict import named_rows
from service.api.registry import BundleRegistry
from service.api.schemas import RequestModels
from service.api.settings import Settings
from shortlist.testing import serve


def _median_us(fn: Callable[[int], Any], n: int) -> float:
    """Median wall time of fn(i) over n calls, in microseconds (after n // 10 untimed ones)."""
    for i in range(n // 10):
        fn(i)
    clock, times = time.perf_counter, []
    for i in range(n):
        t0 = clock()
        fn(i)
        times.append(clock() - t0)
    return statistics.median(times) * 1e6


async def _handoff_us(n: int, workers: int) -> float:
    runner = EngineRunner(workers)
    times = []
    for i in range(n + n // 10):
        t0 = time.perf_counter()
        await runner.submit_one(("bench", i % 4), "alpha", lambda texts: texts, "x")
        if i >= n // 10:
            times.append(time.perf_counter() - t0)
    runner.shutdown()
    return statistics.median(times) * 1e6


def stages(bundle_root: Path, version: str | None, texts: list[str], k: int, n: int) -> dict[str, float]:
    settings = Settings(bundle_root=bundle_root, load_check_in_child=False)
    registry = BundleRegistry(bundle_root, check_timeout_s=None)
    registry.activate(version)
    models = RequestModels(settings)
    bodies = [orjson.dumps({"text": t, "k": k}) for t in texts]
    out: dict[str, float] = {}
    out["validate"] = _median_us(lambda i: models.predict.model_validate_json(bodies[i % len(bodies)]), n)

    def lease(_: int) -> None:
        with registry.lease():
            pass

    out["lease"] = _median_us(lease, n)
    out["hand-off"] = asyncio.run(_handoff_us(n, settings.workers))
    with registry.lease() as engine:
        predictor, labels = engine.predictor, engine.bundle.labels
        out["engine"] = _median_us(lambda i: predictor.predict_ids([texts[i % len(texts)]], k=k), n)
        top = [predictor.predict_ids([t], k=k) for t in texts[:200]]
        out["naming"] = _median_us(lambda i: named_rows(labels, *top[i % len(top)]), n)
        answers = [named_rows(labels, *ids_scores) for ids_scores in top]

    out["response"] = _median_us(lambda i: orjson.dumps({"version": "v", "results": answers[i % len(answers)]}), n)
    registry.close()
    return out


def over_http(bundle_root: Path, version: str | None, texts: list[str], k: int, rounds: int,
              seconds: int) -> dict[str, list[float]]:
    """p50 (us) of echo and predict at one connection, per round, alternated."""
    env = {"SHORTLIST_ECHO_ROUTE": "true", "SHORTLIST_ACCESS_LOG": "false"}
    out: dict[str, list[float]] = {"echo": [], "predict": []}
    with tempfile.TemporaryDirectory(prefix="request-path-") as tmp, \
            serve(bundle_root, version=version, env=env, log_dir=Path(tmp), timeout=300) as server:
        scripts = {}
        for route, body in (("echo", lambda t: {"text": t}), ("predict", lambda t: {"text": t, "k": k})):
            scripts[route] = Path(tmp) / f"{route}.lua"
            scripts[route].write_text(wrk_script([body(t) for t in texts]), encoding="utf-8")
        for route in out:  # untimed warm-up
            wrk_point(f"{server.url}/v1/{route}", scripts[route], 1, 1)
        for rnd in range(rounds):
            for route in ("echo", "predict") if rnd % 2 == 0 else ("predict", "echo"):
                r = wrk_point(f"{server.url}/v1/{route}", scripts[route], 1, seconds)
                if r["non_2xx"] or r["socket_errors"]:
                    raise RuntimeError(f"{route}: failed requests in round {rnd + 1}: {r}")
                out[route].append(r["p50_ms"] * 1e3)
    return out


def report(stage_us: dict[str, float], http_us: dict[str, list[float]]) -> str:
    echo, predict = statistics.median(http_us["echo"]), statistics.median(http_us["predict"])
    beyond = sum(v for name, v in stage_us.items() if name != "validate")
    unexplained = predict - echo - beyond
    rows = [("echo over HTTP (the floor: HTTP, middleware, parse + validate a body, write JSON)", echo),
            *((f"stage: {name}", v) for name, v in stage_us.items()),
            ("predict over HTTP", predict),
            ("unexplained: predict - echo - (lease + hand-off + engine + naming + response)", unexplained)]
    lines = ["| what | us (median) | share of predict |", "|---|---:|---:|"]
    lines += [f"| {name} | {v:.0f} | {100 * v / predict:.0f}% |" for name, v in rows]
    lines += ["", f"HTTP rounds (p50 us): echo {', '.join(f'{x:.0f}' for x in http_us['echo'])}; "
              f"predict {', '.join(f'{x:.0f}' for x in http_us['predict'])}. The validate stage is part of "
              "echo's floor too (echo validates its own, smaller model), so it is not subtracted."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bundle_arguments(ap)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--calls", type=int, default=3000, help="timed calls per in-process stage")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--publish", action="store_true", help="write the table into bench/RESULTS.md")
    args = ap.parse_args(argv)
    root = args.bundle_root.resolve()
    bundle_dir = root / args.version if args.version else max(p for p in root.iterdir() if p.is_dir())
    texts = query_texts(bundle_dir, args.data, 2000)
    http_us = over_http(root, args.version, texts, args.k, args.rounds, args.seconds)
    stage_us = stages(root, args.version, texts, args.k, args.calls)
    body = "\n".join(["## The request path at one connection (issue 22)", "",
                      f"Command: `{command_line()}` (commit {git_revision()}); bundle {bundle_dir.name}.", "",
                      report(stage_us, http_us)])
    print(body)
    if args.publish:
        replace_section(BENCH_DIR / "RESULTS.md", "request-path", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
