"""The prediction service over a real uvicorn: contract, concurrency, every bad input, readiness."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _api_helpers import assert_same_ranking, reference, sample_titles

from shortlist.testing import serve

LIMITS = {
    "SHORTLIST_MAX_TEXT_CHARS": "50",
    "SHORTLIST_MAX_K": "20",
    "SHORTLIST_MAX_BATCH": "8",
    "SHORTLIST_MAX_BODY_BYTES": "2048",
    "SHORTLIST_MAX_EXCLUDE": "3",
    "SHORTLIST_ECHO_ROUTE": "true",
    "SHORTLIST_FAULT_ROUTE": "true",
}


@pytest.fixture(scope="module")
def server(bundle_root, tmp_path_factory):
    with serve(bundle_root, env=LIMITS, log_dir=tmp_path_factory.mktemp("api-logs")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def texts(synthetic_data) -> list[str]:
    return [t[:50] for t in sample_titles(synthetic_data, 40)]


def test_serves_the_newest_bundle_and_names_it(client):
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json() == {"status": "ready", "version": "v2"}
    assert client.get("/healthz").json()["status"] == "ok"


def test_single_text_matches_the_engine_in_process(client, bundle_root, texts):
    want = reference(bundle_root / "v2", texts[:1], k=5)
    r = client.post("/v1/predict", json={"text": texts[0], "k": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"version", "results"} and body["version"] == "v2"
    assert len(body["results"]) == 1 and len(body["results"][0]) == 5
    assert_same_ranking(body["results"][0], want[0])
    assert r.headers["x-request-id"]


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/readyz", None), ("GET", "/healthz", None), ("GET", "/metrics", None), ("HEAD", "/readyz", None),
    ("POST", "/v1/predict", {"text": "x"}), ("POST", "/v1/predict", {"text": 1}), ("GET", "/nowhere", None),
])
def test_no_answer_may_be_stored_by_a_cache_between(client, method, path, body):
    """Each answer is the process's live state or its serving version's: a proxy or CDN in front
    must not hand a stale /readyz or an old version's labels to the next client."""
    r = client.request(method, path, json=body)
    assert r.headers["cache-control"] == "no-store", (path, r.status_code)


def test_batch_of_texts_matches_the_engine_in_process_in_order(client, bundle_root, texts):
    batch = texts[:8]
    want = reference(bundle_root / "v2", batch, k=3)
    r = client.post("/v1/predict", json={"texts": batch, "k": 3})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == len(batch)
    for got, exp in zip(results, want, strict=True):
        assert_same_ranking(got, exp)


@pytest.mark.parametrize("alpha", [0, 0.3, 1])
def test_alpha_override_is_applied(client, bundle_root, texts, alpha):
    want = reference(bundle_root / "v2", texts[:3], k=4, alpha=float(alpha))
    r = client.post("/v1/predict", json={"texts": texts[:3], "k": 4, "alpha": alpha})
    assert r.status_code == 200, r.text
    for got, exp in zip(r.json()["results"], want, strict=True):
        assert_same_ranking(got, exp)


@pytest.mark.parametrize("route", ["/v1/predict", "/v1/predict/tree"])
def test_excluded_labels_are_left_out_and_the_next_ones_move_up(client, bundle_root, texts, route):
    tree = route.endswith("tree")
    plain = client.post(route, json={"texts": texts[:3], "k": 7}).json()["results"]
    # the first text's best two labels and the second text's fourth, excluded from every text
    drop = [plain[0][0], plain[0][1], plain[1][3]]
    uids = [d["uid"] for d in drop]
    want = reference(bundle_root / "v2", texts[:3], k=4, tree=tree, exclude=[d["id"] for d in drop])
    r = client.post(route, json={"texts": texts[:3], "k": 4, "exclude": uids})  # at max_exclude
    assert r.status_code == 200, r.text
    got = r.json()["results"]
    for row, exp in zip(got, want, strict=True):
        assert_same_ranking(row, exp)
        assert not {d["uid"] for d in row} & set(uids)
    # (the second text's fourth label may be among the first text's next ones: it leaves them too)
    assert [d["uid"] for d in got[0]] == [d["uid"] for d in plain[0][2:] if d["uid"] not in uids][:4]
    # a single text goes through the batcher, apart from texts with other exclusions
    # (scores of one text and of a batch of three differ in float noise: BLAS blocks by shape)
    one = client.post(route, json={"text": texts[0], "k": 4, "exclude": uids})
    assert one.status_code == 200
    assert_same_ranking(one.json()["results"][0], got[0])
    alone = client.post(route, json={"text": texts[0], "k": 7, "exclude": []}).json()["results"][0]
    assert_same_ranking(alone, plain[0])


