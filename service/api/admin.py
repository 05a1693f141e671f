"""Admin routes (bearer token): list bundles, activate one, roll back, add and retire labels.
Loads run on the registry's loader threads and label changes on its change thread, off the
event loop.

No `from __future__ import annotations` here: the label request models are made per app from
its settings, and FastAPI reads a route's body type from its evaluated annotation.
"""

import asyncio
import dataclasses
import logging
import re
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Query, Security
from fastapi.security import HTTPBearer
from pydantic import BeforeValidator

from service.api.activation import (
    ActivationFailed,
    ActivationInProgress,
    ActivationLockBusy,
    ActiveVersionChanged,
    BundleNotFound,
)
from service.api.active_state import StateUnavailable
from service.api.bundle_watch import changed_error
from service.api.dependencies import AdminRoute, State
from service.api.errors import ApiError, shown
from service.api.events import log_event
from service.api.leases import NoBundle
from service.api.predict import documented
from service.api.processes import ProcessesDiverged
from service.api.registry import LabelChangesUnavailable, TooManyPendingChanges
from service.api.schemas import (
    EXPECTED_ACTIVE_HELP,
    ActivateRequest,
    ActivationResult,
    BundleInfo,
    BundleLineage,
    BundleList,
    ErrorDetail,
    LabelChangeResult,
    LabelInfo,
    RequestModels,
    RollbackRequest,
)
from service.engine.file_guard import BundleChanged
from service.engine.label_changes import LabelChange, LabelChangeRejected, NewLabel
from service.engine.schema import VERSION_RE, BundleError

# 401 / 403: no or a wrong token; 404: no such bundle (or nothing to roll back to); 409: another
# activation or rollback is running (on any process), or a rollback's expected_active is not the
# active version; 422: the bundle was refused (the serving one
# keeps serving). 429: too many wrong admin tokens from this address (dependencies.MinuteBudget).
# 503: `activation_lock_busy` with Retry-After: a label change held the lock past
# activation_lock_wait_s; with several processes, one could not serve the version the others now
# serve (service.api.processes); or `state_unavailable`: the state directory cannot be written
# (507 when out of space).
ACTIVATION_ERRORS = documented(401, 403, 404, 409, 422, 429, 503, 507)
# 409: no state directory to write to, or `expected_active` is not the active version; 422: a
# label or uid that does not fit (named), or the new bundle refused; 429: past
# label_changes_per_minute or max_pending_label_changes; 503: nothing serves, or with several
# processes one could not serve the new version, or the state directory cannot be written (507
# when out of space), or `activation_lock_busy` (Retry-After) when the lock stayed held for twice
# load_check_timeout_s.
LABEL_ERRORS = documented(400, 401, 403, 409, 413, 415, 422, 429, 503, 507)
_ENGINE_FIELD = re.compile(r"^(add|retire)(\[\d+\])?(\.\w+)?$")


async def _activate(state: State, fn: Callable[..., dict[str, Any]], *args: Any) -> ActivationResult:
    registry, metrics = state.registry, state.metrics
    try:
        result = await asyncio.wrap_future(registry.in_loader(fn, *args))
    except ActivationLockBusy as exc:
        raise _lock_busy(state, exc) from None
    except ActivationInProgress as exc:
        metrics.failed_activations.labels("busy").inc()
        raise ApiError(409, "activation_in_progress", str(exc)) from None
    except ActiveVersionChanged as exc:
        metrics.failed_activations.labels("changed").inc()
        raise ApiError(409, "active_version_changed", str(exc)) from None
    except BundleNotFound as exc:
        metrics.failed_activations.labels("not_found").inc()
        raise ApiError(404, "bundle_not_found", str(exc)) from None
    except ActivationFailed as exc:
        metrics.failed_activations.labels("invalid").inc()
        log_event("activation_failed", logging.ERROR, message=str(exc))
        raise ApiError(422, "bundle_rejected", str(exc)) from None
    except ProcessesDiverged as exc:
        metrics.failed_activations.labels("diverged").inc()
        log_event("processes_diverged", logging.ERROR, message=str(exc))
        raise ApiError(503, "processes_diverged", str(exc)) from None
    except StateUnavailable as exc:
        raise _state_unavailable(state, exc) from None
    metrics.activation_seconds.observe(result["seconds"])
    return ActivationResult(**result)


def _state_unavailable(state: State, exc: StateUnavailable) -> ApiError:
    """The answer to a write the state directory refused: the server's storage, not the request,
    is at fault (507 Insufficient Storage when out of space); what serves keeps serving."""
    state.metrics.failed_activations.labels("state").inc()
    log_event("state_unavailable", logging.ERROR, message=str(exc))
    return ApiError(507 if exc.no_space else 503, "state_unavailable", str(exc))


def _lock_busy(state: State, exc: ActivationLockBusy) -> ApiError:
    """The answer to an admin write that waited for the activation lock as long as it may: the
    section holding it is named, and a retry once it is done goes through."""
    state.metrics.failed_activations.labels("busy").inc()
    log_event("activation_lock_busy", logging.ERROR, message=str(exc))
    return ApiError(503, "activation_lock_busy", str(exc), headers={"Retry-After": str(exc.retry_after_s)})


