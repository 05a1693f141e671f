"""Browser pages on the configured origins call the API (CORS), every answer included (errors,
the body limits' 413); other origins get no CORS header; with none configured, none at all."""

from __future__ import annotations

import socket

import httpx
import pytest
from test_admin import AUTH, TOKEN

from service.api.cors import refusal_headers
from shortlist.testing import serve

PAGE = "https://app.example.com"
ENV = {"SHORTLIST_CORS_ORIGINS": "https://App.Example.com:443/, http://localhost:3000",
       "SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_MAX_BODY_BYTES": "2048", "SHORTLIST_ACCESS_LOG": "false",
       "SHORTLIST_BODY_TIMEOUT_S": "1"}


@pytest.fixture(scope="module")
def cors_server(bundle_root, tmp_path_factory):
    with serve(bundle_root, env=ENV, log_dir=tmp_path_factory.mktemp("cors")) as server:
        yield server


def _preflight(url: str, path: str, origin: str, method: str = "POST", headers: str = "content-type"):
    return httpx.options(f"{url}{path}", headers={"Origin": origin, "Access-Control-Request-Method": method,
                                                  "Access-Control-Request-Headers": headers})


def test_a_page_on_a_listed_origin_may_predict_and_read_every_answer(cors_server):
    url = cors_server.url
    pre = _preflight(url, "/v1/predict", PAGE, headers="content-type, x-request-id")
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == PAGE, pre.headers
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert {"content-type", "x-request-id"} <= set(pre.headers["access-control-allow-headers"].lower().split(", "))
    assert int(pre.headers["access-control-max-age"]) > 0
    origin = {"Origin": PAGE}
    for body, status in (({"text": "network monitor"}, 200), ({"text": "x", "k": 0}, 422),
                         ({"text": "x" * 3000}, 413)):
        r = httpx.post(f"{url}/v1/predict", json=body, headers=origin)
        assert r.status_code == status, r.text
        assert r.headers["access-control-allow-origin"] == PAGE, (status, r.headers)
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        assert "access-control-allow-credentials" not in r.headers  # no cookies: a bearer token is sent
    assert httpx.get(f"{url}/readyz", headers={"Origin": "http://localhost:3000"}).headers[
        "access-control-allow-origin"] == "http://localhost:3000"


def test_an_admin_page_sends_its_bearer_token_after_a_preflight(cors_server):
    pre = _preflight(cors_server.url, "/admin/labels/x", PAGE, method="DELETE", headers="authorization")
    assert pre.status_code == 200 and "DELETE" in pre.headers["access-control-allow-methods"], pre.text
    r = httpx.get(f"{cors_server.url}/admin/bundles", headers={**AUTH, "Origin": PAGE})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE


def test_another_origin_gets_no_cors_header_and_its_preflight_is_refused(cors_server):
    for origin in ("https://evil.example", "https://app.example.com.evil.example", "http://app.example.com"):
        r = httpx.post(f"{cors_server.url}/v1/predict", json={"text": "x"}, headers={"Origin": origin})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers, (origin, r.headers)
        pre = _preflight(cors_server.url, "/v1/predict", origin)
        assert pre.status_code == 400 and "access-control-allow-origin" not in pre.headers, (origin, pre.text)
    # A method or header the API does not take is refused to a listed origin too.
    assert _preflight(cors_server.url, "/v1/predict", PAGE, method="PUT").status_code == 400
    assert _preflight(cors_server.url, "/v1/predict", PAGE, headers="x-custom").status_code == 400


def test_without_origins_configured_no_answer_carries_cors_headers(bundle_root, tmp_path):
    with serve(bundle_root, log_dir=tmp_path) as server:
        r = httpx.post(f"{server.url}/v1/predict", json={"text": "x"}, headers={"Origin": PAGE})
        assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)
        pre = _preflight(server.url, "/v1/predict", PAGE)
        assert pre.status_code == 405 and not any(h.startswith("access-control-") for h in pre.headers)


def _raw(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of what the server answers `request` (sent as is) before it closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ")[1]), headers, body


@pytest.mark.parametrize("origin", [PAGE, "https://evil.example", None])
def test_a_refusal_below_the_app_carries_the_headers_a_listed_origin_needs(cors_server, origin):
    """A body past its timeout and a malformed body are answered by the HTTP layer, below the
    app's CORS middleware: to a listed origin with the same headers, so that its page reads the
    408 or 400 (not a network error); to others with none."""
    sent = b"" if origin is None else b"origin: %s\r\n" % origin.encode()
    head = b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    stalled = head + b"%scontent-length: 40\r\n\r\n{" % sent  # 39 bytes short
    malformed = b"POST /v1/predict HTTP/1.1\r\nhost: x\r\n%stransfer-encoding: chunked\r\n\r\nzz\r\n" % sent
    for request, status, error in ((stalled, 408, b"request_timeout"), (malformed, 400, b"malformed_http")):
        got, headers, body = _raw(cors_server.url, request)
        assert got == status and error in body, (got, body)
        cors = {name: value for name, value in headers.items() if name.startswith("access-control-")}
        if origin == PAGE:
            assert cors["access-control-allow-origin"] == PAGE and headers["vary"] == "origin", headers
            assert {"x-request-id", "retry-after"} <= set(cors["access-control-expose-headers"].split(", "))
        else:
            assert cors == {}, headers


def test_refusal_headers_follow_the_configured_origins():
    assert refusal_headers("", PAGE.encode()) == []
    assert refusal_headers("https://a.example", None) == []
    assert refusal_headers("*", b"https://any.example")[0] == (b"access-control-allow-origin", b"*")
    assert (b"vary", b"Origin") not in refusal_headers("*", b"https://any.example")  # the same answer for all
    listed = refusal_headers("https://a.example,https://b.example", b"https://b.example")
    assert listed[0] == (b"access-control-allow-origin", b"https://b.example") and (b"vary", b"Origin") in listed
    assert refusal_headers("https://a.example", b"https://A.example") == []  # compared as browsers send it