def test_tree_endpoint_matches_the_engine_tree_scorer(client, bundle_root, texts):
    want = reference(bundle_root / "v2", texts[:4], k=5, tree=True)
    r = client.post("/v1/predict/tree", json={"texts": texts[:4], "k": 5})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == "v2"
    for got, exp in zip(r.json()["results"], want, strict=True):
        assert_same_ranking(got, exp)
    # A single text goes through the batcher and must come back the same.
    one = client.post("/v1/predict/tree", json={"text": texts[0], "k": 5, "beam": 8})
    assert one.status_code == 200 and len(one.json()["results"][0]) == 5


def test_200_concurrent_requests_are_all_answered_correctly(server, bundle_root, synthetic_data):
    texts = [t[:50] for t in sample_titles(synthetic_data, 200)]
    want = reference(bundle_root / "v2", texts, k=5)

    # One client shared by the threads: its pool holds up to 32 connections open at once.
    with httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=32)) as c:
        def call(i: int) -> tuple[int, httpx.Response]:
            return i, c.post("/v1/predict", json={"text": texts[i], "k": 5})

        with ThreadPoolExecutor(32) as pool:
            responses = list(pool.map(call, range(len(texts))))
    assert len(responses) == 200
    for i, r in responses:
        assert r.status_code == 200, r.text
        assert r.json()["version"] == "v2"
        assert_same_ranking(r.json()["results"][0], want[i])


BAD_INPUTS = [
    # (name, json body or raw bytes, headers, status, field or error code)
    ("empty text", {"text": ""}, None, 422, "body.text"),
    ("whitespace text", {"text": " \t\n "}, None, 422, "body.text"),
    ("text one past the limit", {"text": "a" * 51}, None, 422, "body.text"),
    ("k zero", {"text": "x", "k": 0}, None, 422, "body.k"),
    ("k one past max_k", {"text": "x", "k": 21}, None, 422, "body.k"),
    ("k as a string", {"text": "x", "k": "3"}, None, 422, "body.k"),
    ("k as a float", {"text": "x", "k": 2.5}, None, 422, "body.k"),
    ("alpha below 0", {"text": "x", "alpha": -0.01}, None, 422, "body.alpha"),
    ("alpha above 1", {"text": "x", "alpha": 1.01}, None, 422, "body.alpha"),
    ("alpha as a string", {"text": "x", "alpha": "0.5"}, None, 422, "body.alpha"),
    ("text as a number", {"text": 5}, None, 422, "body.text"),
    ("texts as a string", {"texts": "abc"}, None, 422, "body.texts"),
    ("empty texts", {"texts": []}, None, 422, "body.texts"),
    ("texts one past max_batch", {"texts": ["a"] * 9}, None, 422, "body.texts"),
    ("blank item in texts", {"texts": ["ok", "  "]}, None, 422, "body.texts[1]"),
    # Unicode whitespace, controls and invisible format characters are blank too (they were 200s).
    *((f"blank text U+{ord(c):04X}", {"text": c * 3}, None, 422, "body.text")
      for c in ("\u00a0", "\u3000", "\u200b", "\x00", "\ufeff", "\U000e0041")),
    ("blank item of mixed blanks", {"texts": ["ok", " \u200b\u00a0\t\u2060"]}, None, 422, "body.texts[1]"),
    ("empty body", b"", None, 400, "malformed_json"),
    ("unknown field", {"text": "x", "top_k": 3}, None, 422, "body.top_k"),
    ("both text and texts", {"text": "x", "texts": ["y"]}, None, 422, "body"),
    ("neither text nor texts", {"k": 3}, None, 422, "body"),
    ("body is a list", ["x"], None, 422, "body"),
    ("beam on the alpha route", {"text": "x", "beam": 4}, None, 422, "body.beam"),
    ("exclude one past max_exclude", {"text": "x", "exclude": ["a", "b", "c", "d"]}, None, 422, "body.exclude"),
    ("exclude as a string", {"text": "x", "exclude": "L1"}, None, 422, "body.exclude"),
    ("exclude with a number", {"text": "x", "exclude": [3]}, None, 422, "body.exclude[0]"),
    ("exclude with an unknown uid", {"text": "x", "exclude": ["no-such-label"]}, None, 422, "body.exclude[0]"),
    ("malformed JSON", b'{"text": "x",', None, 400, "malformed_json"),
    ("non-UTF-8 bytes", b'{"text": "caf\xe9"}', None, 400, "invalid_encoding"),
    ("wrong content type", b'{"text": "x"}', {"content-type": "text/plain"}, 415, "unsupported_media_type"),
    ("no content type", b'{"text": "x"}', {"content-type": ""}, 415, "unsupported_media_type"),
    ("non-UTF-8 charset", b'{"text": "x"}', {"content-type": "application/json; charset=latin-1"}, 415,
     "unsupported_media_type"),
    ("body one past the size limit", b'{"text": "' + b"a" * 2037 + b'"}', None, 413, "body_too_large"),
]


