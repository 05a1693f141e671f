"""Request bodies at the door: UTF-8 JSON only, uncompressed (415), at most `max_bytes` (413),
answered with the one error body. (How long a body may take: service.api.http_protocol.)

A middleware rather than dependencies: Starlette's own limiter answers a declared oversize
body with a plain-text 413 from outside the app's middleware (no error body, no request id),
and a per-route dependency checking the media type cost ~30 us a request in FastAPI's
dependency solver (5% of predict's req/s at one connection, bench/http_bench.py).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import error_json


class RequestBodyMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        declared = _content_length(headers)
        has_body = (declared or 0) > 0 or b"transfer-encoding" in headers
        refusal = _body_refusal(headers) if has_body else None
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
        return 415, "unsupported_media_type", f"content-encoding {encoding!r} is not accepted: send it uncompressed"
    value = headers.get(b"content-type", b"").decode("latin-1")
    media, _, rest = value.partition(";")
    if media.strip().lower() != "application/json":
        return 415, "unsupported_media_type", f"content-type must be application/json, got {value or 'none'!r}"
    for param in rest.split(";"):
        name, _, arg = param.partition("=")
        if name.strip().lower() == "charset" and arg.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return 415, "unsupported_media_type", f"only UTF-8 bodies are accepted, got charset {arg.strip()!r}"
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