def _digits(value: object) -> object:
    """A whole-number query parameter as its digits: "0.0", "1e1" or "+2" were taken as numbers
    (pydantic's lax parsing), and a list of one number could not be told from the number."""
    if isinstance(value, str) and not re.fullmatch(r"-?[0-9]+", value):
        raise ValueError("expected a whole number written in digits")
    return value


def _changed(state: State, exc: BundleChanged) -> ApiError:
    """The 503 for a serving version's file found written in place; the watch marks it at once."""
    if state.watch is not None:
        state.watch.check()
    return changed_error(state.registry.active_version or "(none)", exc)


def _request_field(engine_field: str, single_uid: bool) -> str:
    """An engine problem's field ("add[3].uid", "retire[0]") as the request names it."""
    if single_uid and engine_field.startswith("retire"):
        return "path.uid"
    m = _ENGINE_FIELD.match(engine_field)
    if m is None:
        return "body"
    kind, index, attr = m.groups()
    return ("body.labels" if kind == "add" else "body.uids") + (index or "") + (attr or "")


async def _change(state: State, change: LabelChange, expected_active: str | None = None,
                  single_uid: bool = False) -> LabelChangeResult:
    """Queue a label change, wait until it serves (or is refused) and answer with the new version."""
    wait = state.label_changes.retry_after("all")
    if wait is not None:
        raise ApiError(429, "too_many_requests", f"more than {state.settings.label_changes_per_minute} label changes "
                       f"this minute: retry in {wait} s", headers={"Retry-After": str(wait)})
    try:
        future = state.registry.submit_label_change(change, expected_active)
    except LabelChangesUnavailable as exc:
        raise ApiError(409, "label_changes_unavailable", str(exc)) from None
    except TooManyPendingChanges as exc:
        raise ApiError(429, "too_many_requests", str(exc), headers={"Retry-After": "1"}) from None
    except NoBundle as exc:
        raise ApiError(503, "not_ready", str(exc)) from None
    try:
        # Shielded: a client that leaves does not cancel a change once accepted.
        result = await asyncio.shield(asyncio.wrap_future(future))
    except ActiveVersionChanged as exc:
        state.metrics.failed_activations.labels("changed").inc()
        raise ApiError(409, "active_version_changed", str(exc)) from None
    except LabelChangeRejected as exc:
        details = [ErrorDetail(field=_request_field(f, single_uid), message=m) for f, m in exc.problems]
        if single_uid and any(m.startswith("no label") or "retired already" in m for _, m in exc.problems):
            raise ApiError(404, "label_not_found", "; ".join(d.message for d in details), details) from None
        raise ApiError(422, "invalid_request", "; ".join(f"{d.field}: {d.message}" for d in details[:10]),
                       details[:10]) from None
    except (ActivationFailed, BundleError) as exc:
        # BundleError: a file of the serving bundle that the change is the first to read (an
        # index its scoring never searches) is not what its manifest says; it keeps serving.
        state.metrics.failed_activations.labels("invalid").inc()
        log_event("label_change_refused", logging.ERROR, message=str(exc))
        raise ApiError(422, "bundle_rejected", str(exc)) from None
    except ProcessesDiverged as exc:
        state.metrics.failed_activations.labels("diverged").inc()
        log_event("processes_diverged", logging.ERROR, message=str(exc))
        raise ApiError(503, "processes_diverged", str(exc)) from None
    except NoBundle as exc:
        raise ApiError(503, "not_ready", str(exc)) from None
    except StateUnavailable as exc:
        raise _state_unavailable(state, exc) from None
    except ActivationLockBusy as exc:
        raise _lock_busy(state, exc) from None
    except BundleChanged as exc:  # the version the change derives from was written in place: it serves 503 too
        raise _changed(state, exc) from None
    report = result["change"]
    state.label_changes.record("all")  # the budget counts versions made, not refusals
    state.metrics.activation_seconds.observe(result["seconds"])
    return LabelChangeResult(active=result["active"], previous=result["previous"],
                             seconds=report.seconds + result["seconds"], derive_seconds=report.seconds,
                             added=report.added, retired=report.retired, num_labels=report.num_labels,
                             tree_labels=report.tree_labels, quality=result["quality"],
                             processes=result.get("processes", {}))


# Declares the admin routes' bearer token in the OpenAPI document (a generated client sends it);
# AdminRoute has checked the token before this runs, so it never refuses anything itself.
ADMIN_TOKEN = HTTPBearer(auto_error=False, scheme_name="admin_token",
                         description="SHORTLIST_ADMIN_TOKEN (401 without it, 403 a wrong one)")


