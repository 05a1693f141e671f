"""Admin hot swap over a real uvicorn: auth, listing, activation, rollback, refusal, swaps under load."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from _api_helpers import assert_same_ranking, flip_a_byte, reference, renamed_copy, sample_titles

from shortlist.bundle_fuzz import index_of, make_variant
from shortlist.testing import serve

TOKEN = "s3cret-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def corrupt_copy(root: Path, source: str, version: str) -> None:
    """ROOT/version: a copy of `source` renamed consistently, with one byte of classifiers.npy flipped."""
    flip_a_byte(renamed_copy(root, source, version) / "classifiers.npy")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _settled_rss(pid: int, bound: float, timeout: float = 30.0) -> int:
    """The process's RSS once it is within `bound`, or its last reading after `timeout`: a retired
    bundle drains and is released on a thread of its own, later on a loaded machine; a leak never
    gets back under the bound."""
    deadline = time.monotonic() + timeout
    while (rss := rss_bytes(pid)) > bound and time.monotonic() < deadline:
        time.sleep(0.5)
    return rss


@pytest.fixture
def admin_server(bundle_root_copy, tmp_path):
    with serve(bundle_root_copy, env={"SHORTLIST_ADMIN_TOKEN": TOKEN}, log_dir=tmp_path) as s:
        yield s


@pytest.fixture(scope="module")
def shared_admin_server(bundle_root, tmp_path_factory):
    """One server for the tests that must leave its state as they found it (each checks that
    v2 still serves): refused requests change nothing."""
    with serve(bundle_root, env={"SHORTLIST_ADMIN_TOKEN": TOKEN}, log_dir=tmp_path_factory.mktemp("admin")) as s:
        yield s


def test_admin_is_off_without_a_token(bundle_root, tmp_path):
    with serve(bundle_root, log_dir=tmp_path) as s, httpx.Client(base_url=s.url) as c:
        assert c.get("/admin/bundles", headers=AUTH).status_code == 404
        assert c.post("/admin/bundles/activate", json={"version": "v1"}, headers=AUTH).status_code == 404


def test_auth_missing_is_401_and_wrong_is_403(shared_admin_server):
    with httpx.Client(base_url=shared_admin_server.url) as c:
        for method, path, body in (("GET", "/admin/bundles", None),
                                   ("POST", "/admin/bundles/activate", {"version": "v1"}),
                                   ("POST", "/admin/bundles/rollback", None)):
            r = c.request(method, path, json=body)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
            r = c.request(method, path, json=body, headers={"authorization": "Basic abc"})
            assert r.status_code == 401
            r = c.request(method, path, json=body, headers={"authorization": "Bearer wrong"})
            assert r.status_code == 403 and r.json()["error"] == "forbidden"
            r = c.request(method, path, json=body, headers={"authorization": f"Bearer {TOKEN}x"})
            assert r.status_code == 403
        # Nothing changed hands.
        assert c.get("/readyz").json()["version"] == "v2"


def test_openapi_declares_the_bearer_token_on_every_admin_route_and_no_other(shared_admin_server):
    """A client generated from /openapi.json sends the token where it is needed: the admin
    routes' bearer scheme is declared (it was not: generated clients sent no Authorization)."""
    spec = httpx.get(f"{shared_admin_server.url}/openapi.json").json()
    assert spec["components"]["securitySchemes"]["admin_token"] == {
        "type": "http", "scheme": "bearer", "description": "SHORTLIST_ADMIN_TOKEN (401 without it, 403 a wrong one)"}
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            declared = op.get("security") == [{"admin_token": []}]
            assert declared == path.startswith("/admin/"), (method, path, op.get("security"))
            if declared:
                assert {"401", "403"} <= set(op["responses"]), (method, path)


