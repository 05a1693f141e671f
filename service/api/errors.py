"""4xx errors as JSON bodies that name the field and say why, and request-body parsing."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    def __init__(self, status: int, error: str, message: str, details: list[dict[str, str]] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message
        self.details = details or []
        self.headers = headers


def error_response(request: Request, exc: ApiError) -> JSONResponse:
    body = {"error": exc.error, "message": exc.message, "details": exc.details,
            "request_id": request.scope.get("state", {}).get("request_id")}
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def _field(loc: tuple[Any, ...]) -> str:
    out = "body"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _message(err: dict[str, Any]) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown field"
    if err["type"] == "missing":
        return "field required"
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ")


def validation_details(exc: ValidationError) -> list[dict[str, str]]:
    return [{"field": _field(tuple(e["loc"])), "message": _message(e)} for e in exc.errors()]


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request body as JSON: content type, size, UTF-8 and syntax checked, in that order."""
    ctype = request.headers.get("content-type", "")
    media, _, params = ctype.partition(";")
    if media.strip().lower() != "application/json":
        raise ApiError(415, "unsupported_media_type",
                       f"content-type must be application/json, got {ctype or 'none'!r}")
    charset = params.strip().lower()
    if charset and charset.replace(" ", "") not in ("charset=utf-8", "charset=utf8"):
        raise ApiError(415, "unsupported_media_type", f"only UTF-8 bodies are accepted, got {params.strip()!r}")
    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise ApiError(400, "bad_request", f"content-length {length!r} is not a number") from None
        if declared > max_bytes:
            raise ApiError(413, "body_too_large", f"body is {declared} bytes, the limit is {max_bytes}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:  # chunked uploads have no content-length; stop reading at the limit
            raise ApiError(413, "body_too_large", f"body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, "invalid_encoding",
                       f"body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, "malformed_json", f"body is not valid JSON: {exc.msg} at line {exc.lineno} "
                       f"column {exc.colno}") from None


async def parse_body(request: Request, model: type[M], max_bytes: int, context: dict[str, Any] | None = None) -> M:
    data = await read_json(request, max_bytes)
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        details = validation_details(exc)
        summary = "; ".join(f"{d['field']}: {d['message']}" for d in details)
        raise ApiError(422, "invalid_request", summary, details) from None
