"""The FastAPI application: prediction routes, health, metrics and (optionally) admin."""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service.api.batching import EngineRunner
from service.api.errors import ApiError, error_response, parse_body
from service.api.observability import ObservabilityMiddleware, ServiceMetrics, error_log, setup_logging
from service.api.registry import (
    ActivationFailed,
    ActivationInProgress,
    BundleNotFound,
    BundleRegistry,
    Engine,
    NoBundle,
)
from service.api.schemas import (
    ActivateRequest,
    ActivationResult,
    BundleInfo,
    BundleList,
    EchoRequest,
    EchoResponse,
    ErrorResponse,
    Health,
    Limits,
    PredictRequest,
    PredictResponse,
)
from service.api.settings import Settings

log = logging.getLogger("shortlist.api")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 409, 413, 415, 422, 500, 503)
}


def _body_schema(model: type) -> dict[str, Any]:
    # Bodies are parsed by parse_body (for field-named errors on every kind of bad input), so
    # the schema is attached to the OpenAPI document by hand from the same pydantic model.
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": model.model_json_schema()}}}}


@dataclass
class ServiceState:
    settings: Settings
    registry: BundleRegistry
    runner: EngineRunner
    metrics: ServiceMetrics
    limits: Limits


def build_state(settings: Settings) -> ServiceState:
    metrics = ServiceMetrics()

    def on_swap(_old: str | None, new: str) -> None:
        metrics.swaps.inc()
        metrics.set_active(new)

    registry = BundleRegistry(
        settings.bundle_root, engine_threads=settings.engine_threads,
        quality_gate_min_p1=settings.quality_gate_min_p1, drain_timeout_s=settings.drain_timeout_s,
        on_swap=on_swap, loader_nice=settings.loader_nice,
    )
    runner = EngineRunner(
        settings.workers, batching=settings.batching, max_batch=settings.batch_max_size,
        max_wait_s=settings.batch_max_wait_ms / 1000.0,
        on_batch=lambda scorer, n: metrics.batch_size.labels(scorer).observe(n),
    )
    limits = Limits(max_text_chars=settings.max_text_chars, max_k=settings.max_k,
                    max_batch=settings.max_batch, max_beam=settings.max_beam, max_exclude=settings.max_exclude)
    return ServiceState(settings, registry, runner, metrics, limits)


def _install_common(app: FastAPI, state: ServiceState) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(request, exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(request, ApiError(exc.status_code, code, f"{request.method} {request.url.path}: "
                                                f"{exc.detail}", headers=getattr(exc, "headers", None)))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(ObservabilityMiddleware, metrics=state.metrics,
                       access_log_enabled=state.settings.access_log)


def _labels(preds: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"id": int(p.id), "uid": p.uid, "title": p.title, "score": float(p.score)} for p in preds]


def _excluded_ids(uids: list[str] | None, engine: Engine) -> tuple[int, ...]:
    """The request's exclude uids as label ids of the bundle answering it; 422 naming any unknown uid."""
    if not uids:
        return ()
    ids = engine.bundle.labels.ids_of(uids)
    unknown = [{"field": f"body.exclude[{i}]", "message": f"unknown label uid {uid!r} in bundle {engine.version}"}
               for i, (uid, row) in enumerate(zip(uids, ids, strict=True)) if row is None]
    if unknown:
        raise ApiError(422, "invalid_request", f"{unknown[0]['field']}: {unknown[0]['message']}", unknown)
    return tuple(sorted(set(ids)))