def test_list_activate_and_rollback(admin_server):
    with httpx.Client(base_url=admin_server.url, headers=AUTH, timeout=60) as c:
        listing = c.get("/admin/bundles").json()
        assert listing["active"] == "v2"
        rows = {b["version"]: b for b in listing["bundles"]}
        assert set(rows) == {"v1", "v2"}
        assert rows["v2"]["active"] and not rows["v1"]["active"]
        assert rows["v1"]["created_at"] and isinstance(rows["v1"]["metrics"], dict)

        r = c.post("/admin/bundles/activate", json={"version": "v1"})
        assert r.status_code == 200, r.text
        assert r.json()["active"] == "v1" and r.json()["previous"] == "v2"
        assert c.post("/v1/predict", json={"text": "x"}).json()["version"] == "v1"
        assert c.get("/admin/bundles").json()["active"] == "v1"

        r = c.post("/admin/bundles/rollback")
        assert r.status_code == 200 and r.json()["active"] == "v2"
        assert c.post("/v1/predict", json={"text": "x"}).json()["version"] == "v2"
        r = c.post("/admin/bundles/rollback")  # history is used up
        assert r.status_code == 404 and "roll back" in r.json()["message"]

        metrics = c.get("/metrics").text
        assert "shortlist_bundle_swaps_total 3.0" in metrics  # startup + activate + rollback
        assert 'shortlist_active_bundle{version="v2"} 1.0' in metrics


@pytest.mark.parametrize(("version", "status", "fragment"), [
    ("nope", 404, "no bundle 'nope'"),
    ("../v1", 422, "use 1-64 letters"),
    ("v1/../v2", 422, "use 1-64 letters"),
    (".hidden", 422, "use 1-64 letters"),
    ("a" * 65, 422, "use 1-64 letters"),
    ("v1\n", 422, "use 1-64 letters"),
    ("", 422, "use 1-64 letters"),
])
def test_bad_version_names_are_refused(shared_admin_server, version, status, fragment):
    with httpx.Client(base_url=shared_admin_server.url, headers=AUTH) as c:
        r = c.post("/admin/bundles/activate", json={"version": version})
        assert r.status_code == status and fragment in r.json()["message"], r.text
        assert c.get("/readyz").json()["version"] == "v2"


def test_activate_body_is_validated(shared_admin_server):
    with httpx.Client(base_url=shared_admin_server.url, headers=AUTH) as c:
        r = c.post("/admin/bundles/activate", json={"version": 3})
        assert r.status_code == 422 and r.json()["details"][0]["field"] == "body.version"
        r = c.post("/admin/bundles/activate", json={"version": "v1", "force": True})
        assert r.status_code == 422 and r.json()["details"][0]["field"] == "body.force"


def test_symlink_escaping_the_root_is_refused(admin_server, bundle_root_copy, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(bundle_root_copy / "v1", outside / "v1")
    os.symlink(outside / "v1", bundle_root_copy / "evil")
    with httpx.Client(base_url=admin_server.url, headers=AUTH) as c:
        r = c.post("/admin/bundles/activate", json={"version": "evil"})
        assert r.status_code == 422 and "outside the bundle root" in r.json()["message"], r.text
        assert c.get("/readyz").json()["version"] == "v2"


def test_corrupted_bundle_is_refused_and_the_old_one_keeps_serving(admin_server, bundle_root_copy):
    corrupt_copy(bundle_root_copy, "v1", "v3bad")
    with httpx.Client(base_url=admin_server.url, headers=AUTH, timeout=60) as c:
        r = c.post("/admin/bundles/activate", json={"version": "v3bad"})
        assert r.status_code == 422, r.text
        assert "classifiers.npy" in r.json()["message"] and "sha256" in r.json()["message"]
        assert c.get("/readyz").json()["version"] == "v2"
        assert c.post("/v1/predict", json={"text": "x"}).json()["version"] == "v2"
        assert 'shortlist_bundle_activation_failures_total{reason="invalid"} 1.0' in c.get("/metrics").text


def test_quality_gate_refuses_a_bundle_below_the_floor(bundle_root_copy, tmp_path):
    env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_QUALITY_GATE_MIN_P1": "0"}
    with serve(bundle_root_copy, env=env, log_dir=tmp_path) as s, httpx.Client(base_url=s.url, headers=AUTH) as c:
        r = c.post("/admin/bundles/activate", json={"version": "v1"})
        assert r.status_code == 200 and "P@1" in r.json()["quality"], r.text
    env["SHORTLIST_QUALITY_GATE_MIN_P1"] = "100"
    with serve(bundle_root_copy, env=env, ready=False, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH) as c:
        # Not ready means the startup activation (of v2, which fails the same gate) may still
        # be running; a client retries a 409 until it is over.
        deadline = time.monotonic() + 60
        while (r := c.post("/admin/bundles/activate", json={"version": "v1"})).status_code == 409:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)
        assert r.status_code == 422 and "quality gate failed" in r.json()["message"], r.text