@pytest.mark.parametrize(("name", "body", "headers", "status", "where"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_a_4xx_naming_what_is_wrong(client, name, body, headers, status, where):
    if isinstance(body, bytes):
        hdrs = {"content-type": "application/json", **(headers or {})}
        r = client.post("/v1/predict", content=body, headers={k: v for k, v in hdrs.items() if v})
    else:
        r = client.post("/v1/predict", json=body)
    assert r.status_code == status, (name, r.text)
    err = r.json()
    assert err["message"] and err["request_id"] == r.headers["x-request-id"]
    if where == "body" or where.startswith("body."):
        assert err["error"] == "invalid_request"
        assert where in [d["field"] for d in err["details"]], err
    else:
        assert err["error"] == where
    assert client.get("/healthz").status_code == 200
    assert client.post("/v1/predict", json={"text": "still serving"}).status_code == 200


def test_limits_are_inclusive_at_the_edge(client):
    assert client.post("/v1/predict", json={"text": "a" * 50}).status_code == 200
    assert client.post("/v1/predict", json={"text": "\u00a0x\u200b"}).status_code == 200  # one visible character
    assert client.post("/v1/predict", json={"text": "x", "k": 20}).status_code == 200
    assert client.post("/v1/predict", json={"text": "x", "k": 1}).status_code == 200
    assert client.post("/v1/predict", json={"texts": ["a"] * 8}).status_code == 200
    for alpha in (0.0, 1.0):
        assert client.post("/v1/predict", json={"text": "x", "alpha": alpha}).status_code == 200
    at_limit = b'{"text": "' + b"a" * 36 + b'", "k": 1' + b" " * (2048 - 56) + b"}"
    assert len(at_limit) == 2048
    r = client.post("/v1/predict", content=at_limit, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_chunked_body_past_the_limit_is_refused_with_413(client):
    def chunks():
        yield b'{"texts": ["'
        for _ in range(100):
            yield b"a" * 100

    r = client.post("/v1/predict", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"


def test_each_route_takes_only_its_own_scorers_parameter(client):
    r = client.post("/v1/predict/tree", json={"text": "x", "alpha": 0.5})
    assert r.status_code == 422 and r.json()["details"] == [{"field": "body.alpha", "message": "unknown field"}]
    assert client.post("/v1/predict/tree", json={"text": "x", "beam": 4, "k": 3.0}).status_code == 200


def test_unexpected_error_is_a_500_with_a_logged_request_id_and_service_keeps_serving(client, server):
    r = client.post("/v1/fault", json={})
    assert r.status_code == 500
    rid = r.json()["request_id"]
    assert rid and r.headers["x-request-id"] == rid
    assert "Traceback" not in r.text
    assert client.post("/v1/predict", json={"text": "after the crash"}).status_code == 200
    errors = [json.loads(line) for line in server.log().splitlines() if '"unhandled_error"' in line]
    assert any(e["request_id"] == rid and "RuntimeError" in e["error"] for e in errors)


def test_a_query_parameter_the_route_does_not_take_is_refused_naming_it(client):
    # FastAPI ignored it: `?k=5` answered 10 labels, as if the client had not asked for 5.
    r = client.post("/v1/predict?k=5&alpha=1", json={"text": "x"})
    assert r.status_code == 422 and [d["field"] for d in r.json()["details"]] == ["query.k", "query.alpha"], r.text
    assert "unknown query parameter 'k' (this route takes: none)" in r.json()["message"]
    long_key = client.post(f"/v1/predict/tree?{'q' * 100}=1", json={"text": "x"}).json()
    assert long_key["details"][0]["field"] == "query" and "(100 characters)" in long_key["message"]
    assert client.post("/v1/predict?", json={"text": "x"}).status_code == 200  # an empty query is none


def test_unknown_route_and_method_are_json_4xx(client):
    r = client.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    r = client.get("/v1/predict")
    assert r.status_code == 405 and r.json()["error"] == "method_not_allowed" and r.headers["allow"] == "POST"
    assert client.put("/readyz").headers["allow"] == "GET"
    r = client.get("/v2/a%0Ab%09c")  # named as routed: a decoded LF and tab shown, not dropped
    assert r.status_code == 404 and "'/v2/a\\nb\\tc'" in r.json()["message"], r.text


def test_access_log_is_json_lines_with_request_id_pid_route_status_latency_version(client, server):
    r = client.post("/v1/predict", json={"text": "log me"}, headers={"x-request-id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    # The record is written after the response is sent: give it a moment.
    deadline = time.monotonic() + 10
    while True:
        records = [json.loads(line) for line in server.log().splitlines() if line.startswith('{"ts"')]
        mine = [rec for rec in records if rec["request_id"] == "trace-42"]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(mine) == 1
    rec = mine[0]
    assert rec["route"] == "/v1/predict" and rec["status"] == 200 and rec["version"] == "v2"
    assert rec["latency_ms"] >= 0
    assert rec["pid"] == server.proc.pid  # which process answered (several may share the port)


def test_access_log_off_leaves_the_event_lines_on(bundle_root, tmp_path):
    # SHORTLIST_ACCESS_LOG=false also dropped the INFO events (bundle_activated: "every swap of the
    # served bundle" is logged), since the event logger was set up only with the access log.
    env = {"SHORTLIST_ACCESS_LOG": "false"}
    with serve(bundle_root, env=env, log_dir=tmp_path) as s, httpx.Client(base_url=s.url) as c:
        assert c.post("/v1/predict", json={"text": "x"}, headers={"x-request-id": "quiet-1"}).status_code == 200
        time.sleep(0.5)  # the access record, were there one, is written after the answer
        lines = [json.loads(line) for line in s.log().splitlines() if line.startswith("{")]
    assert any(rec.get("event") == "bundle_activated" and rec["cause"] == "start" for rec in lines), lines
    assert not any(rec.get("request_id") == "quiet-1" for rec in lines)
    # Without SHORTLIST_STATE_DIR nothing is recorded, and the event says so (it said recorded: true).
    assert [rec["recorded"] for rec in lines if rec.get("event") == "bundle_activated"] == [False], lines


def test_metrics_expose_requests_latency_in_flight_version_and_batch_sizes(client):
    client.post("/v1/predict", json={"text": "count me"})
    client.post("/v1/predict", json={"text": ""})
    text = client.get("/metrics").text
    assert 'shortlist_http_requests_total{method="POST",route="/v1/predict",status="200"}' in text
    assert 'shortlist_http_requests_total{method="POST",route="/v1/predict",status="422"}' in text
    assert 'shortlist_http_request_duration_seconds_bucket{le="0.005",route="/v1/predict",status="200"}' in text
    assert "shortlist_http_requests_in_flight" in text
    assert 'shortlist_active_bundle{version="v2"} 1.0' in text
    assert 'shortlist_engine_batch_size_count{scorer="alpha"}' in text


def test_echo_route_is_off_by_default_and_on_when_configured(client, bundle_root, tmp_path):
    r = client.post("/v1/echo", json={"text": "hi"})
    assert r.status_code == 200 and r.json() == {"text": "hi"}
    with serve(bundle_root, log_dir=tmp_path) as plain, httpx.Client(base_url=plain.url) as c:
        assert c.post("/v1/echo", json={"text": "hi"}).status_code == 404
        assert c.post("/v1/fault", json={}).status_code == 404


def test_readiness_is_503_until_a_validated_bundle_is_loaded(bundle_root, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    token = "readiness-admin-t0ken"
    env = {"SHORTLIST_ADMIN_TOKEN": token}
    with serve(root, env=env, ready=False, log_dir=tmp_path) as s, httpx.Client(base_url=s.url) as c:
        assert c.get("/healthz").status_code == 200
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["status"] == "not ready"
        # Why, for an operator who finds it not ready (the start-up's refusal, as its log line says).
        assert r.json()["reason"].startswith("start-up could not serve a bundle: "), r.json()
        r = c.post("/v1/predict", json={"text": "x"})
        assert r.status_code == 503 and r.json()["error"] == "not_ready"
        shutil.copytree(bundle_root / "v1", root / "v1")
        r = c.post("/admin/bundles/activate", json={"version": "v1"}, headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 200, r.text
        assert c.get("/readyz").json() == {"status": "ready", "version": "v1"}
        assert c.post("/v1/predict", json={"text": "x"}).json()["version"] == "v1"


def test_tree_route_on_a_bundle_without_tree_is_a_clear_409(bundle_root, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(bundle_root / "v1", root / "v1")
    manifest = json.loads((root / "v1" / "manifest.json").read_text())
    del manifest["files"]["tree.npz"]
    (root / "v1" / "manifest.json").write_text(json.dumps(manifest))
    (root / "v1" / "tree.npz").unlink()
    with serve(root, log_dir=tmp_path) as s, httpx.Client(base_url=s.url) as c:
        r = c.post("/v1/predict/tree", json={"text": "x"})
        assert r.status_code == 409 and r.json()["error"] == "no_tree_scorer", r.text
        assert "no tree scorer" in r.json()["message"]
        assert c.post("/v1/predict", json={"text": "x"}).status_code == 200


def test_version_flag_overrides_the_environment(bundle_root, tmp_path):
    env = {"SHORTLIST_VERSION": "v2"}
    with serve(bundle_root, version="v1", env=env, log_dir=tmp_path) as s, httpx.Client(base_url=s.url) as c:
        assert c.post("/v1/predict", json={"text": "x"}).json()["version"] == "v1"


def test_openapi_documents_the_running_limits_and_every_status(client):
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    one, batch = schemas["PredictRequest"]["oneOf"]  # exactly one of text and texts, each a whole object
    assert set(one["properties"]) == {"text", "k", "alpha", "exclude"} and one["required"] == ["text"]
    assert set(batch["properties"]) == {"texts", "k", "alpha", "exclude"} and batch["required"] == ["texts"]
    assert one["additionalProperties"] is False and batch["additionalProperties"] is False
    # the limits are this server's settings (LIMITS), not the defaults
    assert one["properties"]["text"]["maxLength"] == 50 and one["properties"]["k"]["maximum"] == 20
    assert batch["properties"]["texts"]["maxItems"] == 8 and batch["properties"]["texts"]["minItems"] == 1
    assert batch["properties"]["texts"]["items"]["maxLength"] == 50
    assert one["properties"]["exclude"]["anyOf"][0]["maxItems"] == 3
    tree_one, tree_batch = schemas["TreePredictRequest"]["oneOf"]
    assert set(tree_one["properties"]) == {"text", "k", "beam", "exclude"}
    assert set(tree_batch["properties"]) == {"texts", "k", "beam", "exclude"}
    predict = spec["paths"]["/v1/predict"]["post"]["responses"]
    assert {"200", "400", "413", "415", "422", "503"} <= set(predict)
    assert "409" in spec["paths"]["/v1/predict/tree"]["post"]["responses"]
    assert predict["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


def test_openapi_names_each_operation_once_and_every_get_route_answers_head(client):
    # /healthz, /readyz and /metrics were listed for GET and HEAD under one operationId each:
    # OpenAPI requires them unique, and client generators refuse the schema.
    spec = client.get("/openapi.json").json()
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for path, ops in spec["paths"].items():
        if "get" in ops and "{" not in path:
            r = client.head(path)
            assert r.status_code == client.get(path).status_code and r.content == b"", path


def test_serve_refuses_a_missing_bundle_root(tmp_path):
    r = subprocess.run([sys.executable, "-m", "shortlist.cli", "serve", "--bundle-root", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bundle root" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(("variable", "value"), [
    ("SHORTLIST_WORKERS", "0"),
    ("SHORTLIST_HEAP_TUNING", "maybe"),
    ("SHORTLIST_MAX_TEXT_CHAR", "100"),  # misspelt: not a setting
])
def test_serve_refuses_an_invalid_setting_naming_it(bundle_root, variable, value):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHORTLIST_")}
    env[variable] = value
    r = subprocess.run([sys.executable, "-m", "shortlist.cli", "serve", "--bundle-root", str(bundle_root)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0
    assert variable.removeprefix("SHORTLIST_").lower() in r.stderr.lower()


@pytest.mark.parametrize("access_log", ["true", "false"])
def test_serve_refuses_a_log_level_uvicorn_lacks_naming_it(bundle_root, access_log):
    # It was a traceback from uvicorn (exit 1) with the access log off, else "Unknown level: 'VERBOSE'".
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHORTLIST_")}
    env.update({"SHORTLIST_LOG_LEVEL": "verbose", "SHORTLIST_ACCESS_LOG": access_log})
    r = subprocess.run([sys.executable, "-m", "shortlist.cli", "serve", "--bundle-root", str(bundle_root)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == ("shortlist serve: error: SHORTLIST_LOG_LEVEL='verbose': not a log level: use one of "
                                "critical, error, warning, info, debug, trace")


@pytest.mark.parametrize("level", ["trace", "DEBUG", "Warning"])
def test_serve_takes_every_uvicorn_log_level_in_any_case(bundle_root, tmp_path, level):
    env = {"SHORTLIST_LOG_LEVEL": level}
    with serve(bundle_root, env=env, log_dir=tmp_path) as s, httpx.Client(base_url=s.url) as c:
        assert c.post("/v1/predict", json={"text": "x"}).status_code == 200


@pytest.mark.parametrize(("field", "inside", "outside"), [
    ("loader_nice", [0, 19], [-1, 20]),
    ("heap_tuning", [True, False], ["maybe", 2]),
    ("huge_pages", [True, False], ["maybe", 2]),
    ("max_exclude", [0, 5000], [-1, "many"]),
    ("max_normalized_chars", [2000, 10**6], [1999, 0]),  # below max_text_chars (2000): refused
])
def test_new_settings_are_bounded_at_and_past_the_edge(field, inside, outside):
    from pydantic import ValidationError

    from service.api.settings import Settings

    for value in inside:
        assert getattr(Settings(**{field: value}), field) == value
    for value in outside:
        with pytest.raises(ValidationError, match=field):
            Settings(**{field: value})


def _deep(depth: int, kind: str) -> bytes:
    return (b"[" * depth + b"]" * depth) if kind == "array" else (b'{"a":' * depth + b"1" + b"}" * depth)


def _parser_abuse() -> list[tuple[str, bytes, str]]:
    """Bodies that make a JSON parser recurse or convert without bound, wherever they sit."""
    cases = []
    for depth in (2_000, 5_000, 50_000):  # the parser stops past 1024 levels
        for kind in ("array", "object"):
            value = _deep(depth, kind)
            cases += [(f"{kind} nested {depth} deep as k", b'{"text": "x", "k": ' + value + b"}", "too deeply"),
                      (f"{kind} nested {depth} deep, unknown field", b'{"zz": ' + value + b', "text": "x"}',
                       "too deeply"),
                      (f"{kind} nested {depth} deep, whole body", value, "too deeply")]
    for digits in (4_301, 20_000, 200_000):
        number = b"1" * digits
        cases += [(f"{digits}-digit k", b'{"text": "x", "k": ' + number + b"}", "too many digits"),
                  (f"negative {digits}-digit exclude item", b'{"text": "x", "exclude": [-' + number + b"]}",
                   "too many digits"),
                  (f"{digits}-digit unknown field", b'{"text": "x", "zz": ' + number + b"}", "too many digits")]
    return cases


@pytest.fixture(scope="module")
def roomy_server(bundle_root, tmp_path_factory):
    """Default body limit (1 MiB): room for bodies that abuse the parser."""
    with serve(bundle_root, env={"SHORTLIST_ACCESS_LOG": "false"}, log_dir=tmp_path_factory.mktemp("roomy")) as s:
        yield s


def test_parser_abuse_is_a_400_naming_it_and_the_server_keeps_serving(roomy_server):
    with httpx.Client(base_url=roomy_server.url, timeout=30) as c:
        for name, body, reason in _parser_abuse():
            t0 = time.perf_counter()
            r = c.post("/v1/predict", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"] == "malformed_json", (name, r.text[:300])
            assert reason in r.json()["message"], (name, r.json())
            assert time.perf_counter() - t0 < 5, name  # refused, not computed
        assert c.post("/v1/predict", json={"text": "still serving"}).status_code == 200
        assert 'status="500"' not in c.get("/metrics").text
