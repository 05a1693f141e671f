"""Prediction routes: /v1/predict (alpha scorer), /v1/predict/tree, and the diagnostic echo and fault routes.

No `from __future__ import annotations` here: the request models are made per app from its
settings, and FastAPI reads a route's body type from its evaluated annotation.
"""

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from service.api.batching import Overloaded
from service.api.bundle_watch import changed_error
from service.api.dependencies import lease_engine, service_state
from service.api.errors import MAX_DETAILS, ApiError, invalid_many, shown
from service.api.http_protocol import CONNECTION
from service.api.leases import Engine
from service.api.request_body import StrictJsonRoute
from service.api.schemas import EchoResponse, ErrorResponse, PredictResponse, RequestModels
from service.api.settings import Settings
from service.engine.file_guard import BundleChanged
from service.engine.labels import LabelTable


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can answer, all with the one error body."""
    return {status: {"model": ErrorResponse} for status in statuses}


# A valid body can still get: 413 (size), 415 (media type), 422 (an unknown exclude uid), 503
# (no bundle yet, or `overloaded`); and 400 for a body that is not JSON.
PREDICT_ERRORS = documented(400, 413, 415, 422, 503)


def json_response(body: dict[str, Any]) -> Response:
    """The routes' answers, serialized directly: `response_model` documents the shape (and the
    fuzzer checks answers against it), but having FastAPI validate and serialize each answer
    through the model cost ~20% of predict's req/s at one connection."""
    return Response(orjson.dumps(body), media_type="application/json")


def label_rows(preds: list[Any]) -> list[dict[str, Any]]:
    """A text's predictions (service.engine.predictor.Prediction) as the response's Label objects."""
    return [{"id": p.id, "uid": p.uid, "title": p.title, "score": p.score} for p in preds]


def named_rows(labels: LabelTable, ids: np.ndarray, scores: np.ndarray) -> list[list[dict[str, Any]]]:
    """Each text's top k (ids int [B, k], -1 where none, and their scores) as the response's
    Label objects: the Predictor's answer (Predictor.predict is _named(predict_ids)) built as the
    response's dicts directly, the batch's labels named in one call (LabelTable.named)."""
    id_rows = ids.tolist()
    named = labels.named([i for row in id_rows for i in row if i >= 0])
    out, j = [], 0
    for row_ids, row_scores in zip(id_rows, scores.tolist(), strict=True):
        row = []
        for i, s in zip(row_ids, row_scores, strict=True):
            if i >= 0:
                label = named[j]
                j += 1
                row.append({"id": i, "uid": label["uid"], "title": label["title"], "score": s})
        out.append(row)
    return out

# How a prediction route answers: (request, scorer "alpha" or "tree", the validated body, the
# scorer's parameters) -> the response. The routes' paths and schemas are defined once
# (predict_router); this service answers from its own engine (answer_here), a sharded one by
# fanning out to its shards (service.api.ray_app).
Answer = Callable[[Request, str, Any, dict[str, Any]], Awaitable[Response]]


def _excluded_ids(uids: list[str] | None, engine: Engine) -> tuple[int, ...]:
    """The request's exclude uids as label ids of the bundle answering it; 422 naming an unknown uid."""
    if not uids:
        return ()
    ids = engine.bundle.labels.ids_of(uids)
    unknown = [i for i, row in enumerate(ids) if row is None]
    if unknown:
        raise unknown_excluded_uids(uids, unknown, engine.version)
    return tuple(sorted(set(ids)))  # type: ignore[arg-type]


def unknown_excluded_uids(uids: list[str], unknown: list[int], version: str) -> ApiError:
    """The 422 for `exclude` uids the answering bundle does not have (positions `unknown`),
    naming as many as any 422 names (errors.MAX_DETAILS)."""
    return invalid_many([(f"body.exclude[{i}]", f"unknown label uid {shown(uids[i])} in bundle {version}")
                         for i in unknown[:MAX_DETAILS]], total=len(unknown))


