"""A hostile client against a real `shortlist serve` over loopback: requests the HTTP parser
refuses, bodies that are not RFC 8259 JSON, values a refusal would echo, redirects built from the
Host header, WebSocket upgrades, admin routes probed without a token, and scanners that would blow
up the metrics' label sets. Every refusal is a 4xx with the one error body naming what was wrong,
and the server keeps serving."""

from __future__ import annotations

import json
import shutil
import socket
import unicodedata

import httpx
import pytest
from _api_helpers import read_answers

from shortlist.testing import serve

TOKEN = "hostile-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def client(bundle_root, tmp_path_factory):
    """A client of one server for the whole module (admin on, a state directory for label changes)."""
    env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_ACCESS_LOG": "false",
           "SHORTLIST_STATE_DIR": str(tmp_path_factory.mktemp("hostile-state"))}
    log_dir = tmp_path_factory.mktemp("hostile")
    with serve(bundle_root, env=env, log_dir=log_dir) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        yield c


def _exchange(client: httpx.Client, raw: bytes) -> tuple[int, dict]:
    """Send raw bytes to the client's server, read until it closes, and parse its one answer."""
    url = client.base_url
    with socket.create_connection((url.host, url.port), timeout=10) as sock:
        sock.sendall(raw)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def _still_serving(client: httpx.Client) -> None:
    assert client.post("/v1/predict", json={"text": "still serving"}).status_code == 200


