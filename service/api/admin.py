"""Admin routes (bearer token): list bundles, activate one, roll back. Loads run on the
registry's loader threads, off the event loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends

from service.api.dependencies import State, require_admin
from service.api.errors import ApiError
from service.api.observability import error_log
from service.api.predict import documented
from service.api.processes import ProcessesDiverged
from service.api.registry import ActivationFailed, ActivationInProgress, BundleNotFound
from service.api.schemas import ActivateRequest, ActivationResult, BundleInfo, BundleList

# 401 / 403: no or a wrong token; 404: no such bundle (or nothing to roll back to); 409: another
# activation is running; 422: the bundle was refused (the serving one keeps serving).
# 429: too many wrong admin tokens from this address (dependencies.AuthFailures). 503: with
# several processes, one could not serve the version the others now serve (service.api.processes).
ACTIVATION_ERRORS = documented(401, 403, 404, 409, 422, 429, 503)


async def _activate(state: State, fn: Callable[..., dict[str, Any]], *args: Any) -> ActivationResult:
    registry, metrics = state.registry, state.metrics
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
    except ProcessesDiverged as exc:
        metrics.failed_activations.labels("diverged").inc()
        error_log.error(json.dumps({"event": "processes_diverged", "message": str(exc)}))
        raise ApiError(503, "processes_diverged", str(exc)) from None
    metrics.activation_seconds.observe(result["seconds"])
    return ActivationResult(**result)


def admin_router() -> APIRouter:
    router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], tags=["admin"])

    @router.get("/bundles", response_model=BundleList, responses=documented(401, 403, 429))
    async def bundles(state: State) -> BundleList:
        rows = await asyncio.wrap_future(state.registry.in_loader(state.registry.list))
        return BundleList(active=state.registry.active_version, bundles=[
            BundleInfo(version=m.version, created_at=m.created_at, active=active, has_tree=m.has_tree,
                       metrics=m.metrics)
            for m, active in rows
        ])

    @router.post("/bundles/activate", response_model=ActivationResult,
                 responses={**ACTIVATION_ERRORS, **documented(400, 413, 415)},
                 summary="load, check and swap in a bundle; requests in flight finish on the old one")
    async def activate(req: ActivateRequest, state: State) -> ActivationResult:
        return await _activate(state, state.registry.activate, req.version)

    @router.post("/bundles/rollback", response_model=ActivationResult, responses=ACTIVATION_ERRORS,
                 summary="swap back to the previously active bundle")
    async def rollback(state: State) -> ActivationResult:
        return await _activate(state, state.registry.rollback)

    return router