def test_simultaneous_activations_over_http_are_200_or_409(admin_server):
    def swap(route: str) -> httpx.Response:
        with httpx.Client(base_url=admin_server.url, headers=AUTH, timeout=60) as c:
            if route == "rollback":
                return c.post("/admin/bundles/rollback")
            return c.post("/admin/bundles/activate", json={"version": route})

    busy = []
    for _ in range(20):  # until a request has met another's activation in progress
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(swap, ["v1", "v2", "rollback", "v1"] * 2))
        assert all(r.status_code in (200, 404, 409) for r in responses), [r.text for r in responses]
        assert any(r.status_code == 200 for r in responses)
        busy += [r for r in responses if r.status_code == 409]
        if busy:
            break
    assert busy and all(r.json()["error"] == "activation_in_progress" for r in busy)


def test_separate_admin_port(bundle_root, tmp_path):
    env = {"SHORTLIST_ADMIN_TOKEN": TOKEN}
    with serve(bundle_root, env=env, admin_port=True, log_dir=tmp_path) as s:
        assert s.admin_url is not None
        with httpx.Client(base_url=s.url) as c:
            assert c.get("/admin/bundles", headers=AUTH).status_code == 404
        with httpx.Client(base_url=s.admin_url, headers=AUTH, timeout=60) as c:
            assert c.get("/admin/bundles").json()["active"] == "v2"
            assert c.post("/admin/bundles/activate", json={"version": "v1"}).status_code == 200
        with httpx.Client(base_url=s.url) as c:
            assert c.post("/v1/predict", json={"text": "x"}).json()["version"] == "v1"


def test_swaps_under_load_fail_nothing_and_every_answer_matches_its_version(
    bundle_root_copy, synthetic_data, tmp_path
):
    texts = [t[:200] for t in sample_titles(synthetic_data, 12)]
    expected = {
        (v, scorer): reference(bundle_root_copy / v, texts, k=5, tree=scorer == "tree")
        for v in ("v1", "v2") for scorer in ("alpha", "tree")
    }
    corrupt_copy(bundle_root_copy, "v1", "v3bad")
    # Faults a checksum cannot see (it is recomputed): each once crashed or misled the service.
    faulty = {"v3graph": ("hnsw_w.bin", "neighbour_out_of_range"), "v3entry": ("hnsw_mu.bin", "header_out_of_range"),
              "v3nan": ("centroids.npy", "nan"), "v3onnx": ("encoder.onnx", "embedding_short")}
    for version, (file, kind) in faulty.items():
        template = bundle_root_copy / "v1"
        make_variant(template, bundle_root_copy, 7, index_of(template, file, kind), version=version)
    # With the opt-in swap tricks on (niced loader threads, the tuned heap): the configuration
    # with the most to get wrong; the other activation tests run with the defaults (off).
    env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_HEAP_TUNING": "true", "SHORTLIST_LOADER_NICE": "10"}
    with serve(bundle_root_copy, env=env, log_dir=tmp_path) as s:
        stop = threading.Event()
        answers: list[tuple[str, int, httpx.Response]] = []
        failures: list[str] = []

        def load(worker: int) -> None:
            route, scorer = ("/v1/predict/tree", "tree") if worker % 2 else ("/v1/predict", "alpha")
            with httpx.Client(base_url=s.url, timeout=60) as c:
                i = worker
                while not stop.is_set():
                    idx = i % len(texts)
                    try:
                        r = c.post(route, json={"text": texts[idx], "k": 5})
                    except httpx.HTTPError as exc:
                        failures.append(f"{route}: {exc!r}")
                        continue
                    answers.append((scorer, idx, r))
                    i += 1

        with httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as admin:
            # Warm up: both bundles have been loaded once before the baseline.
            for v in ("v1", "v2"):
                assert admin.post("/admin/bundles/activate", json={"version": v}).status_code == 200
            time.sleep(0.3)
            rss_before = rss_bytes(s.proc.pid)

            threads = [threading.Thread(target=load, args=(w,)) for w in range(4)]
            for t in threads:
                t.start()
            outcomes = []
            plan = ["v1", "v2"] * 10
            refused = ("v3graph", "v3bad", "v3entry", "missing", "v3nan", "v3onnx")
            for at, version in zip((3, 7, 10, 13, 16, 19), refused, strict=True):
                plan.insert(at, version)
            for v in plan:
                r = admin.post("/admin/bundles/activate", json={"version": v})
                outcomes.append((v, r.status_code, r.json()))
                if v not in ("v1", "v2"):
                    # The bundle serving before the refused one is still answering.
                    assert admin.get("/readyz").json()["version"] == outcomes[-2][0]
                time.sleep(0.05)
            stop.set()
            for t in threads:
                t.join()
            rss_after = _settled_rss(s.proc.pid, 1.10 * rss_before)

        assert not failures, failures[:5]
        by_version = {v: status for v, status, _ in outcomes}
        assert [st for v, st, _ in outcomes if v in ("v1", "v2")] == [200] * 20
        assert by_version["v3bad"] == 422 and by_version["missing"] == 404
        for v, status, body in outcomes:
            if v in faulty:
                assert status == 422 and faulty[v][0] in body["message"], (v, body)
        assert len(answers) > 100
        seen = set()
        for scorer, idx, r in answers:
            assert r.status_code == 200, r.text
            body = r.json()
            seen.add(body["version"])
            assert_same_ranking(body["results"][0], expected[(body["version"], scorer)][idx])
        assert seen == {"v1", "v2"}
        print(f"RSS before {rss_before / 1e6:.1f} MB, after {rss_after / 1e6:.1f} MB, {len(answers)} answers")
        assert rss_after <= 1.10 * rss_before, (rss_before, rss_after)


