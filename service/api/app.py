"""The FastAPI application factory: prediction routes, health, metrics and (optionally) admin."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.active_state import ActiveVersionFile, StateUnavailable
from service.api.admin import admin_router
from service.api.batching import EngineRunner
from service.api.bundle_watch import BundleWatch
from service.api.cors import add_cors
from service.api.dependencies import MinuteBudget, ServiceState, State
from service.api.errors import install_error_handlers
from service.api.events import log_event
from service.api.observability import ObservabilityMiddleware, ServiceMetrics, setup_logging
from service.api.predict import Answer, answer_here, predict_router
from service.api.processes import ProcessGroup
from service.api.registry import ActivationFailed, ActivationInProgress, BundleNotFound, BundleRegistry
from service.api.request_body import RequestBodyMiddleware
from service.api.schemas import Health, RequestModels
from service.api.settings import Settings, load_settings
from service.api.state_check import StateDirCheck
from service.engine import heap
from service.engine.bundle import Bundle
from service.engine.store import BundleStore

log = logging.getLogger("shortlist.api")
VERSION = "0.1.0"


def build_state(settings: Settings, preloaded: Bundle | None = None) -> ServiceState:
    """The service's state; `preloaded`: a bundle opened and checked before this process was
    forked (service.api.supervisor), which the first load of its version serves."""
    metrics = ServiceMetrics()
    group: ProcessGroup | None = None

    def on_swap(_old: str | None, new: str) -> None:
        metrics.swaps.inc()
        metrics.set_active(new)
        if group is not None:
            # Before the activation lock is let go: a process another one's activation then
            # waits for is seen serving what it loaded, never still starting (ProcessGroup.wait_for).
            group.publish_swap()

    store = BundleStore(settings.bundle_root, settings.state_dir, settings.max_manifest_bytes)
    store.sweep_staging()  # what writes killed half-way left (a restart after a crash)
    registry = BundleRegistry(
        store,
        engine_threads=settings.engine_threads,
        quality_gate_min_p1=settings.quality_gate_min_p1, drain_timeout_s=settings.drain_timeout_s,
        on_swap=on_swap, loader_nice=settings.loader_nice, remembered=_remembered(settings),
        check_timeout_s=settings.load_check_timeout_s if settings.load_check_in_child else None,
        max_pending_changes=settings.max_pending_label_changes, preloaded=preloaded,
        keep_derived_versions=settings.keep_derived_versions, activation_lock_wait_s=settings.activation_lock_wait_s,
    )
    runner = EngineRunner(
        settings.workers, batching=settings.batching, max_batch=settings.batch_max_size,
        max_wait_s=settings.batch_max_wait_ms / 1000.0,
        on_batch=metrics.observe_batch, max_queued_texts=settings.max_queued_texts,
        max_queue_wait_s=settings.max_queue_wait_ms / 1000.0,
    )
    if settings.processes > 1 and settings.state_dir is not None:
        group = ProcessGroup(settings.state_dir, registry, settings.process_sync_interval_s,
                             converge_timeout_s=settings.process_converge_timeout_s)
        metrics.served_by = group.served_by
    state_check = StateDirCheck(settings.state_dir) if settings.state_dir is not None else None
    if state_check is not None:
        metrics.watch_state_dir(state_check.problem)
    return ServiceState(settings, registry, runner, metrics, RequestModels(settings),
                        MinuteBudget(settings.admin_auth_failures_per_minute),
                        MinuteBudget(settings.label_changes_per_minute), group,
                        BundleWatch(registry, metrics, settings.bundle_check_interval_s), state_check=state_check)


def _remembered(settings: Settings) -> ActiveVersionFile | None:
    if settings.state_dir is None:
        log.warning("SHORTLIST_STATE_DIR is not set: the active version is not remembered across restarts")
        return None
    remembered = ActiveVersionFile(settings.state_dir)
    remembered.prepare()  # an unwritable state directory stops start-up, naming it
    return remembered


# Why a service with a bundle serving cannot answer now (None: it can); e.g. a shard of the
# sharded service with no live replica (service.api.ray_app).
Readiness = Callable[[ServiceState], Awaitable[str | None]]


def _probes(readiness: Readiness | None = None) -> APIRouter:
    router = APIRouter()

    # GET only: HeadAsGetMiddleware answers HEAD on every GET route (load balancers probe with it).
    # A route listing both had one operationId for two operations in /openapi.json, which client
    # generators refuse (OpenAPI requires them unique).
    @router.get("/healthz", response_model=Health,
                      summary="liveness: 200 while the process serves; `reason`: a problem it serves despite")
    async def healthz(state: State) -> Health:
        return liveness(state)

    @router.get("/readyz", response_model=Health, responses={503: {"model": Health}},
                      summary="readiness: 200 once a validated bundle serves, 503 before")
    async def readyz(state: State) -> Response:
        engine = state.registry.active
        if engine is None:
            reason = state.startup_error or "no bundle loaded yet"
            return _not_ready(state, None, reason, {state.group.pid: reason} if state.group is not None else {})
        if engine.changed is not None:
            return JSONResponse({"status": "bundle changed", "version": engine.version,
                                 "message": str(engine.changed)}, status_code=503)
        reason = await readiness(state) if readiness is not None else None
        if reason is not None:
            return JSONResponse({"status": "not ready", "version": engine.version, "reason": reason}, status_code=503)
        if state.group is not None:
            # Every process's readiness, not only this one's: a probe's connection lands on any of them.
            others = await asyncio.to_thread(state.group.not_ready)
            if others:
                why = "; ".join(f"process {pid} {why}" for pid, why in sorted(others.items()))
                return _not_ready(state, engine.version, f"{len(others)} of the serving processes not ready: {why}",
                                  others)
        return JSONResponse({"status": "ready", "version": engine.version})

    @router.get("/metrics", response_class=Response, summary="Prometheus text format",
                      responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def metrics(state: State) -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return router


def _not_ready(state: ServiceState, version: str | None, reason: str, processes: dict[int, str]) -> Response:
    """/readyz's 503; with several processes, `processes` names each one not ready (pid -> why)."""
    body: dict[str, object] = {"status": "not ready", "version": version, "reason": reason}
    if state.group is not None:
        body["processes"] = {str(pid): why for pid, why in processes.items()}
    return JSONResponse(body, status_code=503)


