"""Cross-origin requests from browser pages (CORS), off unless SHORTLIST_CORS_ORIGINS names the
origins allowed: Starlette's CORSMiddleware answers the preflights and adds the headers.

An origin is compared as a browser sends it in `Origin` (RFC 6454's serialisation): lower case,
no path, no default port. An entry written otherwise ("https://App.example/", ":443") would never
match and every call from that page would fail in the browser with nothing in the server's log,
so entries are normalised, and one that is not an origin is refused at start-up.
"""

from __future__ import annotations

import re

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

_ORIGIN = re.compile(r"(https?)://(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::(\d{1,5}))?/?")
_DEFAULT_PORT = {"http": "80", "https": "443"}
# What a page may send and read: a bearer token for the admin routes, the request id both ways,
# Retry-After on 429 / 503. Credentials (cookies) are not used by the API, so never allowed.
METHODS = ("GET", "HEAD", "POST", "DELETE")
REQUEST_HEADERS = ("Authorization", "Content-Type", "X-Request-ID")
EXPOSED_HEADERS = ("X-Request-ID", "Retry-After")
PREFLIGHT_MAX_AGE_S = 600


def parse_origins(value: str) -> str:
    """`value` (comma-separated origins, or *) normalised (a trailing "/" dropped); ValueError naming an
    entry that is not one."""
    entries = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        m = _ORIGIN.fullmatch(entry.lower())
        if entry != "*" and (m is None or (m[3] is not None and not 0 < int(m[3]) < 65536)):
            raise ValueError(f"{entry!r} is not an origin: scheme://host[:port] with no path (as a browser sends "
                             "it in Origin, e.g. https://app.example.com), or *")
        if entry != "*":
            scheme, host, port = m.groups()
            entry = f"{scheme}://{host}" + (f":{port}" if port not in (None, _DEFAULT_PORT[scheme]) else "")
        entries.append(entry)
    return ",".join(dict.fromkeys(entries))


def add_cors(app: Starlette, origins: str) -> None:
    """Let `origins` (parse_origins' form; "" adds nothing) call `app` from a browser: the
    middleware goes where it is added in the app's stack (outside those added before it)."""
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins.split(","), allow_methods=METHODS,
                           allow_headers=REQUEST_HEADERS, expose_headers=EXPOSED_HEADERS,
                           max_age=PREFLIGHT_MAX_AGE_S)


def refusal_headers(allowed: str, origin: bytes | None) -> list[tuple[bytes, bytes]]:
    """The headers CORSMiddleware adds to an answer to `origin` (a request's Origin), for the
    answers written below the app (service.api.http_protocol's refusals: a body past its timeout,
    a malformed body), so that a page reads those too; none unless `allowed` (parse_origins'
    form) lets that origin call."""
    if not allowed or origin is None:
        return []
    entries = allowed.split(",")
    expose = (b"access-control-expose-headers", ", ".join(EXPOSED_HEADERS).encode())
    if "*" in entries:
        return [(b"access-control-allow-origin", b"*"), expose]
    if origin.decode("latin-1") in entries:
        return [(b"access-control-allow-origin", origin), expose, (b"vary", b"Origin")]
    return []
