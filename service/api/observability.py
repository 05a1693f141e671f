"""Metrics (prometheus-client), the JSON-lines access log, request ids, and the last-resort 500.

The middleware is plain ASGI (not BaseHTTPMiddleware) so it costs little per request and
sees every response, including those of unmatched routes and of crashes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.config import LOG_LEVELS

from service.api.errors import error_json
from service.api.events import event_log, log_event
from service.api.http_protocol import BODY_TIMED_OUT, CLIENT_GONE, CONNECTION, connection_metrics
from service.api.processes import MULTIPROCESS_ENV, process_alive

access_log = logging.getLogger("shortlist.access")
error_log = event_log  # service.api.events: the structured events' logger

CLIENT_CLOSED = 499
# On every answer: each is the live state of a process (the version serving, its health, its
# counters) or an answer of that version, never something a cache between may hand out again.
NO_STORE = (b"cache-control", b"no-store")
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ACTIVE_BUNDLE = ("shortlist_active_bundle", "1 for the bundle version now serving")


class ServiceMetrics:
    """One registry per app, so several apps in one process (tests, admin port) never collide.

    With several serving processes (PROMETHEUS_MULTIPROC_DIR set by `shortlist serve` before
    they start), prometheus-client keeps every value in a file per process and /metrics sums
    counters and histograms over the live processes; the active bundle and the start-up
    fallback are reported per process (a `pid` label), requests in flight summed. The active
    bundle is then read at each scrape from what each live process published (`served_by`), not
    kept in a value file: such a file cannot drop a label set, and would export every version a
    process ever served.
    """

    def __init__(self) -> None:
        self.multiprocess = MULTIPROCESS_ENV in os.environ
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("shortlist_http_requests_total", "HTTP requests answered",
                                ["route", "method", "status"], registry=r)
        self.latency = Histogram("shortlist_http_request_duration_seconds", "HTTP request latency",
                                 ["route", "status"], buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("shortlist_http_requests_in_flight", "HTTP requests being served",
                               registry=r, multiprocess_mode="livesum")
        self.active_bundle = Gauge(*ACTIVE_BUNDLE, ["version"], registry=r)
        # With several processes: {pid: version served} of the live ones (service.api.processes).
        self.served_by: Callable[[], dict[int, str]] | None = None
        # The state directory's problem or None (service.api.state_check), read at each scrape.
        self._state_writable: _StateWritable | None = None
        self.batch_size = Histogram("shortlist_engine_batch_size", "texts per engine call",
                                    ["scorer"], buckets=_BATCH_BUCKETS, registry=r)
        self.shed = Counter("shortlist_requests_shed_total", "predictions refused 503 overloaded: the engine's "
                            "line was full (queue_full) or the request waited too long in it (queue_wait)",
                            ["reason"], registry=r)
        self.swaps = Counter("shortlist_bundle_swaps_total", "successful bundle activations", registry=r)
        self.failed_activations = Counter("shortlist_bundle_activation_failures_total",
                                          "activations refused", ["reason"], registry=r)
        self.startup_fallback = Gauge("shortlist_startup_fallback",
                                      "1 when start-up could not serve the wanted bundle and serves "
                                      "the newest one that loads instead", ["wanted"], registry=r,
                                      multiprocess_mode="liveall")
        self.bundle_changed = Counter("shortlist_bundle_changed_total", "serving versions found written in place "
                                      "on disk since they were loaded (503 bundle_changed)", registry=r)
        self.activation_seconds = Histogram("shortlist_bundle_activation_seconds",
                                            "load + validate + swap time",
                                            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
                                            registry=r)
        self._batch_sizes: dict[str, Any] = {}  # batch_size's child per scorer
        connections = connection_metrics()  # the HTTP protocol's (below the app), one per process
        for process_wide in (connections.refused, connections.open):
            r.register(process_wide)

    def observe_batch(self, scorer: str, texts: int) -> None:
        """An engine call of `texts` texts by `scorer` (its histogram child looked up once: this is
        on every call's path)."""
        child = self._batch_sizes.get(scorer)
        if child is None:
            child = self._batch_sizes[scorer] = self.batch_size.labels(scorer)
        child.observe(texts)

    def watch_state_dir(self, problem: Callable[[], str | None]) -> None:
        """Export shortlist_state_writable from `problem` at each scrape: the directory is the
        processes' shared one, so the answering process's look is the service's (no value file)."""
        self._state_writable = _StateWritable(problem)
        if not self.multiprocess:
            self.registry.register(self._state_writable)

    def set_active(self, version: str) -> None:
        if self.multiprocess:  # exported from the processes' records (served_by)
            return
        self.active_bundle.clear()
        self.active_bundle.labels(version=version).set(1)

    def exposition(self) -> bytes:
        """The Prometheus text of this process, or of every live serving process."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        directory = Path(os.environ[MULTIPROCESS_ENV])
        for path in directory.glob("gauge_live*_*.db"):  # processes that died without saying so
            pid = path.stem.rsplit("_", 1)[-1]
            if pid.isdigit() and not process_alive(int(pid)):
                multiprocess.mark_process_dead(int(pid), str(directory))
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(directory))
        if self.served_by is not None:
            registry.register(_ServedVersions(self.served_by))
        if self._state_writable is not None:
            registry.register(self._state_writable)
        return generate_latest(registry)


class _StateWritable:
    """shortlist_state_writable: 1 while the state directory takes writes, 0 when it is gone or
    read-only (admin writes then answer 503 state_unavailable; predictions serve on)."""

    def __init__(self, problem: Callable[[], str | None]) -> None:
        self.problem = problem

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("shortlist_state_writable", "1 while the state directory (SHORTLIST_STATE_DIR) "
                                "takes writes, 0 when it is gone or read-only", value=0.0 if self.problem() else 1.0)


class _ServedVersions:
    """shortlist_active_bundle{pid, version} = 1 for each live process, the version it serves."""

    def __init__(self, served_by: Callable[[], dict[int, str]]) -> None:
        self.served_by = served_by

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(*ACTIVE_BUNDLE, labels=["pid", "version"])
        for pid, version in sorted(self.served_by().items()):
            family.add_metric([str(pid), version], 1.0)
        yield family


def setup_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """JSON lines on `stream` (stdout) for access and error records; idempotent."""
    for logger in (access_log, error_log):
        if not logger.handlers:
            handler = logging.StreamHandler(stream or sys.stdout)
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
            logger.propagate = False
        logger.setLevel(logging.INFO)
    # By number: "trace" (uvicorn's, below debug) is no level name of the logging module's own.
    logging.getLogger("shortlist").setLevel(LOG_LEVELS[level.lower()])


def _route_label(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    # Unmatched paths share one label so scanners cannot blow up the metric cardinality.
    return path if isinstance(path, str) else "unmatched"


class ObservabilityMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServiceMetrics, access_log_enabled: bool = True) -> None:
        self.app = app
        # Which serving process answered (several share a port); built after the fork, once per process.
        self.pid = os.getpid()
        self.metrics = metrics
        self.access_log_enabled = access_log_enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        request_id = _request_id(scope)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status = 500
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode()), NO_STORE]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        except ClientDisconnect:
            status = CLIENT_CLOSED  # while the body was read, or while the request waited for the engine
        except asyncio.CancelledError:
            status = 503
            if not _abandoned(scope, request_id):
                raise
        except Exception as exc:
            status = 500
            log_event("unhandled_error", logging.ERROR, request_id=request_id, path=scope.get("path"),
                      error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            if not started:
                body = error_json("internal", "unexpected server error; quote the request_id when reporting it",
                                  [], request_id)
                await send({"type": "http.response.start", "status": 500, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"x-request-id", request_id.encode()), NO_STORE]})
                await send({"type": "http.response.body", "body": body})
        finally:
            if status == CLIENT_CLOSED or state.get(CLIENT_GONE):
                # The client left before its answer was sent (the protocol marks the request):
                # nothing answered and no server fault. Counted as 499 (nginx's "client closed
                # request"), apart from the 5xx an operator alerts on; or the server closed it
                # on a body that did not arrive in time (answered 408).
                status = 408 if state.get(BODY_TIMED_OUT) else CLIENT_CLOSED
            self.metrics.in_flight.dec()
            elapsed = time.perf_counter() - start
            route = _route_label(scope)
            status_label = str(status)
            self.metrics.requests.labels(route, scope.get("method", ""), status_label).inc()
            self.metrics.latency.labels(route, status_label).observe(elapsed)
            if self.access_log_enabled:
                record: dict[str, Any] = {
                    "ts": time.time(), "pid": self.pid, "request_id": request_id, "method": scope.get("method"),
                    "route": route, "path": scope.get("path"), "status": status,
                    "latency_ms": round(elapsed * 1000.0, 3), "version": state.get("bundle_version"),
                }
                access_log.info(orjson.dumps(record).decode())


def _abandoned(scope: Scope, request_id: str) -> bool:
    """A request cancelled by uvicorn (at shutdown, once SHORTLIST_DRAIN_TIMEOUT_S is over): one
    JSON line, and its connection closed unanswered, instead of uvicorn's traceback for each
    (and its plain-text 500). False outside our HTTP protocol: the cancellation goes on up."""
    connection = scope.get(CONNECTION)
    if connection is None:
        return False
    log_event("request_cancelled", logging.ERROR, request_id=request_id, path=scope.get("path"),
              message="the server stopped before answering (the drain timeout at shutdown)")
    connection.abandon()
    return True


def _request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            candidate = value.decode("latin-1")
            if _REQUEST_ID_RE.match(candidate):
                return candidate
            break
    return uuid.uuid4().hex