def admin_router(models: RequestModels) -> APIRouter:
    router = APIRouter(prefix="/admin", route_class=AdminRoute, tags=["admin"], dependencies=[Security(ADMIN_TOKEN)])
    AddLabels, RetireLabels, Uid = models.add_labels, models.retire_labels, models.uid  # noqa: N806

    page_most = models.max_listed_bundles
    Limit = Annotated[int, Query(ge=1, le=page_most, description="bundles in this answer at most "  # noqa: N806
                                 "(SHORTLIST_MAX_LISTED_BUNDLES)"), BeforeValidator(_digits)]
    Offset = Annotated[int, Query(ge=0, description="bundles skipped first (a page's next_offset)"),  # noqa: N806
                       BeforeValidator(_digits)]
    ExpectedActive = Annotated[str | None, Query(pattern=VERSION_RE.pattern, description=EXPECTED_ACTIVE_HELP)]  # noqa: N806

    @router.get("/bundles", response_model=BundleList, responses=documented(401, 403, 422, 429),
                summary="the bundles of every place, oldest first, a page of at most `limit`")
    async def bundles(state: State, limit: Limit = page_most, offset: Offset = 0) -> BundleList:
        rows = await asyncio.wrap_future(state.registry.in_loader(state.registry.list))
        end = offset + limit
        return BundleList(active=state.registry.active_version, total=len(rows),
                          next_offset=end if end < len(rows) else None, bundles=[
            BundleInfo(version=b.version, created_at=b.manifest.created_at, active=active,
                       has_tree=b.manifest.has_tree, place=b.place, num_labels=b.manifest.num_labels,
                       unconfirmed=b.unconfirmed, shadowed=b.shadowed,
                       lineage=BundleLineage(**b.manifest.lineage.model_dump()) if b.manifest.lineage else None,
                       metrics=b.manifest.metrics)
            for b, active in rows[offset:end]
        ])

    @router.post("/bundles/activate", response_model=ActivationResult,
                 responses={**ACTIVATION_ERRORS, **documented(400, 413, 415)},
                 summary="load, check and swap in a bundle; requests in flight finish on the old one")
    async def activate(req: ActivateRequest, state: State) -> ActivationResult:
        return await _activate(state, state.registry.activate, req.version)

    # The body may be left out (an empty one is the default), but is not nullable: a generated
    # client sent an optional nullable body's "unset" marker as JSON and failed before sending.
    @router.post("/bundles/rollback", response_model=ActivationResult,
                 responses={**ACTIVATION_ERRORS, **documented(400, 413, 415)},
                 summary="swap back to the previously active bundle")
    async def rollback(state: State, req: Annotated[RollbackRequest, Body(default_factory=RollbackRequest)]
                       ) -> ActivationResult:
        return await _activate(state, state.registry.rollback, req.expected_active)

    @router.post("/labels", response_model=LabelChangeResult, responses=LABEL_ERRORS,
                 summary="add labels by their text: a new bundle version derived from the active one, activated; "
                 "queued behind changes in progress")
    async def add_labels(req: AddLabels, state: State) -> LabelChangeResult:
        labels = [NewLabel(lab.uid, lab.title, lab.content, lab.prior) for lab in req.labels]
        return await _change(state, LabelChange(add=labels), req.expected_active)

    @router.post("/labels/retire", response_model=LabelChangeResult, responses=LABEL_ERRORS,
                 summary="retire labels: never returned again by any scorer (a new bundle version)")
    async def retire_labels(req: RetireLabels, state: State) -> LabelChangeResult:
        return await _change(state, LabelChange(retire=list(req.uids)), req.expected_active)

    # {uid:path}: the rest of the path, '/' included once percent-decoded (as every path is), so
    # every uid the add route takes can be retired here ('a/b', 'x/', '../x' sent as %2F).
    @router.delete("/labels/{uid:path}", response_model=LabelChangeResult,
                   responses={**LABEL_ERRORS, **documented(404)},
                   summary="retire one label (404 if no live label has this uid); a '/' in the uid may be sent "
                   "as is or as %2F")
    async def retire_label(uid: Annotated[Uid, Path(description="the uid of a live label")], state: State,
                           expected_active: ExpectedActive = None) -> LabelChangeResult:
        return await _change(state, LabelChange(retire=[uid]), expected_active, single_uid=True)

    @router.get("/labels/{uid:path}", response_model=LabelInfo, responses=documented(401, 403, 404, 409, 429, 503),
                summary="one label of the active version by its uid, live or retired (404 if no row has it)")
    async def label(uid: Annotated[Uid, Path(description="a label's uid")], state: State) -> LabelInfo:
        return _label_info(state, uid)

    return router


def _label_info(state: State, uid: str) -> LabelInfo:
    """GET /admin/labels/{uid}: a hash lookup in the leased bundle's labels, on the loop."""
    try:
        version, found = state.registry.look_up_label(uid)
    except LabelChangesUnavailable as exc:
        raise ApiError(409, "label_changes_unavailable", str(exc)) from None
    except NoBundle as exc:
        raise ApiError(503, "not_ready", str(exc)) from None
    except BundleChanged as exc:
        raise _changed(state, exc) from None
    if found is None:
        raise ApiError(404, "label_not_found", f"no label {shown(uid)} in {version} (never added, or added on a "
                       "version since rolled back)", [ErrorDetail(field="path.uid", message="no such label")])
    return LabelInfo(version=version, **dataclasses.asdict(found))