def _checking_process(server_pid: int, timeout: float = 30.0) -> int:
    """The pid of the server's child process that checks a bundle before it is loaded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == server_pid and b"service.engine.isolated" in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.005)
    raise AssertionError("no checking process appeared")


@pytest.mark.parametrize(("sig", "env", "fragment"), [
    # What native code crashing on a bundle looks like from outside (here the signal comes
    # from the test): the checking process dies, the serving one refuses and goes on.
    (signal.SIGSEGV, {}, "crashed the checking process (SIGSEGV)"),
    # The OOM killer's signal, said as what it most likely is.
    (signal.SIGKILL, {}, "the checking process was killed (SIGKILL) while loading it: most likely out of memory"),
    # A hang: the checking process stops making progress and is killed at the timeout.
    (signal.SIGSTOP, {"SHORTLIST_LOAD_CHECK_TIMEOUT_S": "3"}, "did not finish within 3 s"),
])
def test_a_load_that_kills_or_hangs_its_checking_process_is_refused_and_serving_goes_on(
    bundle_root, tmp_path, sig, env, fragment
):
    with serve(bundle_root, env={"SHORTLIST_ADMIN_TOKEN": TOKEN, **env}, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=60) as c, ThreadPoolExecutor(1) as pool:
        activation = pool.submit(c.post, "/admin/bundles/activate", json={"version": "v1"})
        os.kill(_checking_process(s.proc.pid), sig)
        r = activation.result()
        assert r.status_code == 422 and fragment in r.json()["message"], r.text
        assert s.proc.poll() is None
        assert c.get("/readyz").json()["version"] == "v2"
        assert c.post("/v1/predict", json={"text": "x"}).json()["version"] == "v2"
        if sig != signal.SIGSTOP:
            # The same bundle, checked without interference, activates.
            assert c.post("/admin/bundles/activate", json={"version": "v1"}).status_code == 200


@pytest.mark.skipif(not Path("/proc/self/oom_score_adj").exists(), reason="no OOM score to read (not Linux)")
def test_the_checking_process_is_the_first_the_oom_killer_picks(bundle_root, tmp_path):
    """A bundle too large for a container's memory limit must kill the checking child (a refusal
    naming the bundle), not the serving process: at start-up the kernel picked the server (exit 137)."""
    with serve(bundle_root, env={"SHORTLIST_ADMIN_TOKEN": TOKEN}, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=60) as c, ThreadPoolExecutor(1) as pool:
        activation = pool.submit(c.post, "/admin/bundles/activate", json={"version": "v1"})
        child = _checking_process(s.proc.pid)
        scores = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "1000" not in scores:
            try:
                scores.append(Path(f"/proc/{child}/oom_score_adj").read_text().strip())
            except OSError:  # it finished: its score was read before or never set
                break
            time.sleep(0.005)
        assert activation.result().status_code == 200
        assert scores and scores[-1] == "1000", scores
        assert Path(f"/proc/{s.proc.pid}/oom_score_adj").read_text().strip() != "1000"


def test_the_bundle_list_is_paged_under_max_listed_bundles(bundle_root_copy, tmp_path):
    """Audit s25 F2: GET /admin/bundles listed every version of every place in one answer, each row
    with its manifest's metrics: no limit, no paging (2.1 MB at 1,000 versions of a small bundle).
    Now a page of at most `limit` (default and ceiling SHORTLIST_MAX_LISTED_BUNDLES), oldest first,
    with `total` and the `next_offset` to page on; past the ceiling a 422 naming the parameter."""
    for i in range(3):
        renamed_copy(bundle_root_copy, "v1", f"p{i}")
    env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_MAX_LISTED_BUNDLES": "2"}
    with serve(bundle_root_copy, version="v1", env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=60) as c:
        pages, offset = [], 0
        while offset is not None:
            body = c.get("/admin/bundles", params={"offset": offset}).json()
            assert body["total"] == 5 and len(body["bundles"]) <= 2 and body["active"] == "v1", body
            pages.append([b["version"] for b in body["bundles"]])
            offset = body["next_offset"]
        assert [len(p) for p in pages] == [2, 2, 1]
        listed = [v for p in pages for v in p]
        assert sorted(listed) == ["p0", "p1", "p2", "v1", "v2"] and len(set(listed)) == 5
        one = c.get("/admin/bundles", params={"limit": 1, "offset": 4}).json()
        assert [b["version"] for b in one["bundles"]] == pages[-1] and one["next_offset"] is None
        assert c.get("/admin/bundles", params={"offset": 9}).json()["bundles"] == []
        for params, field in (({"limit": 3}, "query.limit"), ({"limit": 0}, "query.limit"),
                              ({"offset": -1}, "query.offset"), ({"offset": "0.0"}, "query.offset"),
                              ({"limit": "1e1"}, "query.limit"), ({"limit": "+2"}, "query.limit")):
            r = c.get("/admin/bundles", params=params)
            assert r.status_code == 422 and r.json()["details"][0]["field"] == field, r.text
        wrong = {"authorization": "Bearer wrong"}
        assert c.get("/admin/bundles", params={"limit": 3}, headers=wrong).status_code == 403  # the token first


def test_a_directory_whose_manifest_is_refused_is_logged_once_not_at_every_listing(bundle_root_copy, tmp_path):
    """Audit s25 F3: every listing (each GET /admin/bundles, label change, activation) logged a
    warning per directory of the bundle root whose manifest is refused: 50 such directories and 10
    GETs wrote 600 lines. Now each is said once, and again when its reason changes."""
    for name in ("bad0", "bad1"):
        (bundle_root_copy / name).mkdir()
        (bundle_root_copy / name / "manifest.json").write_text("{garbage")
    with serve(bundle_root_copy, version="v1", env={"SHORTLIST_ADMIN_TOKEN": TOKEN}, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=60) as c:
        for _ in range(5):
            assert [b["version"] for b in c.get("/admin/bundles").json()["bundles"]] == ["v1", "v2"]
        assert c.post("/admin/bundles/activate", json={"version": "v2"}).status_code == 200
        assert s.log().count("bundle bad0 not listed") == 1 and s.log().count("bundle bad1 not listed") == 1
        (bundle_root_copy / "bad1" / "manifest.json").write_text("[]")  # another reason: said again
        c.get("/admin/bundles")
        c.get("/admin/bundles")
        assert s.log().count("bundle bad0 not listed") == 1 and s.log().count("bundle bad1 not listed") == 2