def _predict_router(state: ServiceState) -> APIRouter:
    router = APIRouter()
    settings, registry, runner = state.settings, state.registry, state.runner
    ctx = {"limits": state.limits}

    async def _answer(req: PredictRequest, scorer: str, engine: Engine) -> dict[str, Any]:
        excluded = _excluded_ids(req.exclude, engine)
        if scorer == "tree":
            if not engine.bundle.has_tree:
                raise ApiError(409, "no_tree_scorer",
                               f"the active bundle {engine.version} has no tree scorer; use /v1/predict")
            predict = partial(engine.predictor.predict_tree, k=req.k, beam=req.beam)
            key = (engine, scorer, req.k, req.beam, excluded)
        else:
            predict = partial(engine.predictor.predict, k=req.k, alpha=req.alpha)
            key = (engine, scorer, req.k, req.alpha, excluded)
        fn = predict
        if excluded:
            def fn(texts: list[str]) -> list[Any]:
                return predict(texts, exclude=[excluded] * len(texts))
        if req.text is not None:
            results = [await runner.submit_one(key, scorer, fn, req.text)]
        else:
            results = list(await runner.run_batch(scorer, fn, req.all_texts))
        return {"version": engine.version, "results": [_labels(r) for r in results]}

    async def _serve(request: Request, scorer: str) -> Response:
        req = await parse_body(request, PredictRequest, settings.max_body_bytes, ctx)
        if scorer == "tree" and req.alpha is not None:
            raise ApiError(422, "invalid_request", "body.alpha: not used by the tree scorer",
                           [{"field": "body.alpha", "message": "not used by the tree scorer"}])
        if scorer == "alpha" and req.beam is not None:
            raise ApiError(422, "invalid_request", "body.beam: only the tree scorer (/v1/predict/tree) "
                           "takes a beam", [{"field": "body.beam", "message": "only /v1/predict/tree takes a beam"}])
        try:
            with registry.lease() as engine:  # the bundle this request is answered by, start to end
                request.state.bundle_version = engine.version
                body = await _answer(req, scorer, engine)
        except NoBundle:
            raise ApiError(503, "not_ready", "no validated bundle is loaded yet") from None
        return Response(orjson.dumps(body), media_type="application/json")

    @router.post("/v1/predict", response_model=PredictResponse, responses=_ERRORS,
                 openapi_extra=_body_schema(PredictRequest),
                 summary="top-k labels per text: alpha * f(classifier) + (1 - alpha) * g(centroid)")
    async def predict(request: Request) -> Response:
        return await _serve(request, "alpha")

    @router.post("/v1/predict/tree", response_model=PredictResponse, responses=_ERRORS,
                 openapi_extra=_body_schema(PredictRequest),
                 summary="top-k labels per text from the bias-corrected tree scorer")
    async def predict_tree(request: Request) -> Response:
        return await _serve(request, "tree")

    @router.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        return Health(status="ok", version=registry.active_version)

    @router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
    async def readyz() -> Response:
        version = registry.active_version
        if version is None:
            return JSONResponse({"status": "not ready", "version": None}, status_code=503)
        return JSONResponse({"status": "ready", "version": version})

    @router.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if settings.echo_route:
        @router.post("/v1/echo", response_model=EchoResponse, openapi_extra=_body_schema(EchoRequest))
        async def echo(request: Request) -> Response:
            req = await parse_body(request, EchoRequest, settings.max_body_bytes)
            return Response(orjson.dumps({"text": req.text}), media_type="application/json")

    if settings.fault_route:
        @router.post("/v1/fault")
        async def fault() -> None:
            raise RuntimeError("deliberate failure (fault_route is enabled)")

    return router


