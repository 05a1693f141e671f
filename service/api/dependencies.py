"""FastAPI dependencies: the service's state, a lease on the serving bundle, admin auth."""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import unquote_to_bytes

from fastapi import Depends
from starlette.requests import Request
from starlette.responses import Response

from service.api.batching import EngineRunner
from service.api.bundle_watch import BundleWatch, changed_error
from service.api.errors import ApiError, invalid, shown
from service.api.leases import Engine, NoBundle
from service.api.observability import ServiceMetrics
from service.api.processes import ProcessGroup
from service.api.registry import BundleRegistry
from service.api.request_body import StrictJsonRoute
from service.api.schemas import RequestModels
from service.api.settings import Settings
from service.api.state_check import StateDirCheck


class MinuteBudget:
    """Events per key in the current minute, and how long a key past `per_minute` must wait:
    wrong admin tokens per client address (past the budget, the client's admin requests get 429
    until the minute is over: guessing slowed to that rate), label changes accepted."""

    WINDOW_S = 60.0

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._window_start = time.monotonic()
        self._counts: dict[str, int] = {}

    def _roll(self) -> None:
        now = time.monotonic()
        if now - self._window_start >= self.WINDOW_S:
            self._window_start, self._counts = now, {}  # bounded: one entry per address per minute

    def retry_after(self, client: str) -> int | None:
        """Seconds until `client` may try again, or None while within its budget."""
        self._roll()
        if self._counts.get(client, 0) < self.per_minute:
            return None
        return max(1, int(self.WINDOW_S - (time.monotonic() - self._window_start)) + 1)

    def record(self, client: str) -> None:
        self._roll()
        self._counts[client] = self._counts.get(client, 0) + 1


@dataclass
class ServiceState:
    """What the routes share, made once per process by the app factory (app.state.service)."""

    settings: Settings
    registry: BundleRegistry
    runner: EngineRunner
    metrics: ServiceMetrics
    models: RequestModels
    auth_failures: MinuteBudget
    label_changes: MinuteBudget
    group: ProcessGroup | None = None  # with several serving processes (service.api.processes)
    watch: BundleWatch | None = None  # the serving version's files (service.api.bundle_watch)
    startup_error: str | None = None  # why start-up serves nothing (/readyz says it until a bundle serves)
    state_check: StateDirCheck | None = None  # whether the state directory takes writes (/healthz, /metrics)


def service_state(request: Request) -> ServiceState:
    return request.app.state.service


# Dependencies are `async def` even where they do not await: FastAPI runs a plain `def`
# dependency on its thread pool, a hop that cost each request ~0.25 ms (echo's req/s at one
# connection halved, bench/http_bench.py). The prediction routes take no dependency at all
# (each cost 30-100 us in FastAPI's solver): they call service_state and lease_engine.
async def get_state(request: Request) -> ServiceState:
    return service_state(request)


State = Annotated[ServiceState, Depends(get_state)]


class lease_engine(AbstractContextManager[Engine]):  # noqa: N801 - entered as `with lease_engine(request)`
    """The bundle that answers this request, from start to end, however many swaps happen
    meanwhile; 503 before any bundle is loaded.

    A context manager the route enters, not a generator dependency: FastAPI runs those through
    an exit stack under a shielded cancel scope, which cost ~0.1 ms a request (a sixth of
    predict's req/s at one connection, bench/http_bench.py); and a class, not a @contextmanager
    generator, for the same reason at a smaller scale (bench/RESULTS.md, issue 22).
    """

    __slots__ = ("_request", "_lease")

    def __init__(self, request: Request) -> None:
        self._request = request

    def __enter__(self) -> Engine:
        request = self._request
        self._lease = request.app.state.service.registry.lease()
        try:
            engine = self._lease.__enter__()
        except NoBundle:
            raise ApiError(503, "not_ready", "no validated bundle is loaded yet") from None
        # The access log names the version that answered (service.api.observability).
        request.scope.setdefault("state", {})["bundle_version"] = engine.version
        if engine.changed is not None:
            self._lease.__exit__(None, None, None)
            raise changed_error(engine.version, engine.changed)
        return engine

    def __exit__(self, *exc: object) -> None:
        self._lease.__exit__(*exc)


def require_admin(request: Request) -> None:
    """A bearer token equal to the configured admin token (compared in constant time), from a
    client that has not spent its budget of wrong tokens (429 with Retry-After)."""
    state = service_state(request)
    client = request.client.host if request.client else "unknown"
    wait = state.auth_failures.retry_after(client)
    if wait is not None:
        raise ApiError(429, "too_many_requests", f"too many wrong admin tokens from {client}: retry in {wait} s",
                       headers={"Retry-After": str(wait)})
    challenge = {"WWW-Authenticate": "Bearer"}
    sent = request.headers.getlist("authorization")
    if len(sent) > 1:
        # Which one counts is up to each proxy and framework on the way (Starlette: the first):
        # refused, not guessed.
        raise ApiError(400, "bad_request", f"{len(sent)} Authorization headers: send one")
    authorization = sent[0] if sent else None
    if not authorization:
        raise ApiError(401, "unauthorized", "admin routes need an Authorization: Bearer token", headers=challenge)
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "unauthorized", "the Authorization header must be 'Bearer <token>'", headers=challenge)
    expected = state.settings.admin_token
    if expected is None or not hmac.compare_digest(token.strip().encode(), expected.get_secret_value().encode()):
        state.auth_failures.record(client)
        raise ApiError(403, "forbidden", "wrong admin token")


def require_utf8_path(request: Request) -> None:
    """A path that is UTF-8 once percent-decoded: Starlette decodes other bytes as U+FFFD, so
    DELETE /admin/labels/%FF%FE looked up the label '\ufffd\ufffd' (a 404 naming another uid)."""
    raw = request.scope.get("raw_path") or request.scope["path"].encode("utf-8")
    try:
        unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        path = raw.decode("ascii", "backslashreplace")
        raise invalid("path", f"not UTF-8 once percent-decoded: {shown(path)}", status=400) from None


class AdminRoute(StrictJsonRoute):
    """An admin route: the token is checked before anything else of the request is read, so a
    client without it learns nothing from how its body or path would have been taken (a
    dependency would run only after FastAPI parsed the body: a 400 on malformed JSON first)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def authorized(request: Request) -> Response:
            require_admin(request)
            require_utf8_path(request)
            return await handler(request)

        return authorized