def liveness(state: ServiceState) -> Health:
    """/healthz: alive, and the problem it serves despite (the state directory gone or read-only)."""
    problem = state.state_check.problem() if state.state_check is not None else None
    return Health(status="ok", version=state.registry.active_version, reason=problem)


class HeadAsGetMiddleware:
    """HEAD answered on every GET route, as GET without its body (RFC 9110 9.3.2: a server
    answering GET should answer HEAD); FastAPI's routes take only the methods they list, so
    HEAD /docs or /admin/bundles was a 405. Inside the observability middleware: the access log
    and metrics name HEAD."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        # A copy: uvicorn reads the method from its own scope to send no body for HEAD.
        as_get = {**scope, "method": "GET"}
        try:
            await self.app(as_get, receive, without_body)
        finally:
            if "route" in as_get:  # the route the metrics name
                scope["route"] = as_get["route"]


def _new_app(state: ServiceState, title: str, lifespan: object = None) -> FastAPI:
    settings = state.settings
    # FastAPIOffline: /docs (Swagger UI) and /redoc from assets packaged with the service instead
    # of a CDN, so the interactive docs work where the host has no internet (air-gapped clusters).
    app = FastAPIOffline(title=title, version=VERSION, lifespan=lifespan,  # type: ignore[arg-type]
                         description="Extreme multi-label label shortlisting: top-k labels for short texts.")
    # No redirect of "/v1/predict/" to "/v1/predict": Starlette builds its Location from the
    # client's Host header (a redirect anywhere the client names), and a POST sent there again
    # carries its body along. A path with a trailing slash is a 404 like any unknown path.
    app.router.redirect_slashes = False
    app.state.service = state
    install_error_handlers(app)
    app.add_middleware(HeadAsGetMiddleware)
    app.add_middleware(RequestBodyMiddleware, max_bytes=settings.max_body_bytes)
    # Outside the body limits, so a page can read their 413 / 415 answers too.
    add_cors(app, settings.cors_origins)
    # Added last, so outermost: request ids, metrics and the access log cover every response.
    app.add_middleware(ObservabilityMiddleware, metrics=state.metrics, access_log_enabled=settings.access_log)
    return app


def create_app(settings: Settings | None = None, *, state: ServiceState | None = None,
               admin: bool | None = None, answer: Answer = answer_here,
               preloaded: Bundle | None = None, readiness: Readiness | None = None) -> FastAPI:
    """The service app. With `state` given (a shared registry), the caller owns loading and
    shutdown; otherwise the app loads the configured bundle at startup without blocking
    /healthz, and /readyz turns 200 once it is validated and serving.

    `admin` None: admin routes are mounted here when a token is set and no admin port is.
    `answer`: how the prediction routes answer (a sharded service fans out, service.api.ray_app).
    `preloaded`: see build_state.
    `readiness`: what /readyz checks besides a bundle serving.
    """
    settings = settings or load_settings()
    owns_state = state is None
    # First: building the state may log an event (active_state's start-up lines). Whatever
    # ACCESS_LOG says: it turns off the access lines only (ObservabilityMiddleware, the HTTP
    # protocol's refusals); with it off, the INFO events (bundle_activated, ...) were lost.
    setup_logging(settings.log_level)
    state = state or build_state(settings, preloaded)
    if admin is None:
        admin = settings.admin_token is not None and settings.admin_port is None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        apply_runtime_tuning(settings)
        joining = _join(state) if owns_state else False
        task = asyncio.create_task(initial_load(state, joining)) if owns_state else None
        if task is not None and joining:
            await _hold_until_loaded(state, task, getattr(_app.state, "heartbeat", None))
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            if owns_state:
                await shutdown(state)

    app = _new_app(state, "Shortlist", lifespan)
    # The prediction routes first: routes are matched in order, and they take the traffic.
    app.include_router(predict_router(state.models, settings, answer))
    app.include_router(_probes(readiness))
    if admin and settings.admin_token is not None:
        app.include_router(admin_router(state.models))
    return app


def create_admin_app(state: ServiceState) -> FastAPI:
    """Admin routes (and liveness) only, for a separate port; shares the serving app's registry."""
    app = _new_app(state, "Shortlist admin")
    app.include_router(admin_router(state.models))

    @app.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        return liveness(state)

    return app


