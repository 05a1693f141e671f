"""Request bodies at the door: UTF-8 JSON only, uncompressed (415), at most `max_bytes` (413),
answered with the one error body. (How long a body may take: service.api.http_protocol.)
The JSON itself is parsed as RFC 8259 defines it (StrictJsonRoute), never more leniently.

A middleware rather than dependencies: Starlette's own limiter answers a declared oversize
body with a plain-text 413 from outside the app's middleware (no error body, no request id),
and a per-route dependency checking the media type cost ~30 us a request in FastAPI's
dependency solver (5% of predict's req/s at one connection, bench/http_bench.py).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import SHOWN_CHARS, ApiError, BodyRefused, error_json, invalid_many, shown

_NOT_JSON_NUMBERS = (b"NaN", b"Infinity", b"-Infinity")
# The methods of the service's routes that take no body.
_BODYLESS_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})


class RequestBodyMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = scope.get("headers", ())
        headers = dict(raw)
        types = sum(1 for name, _ in raw if name == b"content-type")
        if types > 1:
            # This reads the last, FastAPI the first: which one counts is refused, not guessed
            # (as two Authorization headers are, dependencies.require_admin).
            await _refuse(scope, send, 400, "bad_request", f"{types} Content-Type headers: send one")
            return
        declared = _content_length(headers)
        has_body = (declared or 0) > 0 or b"transfer-encoding" in headers
        # A stray body on a route that reads none (GET /healthz, DELETE /admin/labels/{uid}) is
        # dropped unread, as RFC 9110 gives it no meaning: what it is labelled is not refused (a
        # 415 there came before the admin token's check); its size is still bounded.
        reads = scope["method"] not in _BODYLESS_METHODS
        refusal = _body_refusal(headers) if has_body and reads else None
        if refusal is None and declared is not None and declared > self.max_bytes:
            refusal = (413, "body_too_large", f"body is {declared} bytes, the limit is {self.max_bytes}")
        if refusal is not None:
            await _refuse(scope, send, *refusal)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # chunked uploads declare no length: stop at the limit
                raise HTTPException(413, f"body exceeds the limit of {self.max_bytes} bytes")
            return message

        await self.app(scope, counted, send)


def _body_refusal(headers: dict[bytes, bytes]) -> tuple[int, str, str] | None:
    """Why a body with these headers is refused (415), or None for uncompressed UTF-8 JSON."""
    encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
    if encoding not in ("", "identity"):
        return 415, "unsupported_media_type", (f"content-encoding {shown(encoding)} is not accepted: "
                                               "send it uncompressed")
    value = headers.get(b"content-type", b"").decode("latin-1")
    media, _, rest = value.partition(";")
    if media.strip().lower() != "application/json":
        got = shown(value) if value else "none"
        return 415, "unsupported_media_type", f"content-type must be application/json, got {got}"
    for param in rest.split(";"):
        name, _, arg = param.partition("=")
        if name.strip().lower() == "charset" and arg.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return 415, "unsupported_media_type", f"only UTF-8 bodies are accepted, got charset {shown(arg.strip())}"
    return None


async def _refuse(scope: Scope, send: Send, status: int, code: str, message: str) -> None:
    body = error_json(code, message, [], scope.get("state", {}).get("request_id"))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    try:
        return int(headers[b"content-length"])
    except (KeyError, ValueError):
        return None


class StrictJsonRequest(Request):
    """A request whose JSON body is parsed by orjson, which follows RFC 8259 where Python's json
    module (FastAPI's parser) does not: NaN and Infinity are not numbers, a body is UTF-8 (json
    also decodes UTF-16 and UTF-32 and skips a byte order mark), nesting stops at 1024 levels
    without recursing in Python, and a number is parsed without converting thousands of digits.
    A syntax error stays a json.JSONDecodeError (FastAPI's 400 naming where); the rest are named
    (errors.BodyRefused)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                raise _named(body, exc) from None
        return self._json


def _named(body: bytes, exc: orjson.JSONDecodeError) -> Exception:
    """What to raise for a body orjson refused: the reason in words where orjson's are unclear."""
    at = f"at byte {exc.pos}"
    if body.startswith(b"\xef\xbb\xbf"):
        return BodyRefused("invalid_encoding", "body starts with a UTF-8 byte order mark: send UTF-8 without one")
    if "UTF-8" in exc.msg:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as bad:
            return BodyRefused("invalid_encoding", f"body is not valid UTF-8: {bad.reason} at byte {bad.start}")
    if "depth limit" in exc.msg:
        return BodyRefused("malformed_json", "body is not acceptable JSON: nested too deeply (over 1024 levels)")
    if "infinity when parsed" in exc.msg:
        return BodyRefused("malformed_json", f"body is not acceptable JSON: a number with too many digits or out of "
                           f"a double's range {at}")
    if body[exc.pos:].lstrip().startswith(_NOT_JSON_NUMBERS):
        return BodyRefused("malformed_json", f"body is not valid JSON: NaN and Infinity are not JSON numbers {at}")
    return exc


def _query_names(dependant: Dependant) -> set[str]:
    """The query parameters a route takes, its dependencies' included."""
    return {p.alias for p in dependant.query_params}.union(*(_query_names(d) for d in dependant.dependencies))


def refuse_unknown_query(request: Request, known: frozenset[str]) -> None:
    """A 422 naming each query parameter the route does not take, or takes once but was given
    twice: FastAPI ignores the one and keeps the last of the other, so `?k=5` on a prediction, or
    a misspelt `expected_active` on a DELETE, was answered as if it had not been sent."""
    if not request.scope.get("query_string"):  # the prediction's usual case: nothing parsed
        return
    keys = request.query_params.multi_items()
    seen: set[str] = set()
    problems = []
    for key, _ in keys:
        field = f"query.{key}" if len(key) <= SHOWN_CHARS and key.isprintable() else "query"
        if key not in known:
            takes = ", ".join(sorted(known)) or "none"
            problems.append((field, f"unknown query parameter {shown(key)} (this route takes: {takes})"))
        elif key in seen:
            problems.append((field, "given more than once"))
        seen.add(key)
    if problems:
        raise invalid_many(problems)


class StrictJsonRoute(APIRoute):
    """A route whose body is read as StrictJsonRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        # An optional body (POST /admin/bundles/rollback's precondition) may be left out.
        takes_body = self.body_field is not None and self.body_field.field_info.is_required()
        known = frozenset(_query_names(self.dependant))

        async def strict(request: Request) -> Response:
            refuse_unknown_query(request, known)
            strict_request = StrictJsonRequest(request.scope, request.receive)
            # FastAPI takes an empty body for no body ("field required"), whitespace for bad JSON.
            if takes_body and not await strict_request.body():
                raise ApiError(400, "malformed_json", "body is empty: send a JSON object")
            return await handler(strict_request)

        return strict