def _admin_router(state: ServiceState) -> APIRouter:
    settings, registry, metrics = state.settings, state.registry, state.metrics
    assert settings.admin_token is not None
    expected = settings.admin_token.get_secret_value().encode()
    router = APIRouter(prefix="/admin")

    def authorize(request: Request) -> None:
        header = request.headers.get("authorization")
        challenge = {"WWW-Authenticate": "Bearer"}
        if not header:
            raise ApiError(401, "unauthorized", "admin routes need an Authorization: Bearer token", headers=challenge)
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "unauthorized", "the Authorization header must be 'Bearer <token>'", headers=challenge)
        if not hmac.compare_digest(token.strip().encode(), expected):
            raise ApiError(403, "forbidden", "wrong admin token")

    async def _activate(fn: Any, *args: Any) -> Response:
        try:
            result = await asyncio.wrap_future(registry.in_loader(fn, *args))
        except ActivationInProgress as exc:
            metrics.failed_activations.labels("busy").inc()
            raise ApiError(409, "activation_in_progress", str(exc)) from None
        except BundleNotFound as exc:
            metrics.failed_activations.labels("not_found").inc()
            raise ApiError(404, "bundle_not_found", str(exc)) from None
        except ActivationFailed as exc:
            metrics.failed_activations.labels("invalid").inc()
            error_log.error(json.dumps({"event": "activation_failed", "message": str(exc)}))
            raise ApiError(422, "bundle_rejected", str(exc)) from None
        metrics.activation_seconds.observe(result["seconds"])
        return JSONResponse(ActivationResult(**result).model_dump())

    @router.get("/bundles", response_model=BundleList, responses=_ERRORS)
    async def bundles(request: Request) -> BundleList:
        authorize(request)
        rows = await asyncio.wrap_future(registry.in_loader(registry.list))
        return BundleList(active=registry.active_version, bundles=[
            BundleInfo(version=m.version, created_at=m.created_at, active=active,
                       has_tree="tree.npz" in m.files, metrics=m.metrics)
            for m, active in rows
        ])

    @router.post("/bundles/activate", response_model=ActivationResult, responses={**_ERRORS, 404: {}},
                 openapi_extra=_body_schema(ActivateRequest))
    async def activate(request: Request) -> Response:
        authorize(request)
        req = await parse_body(request, ActivateRequest, settings.max_body_bytes)
        return await _activate(registry.activate, req.version)

    @router.post("/bundles/rollback", response_model=ActivationResult, responses={**_ERRORS, 404: {}})
    async def rollback(request: Request) -> Response:
        authorize(request)
        return await _activate(registry.rollback)

    return router


def create_app(settings: Settings | None = None, *, state: ServiceState | None = None,
               admin: bool | None = None) -> FastAPI:
    """The service app. With `state` given (a shared registry), the caller owns loading and
    shutdown; otherwise the app loads the configured bundle at startup without blocking
    /healthz, and /readyz turns 200 once it is validated and serving.

    `admin` None: admin routes are mounted here when a token is set and no admin port is.
    """
    settings = settings or Settings()
    owns_state = state is None
    state = state or build_state(settings)
    if settings.access_log:
        setup_logging(settings.log_level)
    if admin is None:
        admin = settings.admin_token is not None and settings.admin_port is None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        freeze_startup_objects()
        task = asyncio.create_task(initial_load(state)) if owns_state else None
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            if owns_state:
                await shutdown(state)

    app = FastAPI(title="Shortlist", version="0.1.0", lifespan=lifespan,
                  description="Extreme multi-label label shortlisting: top-k labels for short texts.")
    app.state.service = state
    _install_common(app, state)
    app.include_router(_predict_router(state))
    if admin and settings.admin_token is not None:
        app.include_router(_admin_router(state))
    return app


def create_admin_app(state: ServiceState) -> FastAPI:
    """Admin routes only, for a separate port; shares the serving app's registry."""
    app = FastAPI(title="Shortlist admin", version="0.1.0")
    app.state.service = state
    _install_common(app, state)
    app.include_router(_admin_router(state))

    @app.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        return Health(status="ok", version=state.registry.active_version)

    return app


def freeze_startup_objects() -> None:
    # Everything imported so far lives for the whole process: moving it out of the cyclic
    # collector's generations makes the periodic full collections (which hold the GIL and
    # so stall every request) short. Reference counting still frees objects as usual.
    gc.collect()
    gc.freeze()


async def initial_load(state: ServiceState) -> None:
    try:
        await asyncio.wrap_future(state.registry.in_loader(state.registry.activate, state.settings.version))
    except (ActivationFailed, BundleNotFound, ActivationInProgress) as exc:
        state.metrics.failed_activations.labels("startup").inc()
        error_log.error(json.dumps({"event": "startup_load_failed", "message": str(exc),
                                    "bundle_root": str(state.settings.bundle_root)}))


async def shutdown(state: ServiceState) -> None:
    state.runner.shutdown()
    await asyncio.to_thread(state.registry.close)