def apply_runtime_tuning(settings: Settings) -> None:
    """Process-wide settings the service runs with, whatever ASGI server started the app."""
    if settings.heap_tuning:
        heap.tune_for_loads()
    heap.use_huge_pages(settings.huge_pages)
    # Everything imported so far lives for the whole process: moving it out of the cyclic
    # collector's generations makes the periodic full collections (which hold the GIL and
    # so stall every request) short. Reference counting still frees objects as usual.
    gc.collect()
    gc.freeze()


async def initial_load(state: ServiceState, joining: bool = False) -> None:
    """The first load. `joining`: live processes serve already (see _join)."""
    try:
        # A process joining live ones (one the arbiter restarted) serves what they serve or nothing:
        # a fallback of its own would be recorded, and every process would follow it.
        result = await asyncio.wrap_future(state.registry.in_loader(
            functools.partial(state.registry.start, state.settings.version, fall_back=not joining)))
        if note_start(state, result) and state.group is not None:
            state.group.cannot_serve(str(result["fallback_from"]), str(result["reason"]))
    except (ActivationFailed, BundleNotFound, ActivationInProgress, StateUnavailable) as exc:
        note_start_failed(state, exc)
        recorded = state.registry.remembered.read() if state.registry.remembered is not None else None
        if state.group is not None and recorded is not None and isinstance(exc, ActivationFailed):
            # Not followed unchecked next: the checking child may be what refused it.
            state.group.cannot_serve(recorded, str(exc))
    except Exception as exc:
        # Anything else would end this task unseen, leaving /readyz at 503 with nothing in the log.
        state.startup_error = f"start-up failed: {type(exc).__name__}: {exc}"
        state.metrics.failed_activations.labels("startup").inc()
        log_event("startup_load_failed", logging.ERROR, message=f"{type(exc).__name__}: {exc}",
                  bundle_root=str(state.settings.bundle_root),
                  traceback=traceback.format_exc())
    if state.group is not None:
        state.group.not_serving = state.startup_error
        state.group.accepting = True  # it takes connections from here on (see _hold_until_loaded)
        # Only now: following another process's activation before the first load would race it.
        state.group.start()
    if state.watch is not None:
        state.watch.start()