async def _answer(request: Request, engine: Engine, scorer: str, req: Any, **params: Any) -> Response:
    """Every text's top k from `scorer` of the leased engine; single texts share engine calls
    with concurrent requests of the same parameters (service.api.batching)."""
    excluded = _excluded_ids(req.exclude, engine)
    top = engine.predictor.predict_tree_ids if scorer == "tree" else engine.predictor.predict_ids
    labels, k = engine.bundle.labels, req.k

    def fn(texts: list[str]) -> list[Any]:
        # A file truncated under its map: BundleChanged, not a SIGBUS (~16 us for 11 files, tags-g10).
        engine.bundle.check_maps()
        return named_rows(labels, *top(texts, k=k, exclude=[excluded] * len(texts) if excluded else None, **params))

    runner, state = service_state(request).runner, request.scope.get("state")
    try:
        if req.text is not None:
            key = (engine, scorer, req.k, *params.values(), excluded)
            connection = request.scope.get(CONNECTION)
            alone = connection is not None and len(connection.tasks) == 1
            results = [await runner.submit_one(key, scorer, fn, req.text, alone, state)]
        else:
            results = list(await runner.run_batch(scorer, fn, req.texts, state))
    except Overloaded as exc:
        raise _overloaded(request, exc) from None
    return json_response({"version": engine.version, "results": results})


# Seconds a refused client is asked to wait: the line moves by engine calls (milliseconds to
# a fraction of a second each), and a load balancer may send the retry elsewhere at once.
OVERLOADED_RETRY_AFTER_S = 1


def _overloaded(request: Request, exc: Overloaded) -> ApiError:
    """The 503 for a prediction the engine's line refused (service.api.batching), counted by reason."""
    service_state(request).metrics.shed.labels(exc.reason).inc()
    return ApiError(503, "overloaded", f"{exc.message}; retry later",
                    headers={"Retry-After": str(OVERLOADED_RETRY_AFTER_S)})


async def answer_here(request: Request, scorer: str, req: Any, params: dict[str, Any]) -> Response:
    """The answer of this process's engine, leased for the request."""
    with lease_engine(request) as engine:
        if scorer == "tree" and not engine.bundle.has_tree:
            raise ApiError(409, "no_tree_scorer", f"the active bundle {engine.version} has no tree scorer; "
                           "use /v1/predict")
        if scorer == "tree" and not engine.predictor.tree_serves:
            # Rows that can never hold a label, whatever the text, would look like answers.
            raise ApiError(409, "no_tree_scorer", f"every label the tree of the active bundle {engine.version} "
                           "holds is retired (labels added since training join it at the next training); "
                           "use /v1/predict")
        try:
            return await _answer(request, engine, scorer, req, **params)
        except BundleChanged as exc:
            watch = service_state(request).watch
            if watch is not None:
                watch.mark(engine, exc)
            raise changed_error(engine.version, exc) from None


def predict_router(models: RequestModels, settings: Settings, answer: Answer = answer_here) -> APIRouter:
    router = APIRouter(route_class=StrictJsonRoute)
    PredictRequest, TreePredictRequest = models.predict, models.tree_predict  # noqa: N806

    @router.post("/v1/predict", response_model=PredictResponse, responses=PREDICT_ERRORS,
                 summary="top-k labels per text: alpha * f(classifier) + (1 - alpha) * g(centroid) + lexical")
    async def predict(req: PredictRequest, request: Request) -> Response:
        return await answer(request, "alpha", req, {"alpha": req.alpha})

    @router.post("/v1/predict/tree", response_model=PredictResponse, responses={**PREDICT_ERRORS, **documented(409)},
                 summary="top-k labels per text from the bias-corrected tree scorer (409: the bundle has no tree, "
                 "or every label it holds is retired)",
                 description="Serves the labels the tree was trained on: labels added since (POST /admin/labels) "
                 "join it at the next training (GET /admin/bundles: lineage.tree_labels); retired labels never, "
                 "and they take no place in the beam.")
    async def predict_tree(req: TreePredictRequest, request: Request) -> Response:
        return await answer(request, "tree", req, {"beam": req.beam})

    if settings.echo_route:
        EchoRequest = models.echo  # noqa: N806

        @router.post("/v1/echo", response_model=EchoResponse, responses=documented(400, 413, 415, 422))
        async def echo(req: EchoRequest) -> Response:
            return json_response({"text": req.text})

    if settings.fault_route:
        @router.post("/v1/fault", responses=documented(500))
        async def fault() -> None:
            raise RuntimeError("deliberate failure (fault_route is enabled)")

    return router
