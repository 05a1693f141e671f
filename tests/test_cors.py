"""Browser pages on the configured origins call the API (CORS), every answer included (errors,
the body limits' 413); other origins get no CORS header; with none configured, none at all."""

from __future__ import annotations

import httpx
import pytest
from test_admin import AUTH, TOKEN

from shortlist.testing import serve

PAGE = "https://app.example.com"
ENV = {"SHORTLIST_CORS_ORIGINS": "https://App.Example.com:443/, http://localhost:3000",
       "SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_MAX_BODY_BYTES": "2048", "SHORTLIST_ACCESS_LOG": "false"}


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
