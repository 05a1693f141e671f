"""Errors as one JSON body (schemas.ErrorResponse) that names the field at fault and says why."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from service.api.schemas import NON_BLANK, ErrorDetail, ErrorResponse
from service.engine.schema import VERSION_RE

MAX_DETAILS = 10
# What a failed pattern means, in words.
_PATTERNS = {
    NON_BLANK: "text is empty or whitespace-only (Unicode whitespace, control and invisible format characters "
               "are blank)",
    VERSION_RE.pattern: "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
}
_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
               413: "body_too_large", 429: "too_many_requests"}


SHOWN_CHARS = 64


def shown(value: str) -> str:
    """A client's value quoted in an error message, cut to SHOWN_CHARS characters: an answer
    naming a 100,000-character uid or header must not be larger than what was wrong with it."""
    if len(value) <= SHOWN_CHARS:
        return repr(value)
    return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"


class BodyRefused(ValueError):
    """A body that is not acceptable JSON for a reason the parser's syntax error would not name
    (not UTF-8, nested too deeply, a number out of range): `code` and `message` of its 400."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class ApiError(Exception):
    """A request answered with an error status and the one error body."""

    def __init__(self, status: int, error: str, message: str, details: list[ErrorDetail] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.error, self.message = status, error, message
        self.details = details or []
        self.headers = headers


def error_json(error: str, message: str, details: list[ErrorDetail], request_id: str | None) -> bytes:
    body = ErrorResponse(error=error, message=message, details=details, request_id=request_id)
    return body.model_dump_json().encode()


def error_response(request: Request, exc: ApiError) -> Response:
    request_id = request.scope.get("state", {}).get("request_id")
    return Response(error_json(exc.error, exc.message, exc.details, request_id), status_code=exc.status,
                    headers=exc.headers, media_type="application/json")


def invalid(field: str, message: str, status: int = 422) -> ApiError:
    """A request whose `field` is wrong, e.g. invalid("body.exclude[2]", "unknown label uid 'x'")."""
    return ApiError(status, "invalid_request", f"{field}: {message}", [ErrorDetail(field=field, message=message)])


def invalid_many(problems: list[tuple[str, str]], total: int | None = None) -> ApiError:
    """A 422 for several wrong fields, (field, message) each, of `total` (default: all given): at
    most MAX_DETAILS named, so 1,000 bad list items do not make an answer larger than the
    request; the rest counted."""
    total = len(problems) if total is None else total
    details = [ErrorDetail(field=field, message=message) for field, message in problems[:MAX_DETAILS]]
    summary = "; ".join(f"{d.field}: {d.message}" for d in details)
    if total > MAX_DETAILS:
        summary += f"; and {total - MAX_DETAILS} more problems"
    return ApiError(422, "invalid_request", summary, details)


def field_name(loc: tuple[Any, ...]) -> str:
    out = str(loc[0]) if loc else "body"
    for part in loc[1:]:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def error_message(err: dict[str, Any]) -> str:
    """One pydantic error in words (a failed pattern as what it means)."""
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "field required"
    if kind == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") in _PATTERNS:
        return _PATTERNS[err["ctx"]["pattern"]]
    return str(err["msg"]).removeprefix("Value error, ")


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if errors and errors[0]["type"] == "json_invalid":
        reason = errors[0].get("ctx", {}).get("error", "syntax error")
        return error_response(request, ApiError(400, "malformed_json", f"body is not valid JSON: {reason} at byte "
                                                f"{errors[0]['loc'][-1]}"))
    problems = [(field_name(tuple(e["loc"])), error_message(e)) for e in errors[:MAX_DETAILS]]
    return error_response(request, invalid_many(problems, total=len(errors)))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc.__cause__, ClientDisconnect):
        # FastAPI reports a client gone mid-body as a 400 "error parsing the body": there is no
        # one to answer; the observability middleware counts it apart from errors.
        raise exc.__cause__
    # The decoded path as routed: request.url drops a decoded tab, CR or LF (urllib's URL parser
    # strips them), so "/x/a%0Ab" was named "/x/ab". Quoted (repr) unless plain and short.
    path = request.scope.get("path") or request.url.path
    where = f"{request.method} {path if len(path) <= SHOWN_CHARS and path.isprintable() else shown(path)}"
    message = f"{where}: {exc.detail}"
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    if exc.status_code == 400 and exc.__cause__ is not None:
        code, message = _parse_failure(exc.__cause__, code, message)
    headers = getattr(exc, "headers", None)
    if exc.status_code == 405 and (allowed := _allowed(request)) is not None:
        headers = {**(headers or {}), "Allow": allowed}
    return error_response(request, ApiError(exc.status_code, code, message, headers=headers))


_HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def _allowed(request: Request) -> str | None:
    """The methods of the path the 405 is about, as /openapi.json lists them: Starlette names only
    the methods of the first route on that path (DELETE alone where GET /admin/labels/{uid} is one
    too). None for a path outside the schema (Starlette's header stands)."""
    path = getattr(request.scope.get("route"), "path_format", None)
    item = request.app.openapi().get("paths", {}).get(path) if path else None  # built once, then kept
    return ", ".join(m.upper() for m in item if m in _HTTP_METHODS) if item else None


def _parse_failure(cause: BaseException, code: str, message: str) -> tuple[str, str]:
    """Name why a body was not taken as JSON (FastAPI reports every such failure as one 400)."""
    if isinstance(cause, BodyRefused):
        return cause.code, cause.message
    return code, message


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(request, exc)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