def note_start(state: ServiceState, result: dict[str, object]) -> bool:
    """Whether start-up fell back from the version it wanted (counted and said: startup_fallback)."""
    if "fallback_from" not in result:
        return False
    state.metrics.startup_fallback.labels(wanted=result["fallback_from"]).set(1)
    log_event("startup_fallback", logging.ERROR, wanted=result["fallback_from"], serving=result["active"],
              reason=result["reason"])
    return True


def note_start_failed(state: ServiceState, exc: Exception) -> None:
    """Start-up serves nothing: why, for /readyz until a bundle serves, the metric and the event."""
    state.startup_error = f"start-up could not serve a bundle: {exc}"
    state.metrics.failed_activations.labels("startup").inc()
    log_event("startup_load_failed", logging.ERROR, message=str(exc), bundle_root=str(state.settings.bundle_root))


def _join(state: ServiceState) -> bool:
    """Whether this process joins live processes that serve (one the arbiter restarted), after
    publishing itself as starting (taking no connections if it joins). A state directory that
    refuses the record is logged, not fatal: the load goes on."""
    if state.group is None:
        return False
    joining = state.group.others_serving()
    state.group.accepting = not joining
    _announce(state.group)
    return joining


async def _hold_until_loaded(state: ServiceState, load: asyncio.Task[None], heartbeat: Callable[[], None] | None,
                             ) -> None:
    """A process joining live ones takes no connection until its first load ends (serving, or
    not and saying why), at most PROCESS_CONVERGE_TIMEOUT_S: its listening socket is the others'
    too, so until it accepts the kernel hands every connection to a process that serves, and a
    worker restart costs no client a 503 not_ready. The start-up of the first processes is not
    held: /healthz answers while they load, and /readyz is 503 on each until all serve.
    `heartbeat`: the arbiter's liveness report (service.api.supervisor), which uvicorn's loop
    makes only once it serves: without it, a load longer than PROCESS_STALL_TIMEOUT_S is killed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.settings.process_converge_timeout_s
    while not load.done() and loop.time() < deadline:
        await asyncio.wait({load}, timeout=min(1.0, max(0.01, deadline - loop.time())))
        if heartbeat is not None:
            heartbeat()
    if not load.done() and state.group is not None:
        log_event("startup_hold_timeout", logging.ERROR, message=(
            f"process {state.group.pid} still loads after {state.settings.process_converge_timeout_s:g} s "
            "(SHORTLIST_PROCESS_CONVERGE_TIMEOUT_S): it takes connections, answering 503 not_ready until it serves"))
        state.group.accepting = True
        _announce(state.group)


def _announce(group: ProcessGroup) -> None:
    try:
        group.announce()
    except StateUnavailable as exc:
        log_event("state_unavailable", logging.ERROR, message=str(exc))


async def shutdown(state: ServiceState) -> None:
    if state.watch is not None:
        state.watch.stop()
    if state.group is not None:
        await asyncio.to_thread(state.group.stop)
    state.runner.shutdown()
    await asyncio.to_thread(state.registry.close)