BODY = b'{"text": "x"}'
POST = b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
MALFORMED_HTTP = [
    # (what, raw request, a word of what the answer must name)
    ("Content-Length beside Transfer-Encoding",
     POST + b"content-length: 13\r\ntransfer-encoding: chunked\r\n\r\nd\r\n" + BODY + b"\r\n0\r\n\r\n",
     "Transfer-Encoding"),
    ("two Content-Lengths", POST + b"content-length: 13\r\ncontent-length: 5\r\n\r\n" + BODY, "Content-Length"),
    ("a Content-Length that is not a number", POST + b"content-length: -1\r\n\r\n" + BODY, "Content-Length"),
    ("a Content-Length past 64 bits", POST + b"content-length: " + b"9" * 30 + b"\r\n\r\n" + BODY, "Content-Length"),
    ("a chunk size that is not hex", POST + b"transfer-encoding: chunked\r\n\r\nzz\r\n" + BODY + b"\r\n0\r\n\r\n",
     "chunk size"),
    ("an unknown method", b"FOO /healthz HTTP/1.1\r\nhost: x\r\n\r\n", "method"),
    ("a control character in the path", b"GET /\x01 HTTP/1.1\r\nhost: x\r\n\r\n", "url"),
    ("a NUL in a header value", b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-a: b\x00c\r\n\r\n", "header value"),
    ("a folded header line", b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-a: b\r\n  c\r\n\r\n", "whitespace"),
    ("an unknown HTTP version", b"GET /healthz HTTP/9.9\r\nhost: x\r\n\r\n", "version"),
    ("the start of a TLS handshake", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40, "method"),
]


@pytest.mark.parametrize(("what", "raw", "named"), MALFORMED_HTTP, ids=[m[0] for m in MALFORMED_HTTP])
def test_a_request_the_http_parser_refuses_gets_a_json_400_naming_why(client, what, raw, named):
    status, body = _exchange(client, raw)
    assert status == 400 and body["error"] == "malformed_http", (what, body)
    assert named.lower() in body["message"].lower(), (what, body)
    _still_serving(client)


def _pipelined(client: httpx.Client, raw: bytes) -> list[tuple[int, dict]]:
    """Send raw bytes in one write and every answer in order, until the server closes (read_answers)."""
    url = client.base_url
    with socket.create_connection((url.host, url.port), timeout=10) as sock:
        sock.sendall(raw)
        return read_answers(sock)


AFTER_A_VALID_REQUEST = [
    # (what, the malformed request, a word of what its 400 must name)
    ("a malformed request line", b"GARBAGE\r\n\r\n", "method"),
    ("a malformed header line", b"GET /healthz HTTP/1.1\r\nhost: x\r\nBad Header\r\n\r\n", "header"),
    # its head is parsed (uvicorn lines it up behind the first): it must not start
    ("a malformed chunk size", POST + b"transfer-encoding: chunked\r\n\r\nzz\r\n" + BODY + b"\r\n0\r\n\r\n",
     "chunk size"),
]


@pytest.mark.parametrize(("what", "malformed", "named"), AFTER_A_VALID_REQUEST,
                         ids=[a[0] for a in AFTER_A_VALID_REQUEST])
def test_a_request_pipelined_before_a_malformed_one_is_answered_before_its_400(client, what, malformed, named):
    # Audit 6 finding 3: the 400 closed the connection while the valid request ran; its answer was lost.
    valid = POST + b"content-length: %d\r\n\r\n" % len(BODY) + BODY
    answers = _pipelined(client, valid + malformed)
    assert [status for status, _ in answers] == [200, 400], (what, answers)
    assert len(answers[0][1]["results"]) == 1, answers[0]
    assert answers[1][1]["error"] == "malformed_http" and named in answers[1][1]["message"].lower(), answers[1]
    _still_serving(client)


def test_requests_lined_up_before_a_malformed_one_are_each_answered_in_order_before_its_400(client):
    # The second waits in uvicorn's line behind the first when the malformed one is read.
    first, second = (json.dumps({"texts": [text] * 8}).encode() for text in ("network", "traffic"))
    valid = [POST + b"content-length: %d\r\n\r\n" % len(body) + body for body in (first, second)]
    answers = _pipelined(client, b"".join(valid) + b"GARBAGE\r\n\r\n")
    assert [status for status, _ in answers] == [200, 200, 400], answers
    assert [len(answer["results"]) for _, answer in answers[:2]] == [8, 8]


def test_a_label_added_before_a_malformed_request_is_answered_and_the_answer_is_what_was_done(client):
    # The add takes a while (a new bundle version is written): the 400 waits for its answer.
    body = json.dumps({"labels": [{"uid": "pipelined-add", "title": "kama kelu"}]}).encode()
    add = (b"POST /admin/labels HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           b"authorization: Bearer " + TOKEN.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    before = client.get("/readyz").json()["version"]
    answers = _pipelined(client, add + b"GARBAGE\r\n\r\n")
    assert [status for status, _ in answers] == [200, 400], answers
    added = answers[0][1]
    assert added["previous"] == before and added["added"] == 1, added
    assert client.get("/readyz").json()["version"] == added["active"]
    assert client.post("/v1/predict", json={"text": "kama kelu", "exclude": ["pipelined-add"]}).status_code == 200
    assert answers[1][1]["error"] == "malformed_http"


NOT_RFC_8259 = [
    # (what, body, error code, a word of the message)
    ("NaN", b'{"text": "x", "alpha": NaN}', "malformed_json", "NaN and Infinity"),
    ("Infinity", b'{"text": "x", "k": Infinity}', "malformed_json", "NaN and Infinity"),
    ("-Infinity in a list", b'{"text": "x", "exclude": [-Infinity]}', "malformed_json", "NaN and Infinity"),
    ("a number past a double", b'{"text": "x", "k": 1e400}', "malformed_json", "range"),
    ("a UTF-8 byte order mark", b'\xef\xbb\xbf{"text": "x"}', "invalid_encoding", "byte order mark"),
    ("UTF-16", '{"text": "x"}'.encode("utf-16"), "invalid_encoding", "UTF-8"),
    ("UTF-32", '{"text": "x"}'.encode("utf-32"), "invalid_encoding", "UTF-8"),
    ("a lone surrogate escape", b'{"text": "a \\ud800 b"}', "malformed_json", "surrogate"),
    ("a surrogate encoded as UTF-8", b'{"text": "a \xed\xa0\x80 b"}', "invalid_encoding", "UTF-8"),
    ("nesting past 1024 levels", b'{"text": "x", "zz": ' + b"[" * 1100 + b"]" * 1100 + b"}", "malformed_json",
     "too deeply"),
]
ROUTES_WITH_BODIES = ["/v1/predict", "/v1/predict/tree", "/admin/bundles/activate", "/admin/labels",
                      "/admin/labels/retire"]


@pytest.mark.parametrize("route", ROUTES_WITH_BODIES)
@pytest.mark.parametrize(("what", "body", "code", "named"), NOT_RFC_8259, ids=[n[0] for n in NOT_RFC_8259])
def test_a_body_that_is_not_rfc_8259_json_is_a_400_naming_why(client, route, what, body, code, named):
    # Python's json module (FastAPI's parser) took NaN and Infinity as numbers, decoded UTF-16
    # and UTF-32 and skipped a byte order mark.
    r = client.post(route, content=body, headers={**JSON, **AUTH})
    assert r.status_code == 400, (what, r.text)
    assert r.json()["error"] == code and named in r.json()["message"], (what, r.json())
    _still_serving(client)


def test_json_nested_up_to_the_parsers_limit_is_a_422_naming_the_field(client):
    r = client.post("/v1/predict", content=b'{"text": "x", "k": ' + b"[" * 1000 + b"]" * 1000 + b"}", headers=JSON)
    assert r.status_code == 422 and r.json()["details"][0]["field"] == "body.k", r.text


def test_a_value_quoted_in_a_refusal_is_cut_to_a_few_dozen_characters(client):
    r = client.post("/v1/predict", json={"text": "x", "exclude": ["u" * 100_000]})
    assert r.status_code == 422 and r.json()["details"][0]["field"] == "body.exclude[0]"
    assert "(100000 characters)" in r.json()["message"] and len(r.content) < 2000, len(r.content)
    r = client.post("/v1/predict", content=BODY, headers={"content-type": "text/" + "x" * 20_000})
    assert r.status_code == 415 and "(20005 characters)" in r.json()["message"] and len(r.content) < 2000
    r = client.get("/" + "p" * 20_000)
    assert r.status_code == 404 and "(20001 characters)" in r.json()["message"] and len(r.content) < 2000


def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_clients_host(client):
    # Starlette's redirect built its Location from the Host header: "http://evil.example/v1/predict",
    # where the client would send its POST body again.
    raw = (b"POST /v1/predict/ HTTP/1.1\r\nhost: evil.example\r\ncontent-type: application/json\r\n"
           b"content-length: 13\r\nconnection: close\r\n\r\n" + BODY)
    status, body = _exchange(client, raw)
    assert status == 404 and body["error"] == "not_found"


def test_a_websocket_upgrade_is_answered_as_plain_http(client):
    raw = (b"GET /healthz HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade, close\r\n"
           b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n")
    status, body = _exchange(client, raw)
    assert status == 200 and body["status"] == "ok"


ADMIN_POSTS = ["/admin/bundles/activate", "/admin/bundles/rollback", "/admin/labels", "/admin/labels/retire"]


@pytest.mark.parametrize("route", ADMIN_POSTS)
def test_an_admin_route_checks_the_token_before_reading_the_body(client, route):
    for body in (b'{"version": ', b"\xff\xfe", b'{"labels": NaN}'):
        r = client.post(route, content=body, headers=JSON)
        assert r.status_code == 401 and r.json()["error"] == "unauthorized", (route, body, r.text)
    r = client.post(route, content=b'{"version": ', headers={**JSON, "authorization": "Bearer wrong"})
    assert r.status_code == 403, r.text
    r = client.delete("/admin/labels/" + "u" * 300)
    assert r.status_code == 401, r.text
    if route != "/admin/bundles/rollback":  # it reads no body
        r = client.post(route, content=b'{"version": ', headers={**JSON, **AUTH})
        assert r.status_code == 400 and r.json()["error"] == "malformed_json", r.text


LOOKALIKE_UIDS = [(" L1", "whitespace"), ("L1\u200b", "invisible"), ("a\u0007b", "control"),
                  (unicodedata.normalize("NFD", "caf\u00e9"), "normal form KC: it reads as 'caf\u00e9'"),
                  ("\uff2c1", "normal form KC: it reads as 'L1'"), ("L\u00b9", "reads as 'L1'"),
                  ("\u2112\u2460", "reads as 'L1'")]


@pytest.mark.parametrize(("uid", "reason"), LOOKALIKE_UIDS, ids=["padded", "zero-width", "control", "decomposed",
                                                                  "fullwidth", "superscript", "letterlike"])
def test_a_new_label_uid_that_would_look_like_another_is_refused(client, uid, reason):
    # Uids are compared code point by code point: each of these was a new label beside one that
    # looks the same, which a client excluding "the same" uid got back.
    before = client.get("/readyz").json()["version"]
    r = client.post("/admin/labels", json={"labels": [{"uid": uid, "title": "kama zani"}]}, headers=AUTH)
    assert r.status_code == 422, r.text
    assert r.json()["details"][0]["field"] == "body.labels[0].uid" and reason in r.json()["message"], r.json()
    assert client.get("/readyz").json()["version"] == before


UNSHOWABLE_TEXTS = [({"title": "kama \x1b[2Jzani"}, "title", "a control character (U+001B) at 5"),
                    ({"title": "kama\nzani"}, "title", "a control character (U+000A)"),
                    ({"title": "kama \u202einaz"}, "title", "a bidi override (U+202E)"),
                    ({"title": "kama zani", "content": "pobura\x07"}, "content", "a control character (U+0007)")]


@pytest.mark.parametrize(("fields", "part", "reason"), UNSHOWABLE_TEXTS, ids=["ansi", "newline", "rlo", "bell"])
def test_a_new_label_text_that_answers_would_hand_out_as_something_else_is_refused(client, fields, part, reason):
    # Every answer returns a label's title verbatim: an ANSI escape drove the terminal of whoever
    # printed it, a right-to-left override showed "zani" for "inaz".
    before = client.get("/readyz").json()["version"]
    r = client.post("/admin/labels", json={"labels": [{"uid": "unshown-1", **fields}]}, headers=AUTH)
    assert r.status_code == 422, r.text
    detail = r.json()["details"][0]
    assert detail["field"] == f"body.labels[0].{part}" and reason in detail["message"], r.json()
    assert client.get("/readyz").json()["version"] == before


# The tokenizer reads a text after NFKC normalisation, where one character can become 18: the
# default limit of that form is 2 x MAX_TEXT_CHARS (4,000). U+FB01 (the ligature "fi") is 2
# after it, U+2026 (the ellipsis) 3, U+FDFA 18.
AT_NORMALIZED_LIMIT = "\ufb01" * 2000
PAST_NORMALIZED_LIMIT = "\ufb01" * 1999 + "\u2026"


def test_a_text_that_grows_past_the_limit_under_normalisation_is_a_422_naming_it(client):
    # 2,000 x U+FDFA (36,000 characters to the tokenizer) took 14x the time of ASCII texts of the
    # same length: the limit counted characters before normalisation.
    for body, field in [({"text": "\ufdfa" * 2000}, "body.text"),
                        ({"texts": [AT_NORMALIZED_LIMIT, PAST_NORMALIZED_LIMIT]}, "body.texts[1]")]:
        for route in ("/v1/predict", "/v1/predict/tree"):
            r = client.post(route, json=body)
            assert r.status_code == 422, r.text
            assert [d["field"] for d in r.json()["details"]] == [field], r.json()
            assert "4000 characters after Unicode NFKC normalisation" in r.json()["message"]
    r = client.post("/admin/labels", json={"labels": [{"uid": "grown", "title": PAST_NORMALIZED_LIMIT}]}, headers=AUTH)
    assert r.status_code == 422 and r.json()["details"][0]["field"] == "body.labels[0].title", r.text
    # At the limit: answered, as is a text whose marks NFKC once sorted in quadratic time.
    marks = "e" + "\u0301" * 999 + "\u0316" * 1000
    r = client.post("/v1/predict", json={"texts": [AT_NORMALIZED_LIMIT, "\ufdfa" * 222, marks]})
    assert r.status_code == 200 and len(r.json()["results"]) == 3, r.text


def test_two_authorization_headers_are_refused_not_one_of_them_chosen(client):
    # Which one counts differs along the way (a proxy may check the first, Starlette reads the first).
    for tokens in ((TOKEN, "wrong"), ("wrong", TOKEN), (TOKEN, TOKEN)):
        auth = b"".join(b"authorization: Bearer " + t.encode() + b"\r\n" for t in tokens)
        head = b"GET /admin/bundles HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
        status, body = _exchange(client, head + auth + b"\r\n")
        assert status == 400 and "2 Authorization headers" in body["message"], body


def test_a_path_that_is_not_utf8_once_percent_decoded_is_a_400_naming_it(client):
    # Starlette decodes such bytes as U+FFFD: this was a 404 for the label '\ufffd\ufffd'.
    before = client.get("/readyz").json()["version"]
    status, body = _exchange(client, b"DELETE /admin/labels/%FF%FE HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                             b"authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")
    assert status == 400 and body["details"][0]["field"] == "path", body
    assert "not UTF-8" in body["message"] and "%FF%FE" in body["message"], body
    assert client.get("/readyz").json()["version"] == before
    r = client.delete("/admin/labels/caf%C3%A9-unknown", headers=AUTH)  # UTF-8: looked up, unknown
    assert r.status_code == 404 and "caf\u00e9-unknown" in r.json()["message"], r.text


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/admin/bundles", "/healthz"])
def test_every_get_route_answers_head_with_the_headers_of_get_and_no_body(client, path):
    get, head = client.get(path, headers=AUTH), client.head(path, headers=AUTH)
    assert head.status_code == get.status_code == 200
    assert head.content == b"" and head.headers["content-length"] == str(len(get.content))
    # counted under its route, as HEAD (/openapi.json's GET is "unmatched" too: not an APIRoute)
    route = "unmatched" if path == "/openapi.json" else path
    lines = client.get("/metrics").text.splitlines()
    assert any(f'route="{route}"' in line and 'method="HEAD"' in line for line in lines)
    assert client.head("/v1/predict").status_code == 405  # a POST route is not a GET route


def test_scanning_paths_and_methods_adds_no_metric_series(client):
    before = client.get("/metrics").text.count("shortlist_http_requests_total{")
    for i in range(30):
        client.request(["GET", "POST", "PROPFIND", "DELETE", "PATCH"][i % 5], f"/scan-{i}/x%2Fy")
    after = client.get("/metrics").text
    assert 'route="unmatched"' in after
    # at most one series per method (and the first /metrics answer), not one per path
    assert after.count("shortlist_http_requests_total{") <= before + 6


def _hostile_copy(root, source: str, version: str, edit) -> None:
    """A copy of bundle `source` named `version`, passed to `edit(directory, manifest)`; the
    manifest is written back after (it is not itself checksummed)."""
    shutil.copytree(root / source, root / version)
    manifest = json.loads((root / version / "manifest.json").read_text())
    manifest["version"] = version
    raw = edit(root / version, manifest)
    (root / version / "manifest.json").write_bytes(raw if raw is not None else json.dumps(manifest).encode())


def test_hostile_bundles_are_refused_and_neither_listing_nor_start_up_breaks(bundle_root_copy, tmp_path):
    root = bundle_root_copy
    deep = b"[" * 100_000 + b"]" * 100_000
    # Python's json recursed on the first: the listing answered 500 and start-up died without a word.
    _hostile_copy(root, "v1", "nested", lambda d, m: json.dumps(m).encode()[:-1] + b', "metrics": ' + deep + b"}")
    # Under the parser's depth limit, but deeper than the answer's serializer goes (listing 500).
    _hostile_copy(root, "v1", "deep-metrics", lambda d, m: m.update(metrics={"a": json.loads("[" * 40 + "]" * 40)}))
    # A file that leads outside its bundle (the checksum is the real file's: it matches).
    _hostile_copy(root, "v1", "symlinked", lambda d, m: (d / "labels.jsonl").unlink() or
                  (d / "labels.jsonl").symlink_to(root / "v2" / "labels.jsonl") or m.update(files={
                      **m["files"], "labels.jsonl": json.loads((root / "v2" / "manifest.json").read_text())["files"][
                          "labels.jsonl"]}))
    env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_LOAD_CHECK_IN_CHILD": "false"}
    # The version asked for does not exist: start-up falls back, listing every bundle to do so.
    with serve(root, version="gone", env=env, log_dir=tmp_path) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        served = c.get("/readyz").json()["version"]
        r = c.get("/admin/bundles", headers=AUTH)
        assert r.status_code == 200, r.text
        assert {b["version"] for b in r.json()["bundles"]} == {"v1", "v2", "symlinked"}  # unreadable ones skipped
        for version, named in (("nested", "depth limit"), ("deep-metrics", "nested deeper than 32"),
                               ("symlinked", "symlink leading outside")):
            r = c.post("/admin/bundles/activate", json={"version": version}, headers=AUTH)
            assert r.status_code == 422 and named in r.json()["message"], (version, r.text)
            assert c.post("/v1/predict", json={"text": "x"}).json()["version"] == served
        log = s.log()
    assert '"unhandled_error"' not in log


def test_manifest_records_nest_up_to_the_limit_and_no_deeper(bundle_root):
    from pydantic import ValidationError

    from service.engine.schema import MAX_RECORD_DEPTH, Manifest

    manifest = json.loads((bundle_root / "v1" / "manifest.json").read_text())

    def nested(depth: int) -> dict:  # the record itself is the first level
        return {"a": json.loads("[" * (depth - 1) + "]" * (depth - 1))}

    Manifest.model_validate({**manifest, "metrics": nested(MAX_RECORD_DEPTH)})
    with pytest.raises(ValidationError, match=f"nested deeper than {MAX_RECORD_DEPTH}"):
        Manifest.model_validate({**manifest, "metrics": nested(MAX_RECORD_DEPTH + 1)})


def test_two_content_type_headers_are_refused_not_one_of_them_chosen(client):
    # The body middleware read the last, FastAPI the first: a valid body got a 422 or a 415.
    for types in ((b"text/plain", b"application/json"), (b"application/json", b"text/plain"),
                  (b"application/json", b"application/json")):
        head = b"POST /v1/predict HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 13\r\n"
        status, body = _exchange(client, head + b"".join(b"content-type: " + t + b"\r\n" for t in types)
                                 + b"\r\n" + BODY)
        assert status == 400 and body["error"] == "bad_request", body
        assert "2 Content-Type headers" in body["message"], body
    _still_serving(client)


@pytest.mark.parametrize("route", ["/v1/predict", "/admin/labels"])
def test_an_empty_json_body_is_a_400_naming_it(client, route):
    # It was a 422 "body: field required", while a body of whitespace was a 400 malformed_json.
    for body in (b"", b" "):
        r = client.post(route, content=body, headers={**JSON, **AUTH})
        assert r.status_code == 400 and r.json()["error"] == "malformed_json", (body, r.text)
        assert ("body is empty" in r.json()["message"]) == (body == b""), r.text
    assert client.post(route, content=b"", headers=JSON).status_code == (401 if route.startswith("/admin") else 400)


def test_many_unknown_excluded_uids_are_named_up_to_the_usual_ten(client):
    unknown = [f"no-such-label-{i}" for i in range(1000)]
    r = client.post("/v1/predict", json={"text": "x", "exclude": unknown})
    assert r.status_code == 422, r.text
    assert [d["field"] for d in r.json()["details"]] == [f"body.exclude[{i}]" for i in range(10)]
    assert "and 990 more problems" in r.json()["message"]
    r = client.post("/v1/predict", json={"text": "x", "exclude": ["L0", "nope", "L1"]})
    assert r.status_code == 422 and [d["field"] for d in r.json()["details"]] == ["body.exclude[1]"], r.text


def test_a_stray_body_on_a_route_that_reads_none_is_dropped_not_judged(client):
    # GET /healthz or DELETE /admin/labels/{uid} with a text/plain body answered 415, the DELETE
    # before its token was checked; a body there has no meaning (RFC 9110): only its size counts.
    plain = {"content-type": "text/plain"}
    assert client.request("GET", "/healthz", content=b"hello", headers=plain).status_code == 200
    assert client.request("GET", "/admin/bundles", content=b"hello", headers={**plain, **AUTH}).status_code == 200
    r = client.request("DELETE", "/admin/labels/L1", content=b"hello", headers=plain)
    assert r.status_code == 401 and r.json()["error"] == "unauthorized", r.text
    status, body = _exchange(client, b"GET /healthz HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999\r\n"
                                     b"connection: close\r\n\r\n")
    assert status == 413 and body["error"] == "body_too_large", body
    _still_serving(client)
