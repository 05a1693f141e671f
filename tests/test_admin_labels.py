"""Labels added and retired live over a real uvicorn: serving at once, queued in order, validated,
durable across restarts and rollbacks, and no failed request meanwhile."""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import httpx
import pytest
from test_admin import AUTH, TOKEN
from test_label_changes import _label_rows, _new_labels, _repeat_a_uid
from test_processes import _wait_for

from service.api.active_state import ActiveVersionFile
from service.api.registry import BundleRegistry, TooManyPendingChanges
from service.engine import canary
from service.engine.bundle import Bundle
from service.engine.label_changes import LabelChange, NewLabel
from service.engine.predictor import Predictor
from service.engine.schema import sha256_file
from service.engine.store import BundleStore
from shortlist.testing import serve


def _env(state_dir, **extra: str) -> dict[str, str]:
    return {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(state_dir), **extra}


def _body(labels) -> dict:
    return {"labels": [{"uid": lab.uid, "title": lab.title} for lab in labels]}


def _uids(client: httpx.Client, texts: list[str], path: str = "/v1/predict", k: int = 5) -> list[list[str]]:
    r = client.post(path, json={"texts": texts, "k": k})
    assert r.status_code == 200, r.text
    return [[label["uid"] for label in row] for row in r.json()["results"]]


class _Load:
    """Clients predicting until stopped; every answer that is not a 200 is kept."""

    def __init__(self, url: str, texts: list[str], clients: int = 2) -> None:
        self.url, self.texts, self.failures, self.answers = url, texts, [], 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, seed: int) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            i = seed
            while not self._stop.is_set():
                path = "/v1/predict/tree" if i % 3 == 2 else "/v1/predict"
                try:
                    r = c.post(path, json={"text": self.texts[i % len(self.texts)], "k": 5})
                    if r.status_code != 200:
                        self.failures.append((r.status_code, r.text))
                except httpx.HTTPError as exc:
                    self.failures.append((0, repr(exc)))
                self.answers += 1
                i += 1
                self._stop.wait(0.01)  # steady traffic, not a CPU hog on a small CI machine

    def __enter__(self) -> _Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def test_labels_added_and_retired_live_serve_at_once_survive_restarts_and_fail_no_request(
        bundle_root, synthetic_data, tmp_path):
    state = tmp_path / "state"
    added = _new_labels(synthetic_data, 12)
    texts = [r["title"] for r in _label_rows(synthetic_data)[:30]]
    with serve(bundle_root, env=_env(state), log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        with _Load(s.url, texts) as load:
            first = c.post("/admin/labels", json=_body(added[:6]))
            assert first.status_code == 200, first.text
            assert first.json()["active"] == "v2.labels-1" and first.json()["tree_labels"] == 300
            second = c.post("/admin/labels", json=_body(added[6:]))
            retired = c.post("/admin/labels/retire", json={"uids": [added[0].uid, added[7].uid]})
            one = c.delete(f"/admin/labels/{added[1].uid}")
        assert [r.status_code for r in (second, retired, one)] == [200, 200, 200], (second.text, retired.text, one.text)
        assert load.failures == [] and load.answers > 20
        assert one.json()["active"] == "v2.labels-4" and one.json()["previous"] == "v2.labels-3"
        live = added[2:7] + added[8:]
        tops = _uids(c, [lab.title for lab in added])
        assert sum(lab.uid in top for lab, top in zip(live, [tops[i] for i in (2, 3, 4, 5, 6, 8, 9, 10, 11)],
                                                         strict=True)) >= 7
        gone = {added[0].uid, added[1].uid, added[7].uid}
        assert not gone & {uid for top in tops for uid in top}
        # The tree serves the trained labels only, and never a retired one.
        tree = _uids(c, [lab.title for lab in added] + texts, "/v1/predict/tree")
        assert not {lab.uid for lab in added} & {uid for top in tree for uid in top}
        listing = c.get("/admin/bundles").json()
        places = {b["version"]: b["place"] for b in listing["bundles"]}
        assert places["v2"] == "root" and places["v2.labels-4"] == "state"
        derived = next(b for b in listing["bundles"] if b["version"] == "v2.labels-4")
        assert derived["lineage"] == {"parent": "v2.labels-3", "base": "v2", "added": 0, "retired": 1,
                                      "tree_labels": 300} and derived["num_labels"] == 312
    assert not any(p.name.startswith(".") for p in (state / "bundles").iterdir())  # no staging left
    # A restart serves exactly the labels that were live before it; rollback steps back one change.
    with serve(bundle_root, env=_env(state), log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        assert c.get("/readyz").json()["version"] == "v2.labels-4"
        assert _uids(c, [lab.title for lab in added]) == tops
        # The versions served before are kept in the state directory: rollback undoes the retirement.
        r = c.post("/admin/bundles/rollback")
        assert r.status_code == 200 and r.json()["active"] == "v2.labels-3", r.text
        assert added[1].uid in _uids(c, [added[1].title])[0]
        r = c.post("/admin/bundles/activate", json={"version": "v2.labels-4"})
        assert r.status_code == 200
        assert added[1].uid not in _uids(c, [added[1].title])[0]


def test_retiring_all_but_one_trained_label_at_once_is_accepted_and_a_tree_with_none_left_is_a_409(
        bundle_root, synthetic_data, tmp_path):
    rows = _label_rows(synthetic_data)
    texts = [r["title"] for r in rows[:20]]
    added = _new_labels(synthetic_data, 1)
    with serve(bundle_root, env=_env(tmp_path / "state"), log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        r = c.post("/admin/labels/retire", json={"uids": [row["uid"] for row in rows[1:]]})
        assert r.status_code == 200, r.text
        assert _uids(c, texts, "/v1/predict/tree") == [[rows[0]["uid"]]] * len(texts)
        assert {uid for top in _uids(c, texts) for uid in top} <= {rows[0]["uid"]}
        r = c.post("/admin/labels", json=_body(added))
        assert r.status_code == 200, r.text
        # The tree's last label retired: the tree has no label to answer any text with.
        r = c.delete(f"/admin/labels/{rows[0]['uid']}")
        assert r.status_code == 200, r.text
        r = c.post("/v1/predict/tree", json={"texts": texts})
        assert r.status_code == 409 and r.json()["error"] == "no_tree_scorer", r.text
        assert "retired" in r.json()["message"]
        assert _uids(c, [added[0].title]) == [[added[0].uid]]


def test_changes_arriving_together_are_applied_in_order_and_none_is_lost(bundle_root, synthetic_data, tmp_path):
    batches = [_new_labels(synthetic_data, 3, f"b{i}") for i in range(5)]
    env = _env(tmp_path / "state", SHORTLIST_LOAD_CHECK_IN_CHILD="false")
    with serve(bundle_root, env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        with ThreadPoolExecutor(len(batches)) as pool:
            answers = list(pool.map(lambda b: c.post("/admin/labels", json=_body(b)), batches))
        assert [r.status_code for r in answers] == [200] * 5, [r.text for r in answers]
        versions = sorted(r.json()["active"] for r in answers)
        assert versions == [f"v2.labels-{i}" for i in range(1, 6)]
        # Each change was derived from the one before it: the last holds them all.
        assert {r.json()["num_labels"] for r in answers} == {303, 306, 309, 312, 315}
        final = c.get("/readyz").json()["version"]
        assert final == "v2.labels-5"
        ids = c.post("/v1/predict", json={"text": batches[0][0].title, "k": 1,
                                          "exclude": [lab.uid for b in batches for lab in b]})
        assert ids.status_code == 200, ids.text  # every added uid is known to the serving bundle
        # Each change is one event naming what it wrote and one naming its activation, in order.
        events = [json.loads(line) for line in s.log().splitlines() if line.startswith('{"event": ')]
    written = [(e["parent"], e["version"], e["added"], e["retired"]) for e in events
               if e["event"] == "label_change_written"]
    assert written == [(f"v2.labels-{i}" if i else "v2", f"v2.labels-{i + 1}", 3, 0) for i in range(5)], written
    assert [(e["version"], e["cause"]) for e in events if e["event"] == "bundle_activated"][-5:] == \
        [(f"v2.labels-{i}", "label_change") for i in range(1, 6)]


def test_label_requests_are_validated_naming_the_field(bundle_root, synthetic_data, tmp_path):
    rows = _label_rows(synthetic_data)
    env = _env(tmp_path / "state", SHORTLIST_MAX_LABEL_BATCH="2", SHORTLIST_MAX_UID_CHARS="8",
               SHORTLIST_MAX_TEXT_CHARS="40", SHORTLIST_LABEL_CHANGES_PER_MINUTE="3",
               SHORTLIST_LOAD_CHECK_IN_CHILD="false")
    good = {"uid": "n1", "title": "kama zani"}
    cases = [
        ({"labels": []}, "body.labels", "at least 1"),
        ({"labels": [good, {**good, "uid": "n2"}, {**good, "uid": "n3"}]}, "body.labels", "at most 2"),
        ({"labels": [{**good, "uid": "x" * 9}]}, "body.labels[0].uid", "at most 8"),
        ({"labels": [{**good, "uid": " "}]}, "body.labels[0].uid", "empty"),
        ({"labels": [{**good, "title": "\t"}]}, "body.labels[0].title", "empty"),
        ({"labels": [{**good, "title": "k" * 41}]}, "body.labels[0].title", "at most 40"),
        ({"labels": [{**good, "content": "c" * 41}]}, "body.labels[0].content", "at most 40 characters"),
        ({"labels": [{**good, "title": "\u200b\u3000"}]}, "body.labels[0].title", "empty"),
        ({"labels": [{**good, "extra": 1}]}, "body.labels[0].extra", "unknown field"),
        ({"labels": [good, good]}, "body.labels[1].uid", "also add[0]"),
        ({"labels": [{**good, "uid": rows[0]["uid"]}]}, "body.labels[0].uid", "already a label"),
        ({"labels": [{**good, "title": "qqqq zzzz"}]}, "body.labels[0].title", "vocabulary"),
        ({"labels": [{**good, "prior": 1.01}]}, "body.labels[0].prior", "less than or equal to 1"),
        ({"labels": [{**good, "prior": -0.1}]}, "body.labels[0].prior", "greater than or equal to 0"),
        ({"labels": [{**good, "prior": "high"}]}, "body.labels[0].prior", "number"),
    ]
    with serve(bundle_root, env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        assert httpx.post(f"{s.url}/admin/labels", json={"labels": [good]}).status_code == 401
        for body, field, message in cases:
            r = c.post("/admin/labels", json=body)
            assert r.status_code == 422, (body, r.text)
            assert any(d["field"] == field and message in d["message"] for d in r.json()["details"]), (field, r.text)
        r = c.post("/admin/labels/retire", json={"uids": ["nope", rows[1]["uid"]]})
        assert r.status_code == 422 and r.json()["details"][0]["field"] == "body.uids[0]"
        assert c.delete("/admin/labels/nope").status_code == 404
        assert c.delete("/admin/labels/" + "x" * 9).json()["details"][0]["field"] == "path.uid"
        # At the edge of the batch limit, a change goes through; refused ones did not count.
        assert c.post("/admin/labels", json={"labels": [good, {**good, "uid": "n2", "prior": 1}]}).status_code == 200
        assert c.delete("/admin/labels/n1").status_code == 200
        assert c.delete(f"/admin/labels/{rows[1]['uid']}").status_code == 200
        r = c.delete(f"/admin/labels/{rows[2]['uid']}")  # the 4th accepted change this minute
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert c.get("/readyz").json()["version"] == "v2.labels-3"


def test_a_label_change_retried_with_expected_active_is_done_once_and_the_retry_says_so(bundle_root, synthetic_data,
                                                                                        tmp_path):
    # A client whose answer was lost retries: with the version it saw active, the retry is a 409
    # naming what is active now, not a second version nor a 422 that the uid exists already.
    (new,) = _new_labels(synthetic_data, 1, "once")
    trained = _label_rows(synthetic_data)[3]["uid"]
    env = _env(tmp_path / "state", SHORTLIST_LOAD_CHECK_IN_CHILD="false")
    with serve(bundle_root, env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        add = {**_body([new]), "expected_active": "v2"}
        assert c.post("/admin/labels", json=add).json()["active"] == "v2.labels-1"
        retried = c.post("/admin/labels", json=add)
        assert retried.status_code == 409 and retried.json()["error"] == "active_version_changed", retried.text
        assert "v2.labels-1" in retried.json()["message"] and "no label was changed" in retried.json()["message"]
        retire = {"uids": [trained], "expected_active": "v2.labels-1"}
        assert c.post("/admin/labels/retire", json=retire).json()["active"] == "v2.labels-2"
        assert c.post("/admin/labels/retire", json=retire).json()["error"] == "active_version_changed"
        gone = c.delete(f"/admin/labels/{quote(new.uid, safe='')}", params={"expected_active": "v2.labels-1"})
        assert gone.status_code == 409 and gone.json()["error"] == "active_version_changed", gone.text
        # A misspelt or repeated precondition is refused, not dropped (FastAPI ignored the one, kept one of the other).
        typo = c.delete(f"/admin/labels/{new.uid}", params={"expected_activ": "v2"})
        assert typo.status_code == 422 and typo.json()["details"][0]["field"] == "query.expected_activ", typo.text
        assert "this route takes: expected_active" in typo.json()["message"]
        twice = c.delete(f"/admin/labels/{new.uid}?expected_active=v2.labels-2&expected_active=v2")
        assert twice.status_code == 422 and twice.json()["details"][0]["message"] == "given more than once", twice.text
        assert httpx.delete(f"{s.url}/admin/labels/{new.uid}?expected_activ=v2").status_code == 401  # the token first
        assert c.get("/admin/bundles?limit=1&limit=2").json()["details"][0]["field"] == "query.limit"
        assert c.get("/readyz").json()["version"] == "v2.labels-2"  # none of the refused ones made a version
        assert c.delete(f"/admin/labels/{new.uid}", params={"expected_active": "v2.labels-2"}).status_code == 200
        for bad in ("../v2", "", "v" * 200):
            r = c.post("/admin/labels/retire", json={"uids": [trained], "expected_active": bad})
            assert r.status_code == 422 and r.json()["details"][0]["field"] == "body.expected_active", r.text
        r = c.delete("/admin/labels/x", params={"expected_active": "../v2"})
        assert r.status_code == 422 and r.json()["details"][0]["field"] == "query.expected_active", r.text
        assert c.get("/readyz").json()["version"] == "v2.labels-3"


def test_a_label_is_looked_up_by_uid_live_added_or_retired(bundle_root, synthetic_data, tmp_path):
    rows = _label_rows(synthetic_data)
    (new,) = _new_labels(synthetic_data, 1, "look/up")
    with serve(bundle_root, env=_env(tmp_path / "state", SHORTLIST_LOAD_CHECK_IN_CHILD="false"),
               log_dir=tmp_path) as s, httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        trained = c.get(f"/admin/labels/{rows[5]['uid']}")
        assert trained.status_code == 200, trained.text
        assert trained.json() == {"version": "v2", "id": 5, "uid": rows[5]["uid"], "title": rows[5]["title"],
                                  "retired": False, "on_tree_route": True}
        missing = c.get(f"/admin/labels/{quote(new.uid, safe='')}")
        assert missing.status_code == 404 and missing.json()["error"] == "label_not_found", missing.text
        assert "v2" in missing.json()["message"] and missing.json()["details"][0]["field"] == "path.uid"
        assert c.post("/admin/labels", json=_body([new])).status_code == 200
        assert c.delete(f"/admin/labels/{rows[5]['uid']}").status_code == 200
        for sent in (quote(new.uid, safe=""), new.uid):  # a '/' as is or as %2F, as DELETE takes it
            added = c.get(f"/admin/labels/{sent}").json()
            assert added == {"version": "v2.labels-2", "id": len(rows), "uid": new.uid, "title": new.title,
                             "retired": False, "on_tree_route": False}, added
        retired = c.get(f"/admin/labels/{rows[5]['uid']}").json()
        assert retired["retired"] is True and retired["on_tree_route"] is False and retired["id"] == 5
        assert c.head(f"/admin/labels/{rows[5]['uid']}").status_code == 200
        put = c.put(f"/admin/labels/{rows[5]['uid']}")  # Allow names both routes' methods, not the first's
        assert put.status_code == 405 and put.headers["allow"] == "DELETE, GET", put.headers
        assert httpx.get(f"{s.url}/admin/labels/{rows[5]['uid']}").status_code == 401
        too_long = c.get("/admin/labels/" + "x" * 257)  # past MAX_UID_CHARS (256)
        assert too_long.status_code == 422 and too_long.json()["details"][0]["field"] == "path.uid", too_long.text


def test_label_changes_need_a_state_directory(bundle_root, tmp_path):
    with serve(bundle_root, env={"SHORTLIST_ADMIN_TOKEN": TOKEN}, log_dir=tmp_path) as s:
        r = httpx.post(f"{s.url}/admin/labels", json={"labels": [{"uid": "a", "title": "kama"}]}, headers=AUTH)
        assert r.status_code == 409 and "SHORTLIST_STATE_DIR" in r.json()["message"]


def test_a_full_queue_refuses_new_changes_and_loses_none_it_accepted(bundle_root, tmp_path):
    registry = BundleRegistry(BundleStore(bundle_root, tmp_path / "state"), check_timeout_s=None,
                              max_pending_changes=1)
    try:
        registry.activate("v2")
        with registry._gate.exclusive("an activation in progress"):  # the change waits for it
            accepted = registry.submit_label_change(LabelChange(add=[NewLabel("a", "kama zani")]))
            with pytest.raises(TooManyPendingChanges):
                registry.submit_label_change(LabelChange(add=[NewLabel("b", "kama zani")]))
            assert not accepted.done()
        assert accepted.result(timeout=120)["active"] == "v2.labels-1"
        assert registry.submit_label_change(LabelChange(retire=["a"])).result(timeout=120)["active"] == "v2.labels-2"
    finally:
        registry.close()


def test_with_several_processes_changes_on_any_process_are_served_by_all_in_order(bundle_root, synthetic_data,
                                                                                   tmp_path):
    batches = [_new_labels(synthetic_data, 3, f"p{i}") for i in range(4)]
    env = _env(tmp_path / "state", SHORTLIST_PROCESSES="2", SHORTLIST_ACCESS_LOG="false",
               SHORTLIST_LOAD_CHECK_IN_CHILD="false")

    def post(batch):  # a connection each, so the kernel spreads them over both processes
        with httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
            return c.post("/admin/labels", json=_body(batch))

    with serve(bundle_root, env=env, log_dir=tmp_path, timeout=120) as s:
        pids = _wait_for(s.url, {"v2"})
        with ThreadPoolExecutor(len(batches)) as pool:
            answers = list(pool.map(post, batches))
        assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers if r.status_code != 200]
        # One after another whichever process took them, each from the version before it: none lost.
        assert sorted(r.json()["active"] for r in answers) == [f"v2.labels-{i}" for i in range(1, 5)]
        assert sorted(r.json()["num_labels"] for r in answers) == [303, 306, 309, 312]
        last = next(r.json() for r in answers if r.json()["active"] == "v2.labels-4")
        assert last["processes"] == {pid: "v2.labels-4" for pid in pids}  # answered once every process serves it
        added = [lab.uid for b in batches for lab in b]
        for i in range(10):  # a new connection each: both processes know every added label
            with httpx.Client(base_url=s.url) as c:
                r = c.post("/v1/predict", json={"text": f"query {i}", "k": 3, "exclude": added})
                assert r.status_code == 200 and r.json()["version"] == "v2.labels-4", r.text


def test_a_change_on_a_process_behind_the_record_is_derived_from_the_recorded_version(bundle_root, tmp_path):
    """Two registries sharing a state directory, as two serving processes do: a change on the one
    that has not yet followed the other's change builds on it rather than undoing it."""
    state = tmp_path / "state"
    state.mkdir()
    first, second = (BundleRegistry(BundleStore(bundle_root, state), check_timeout_s=None,
                                    remembered=ActiveVersionFile(state)) for _ in range(2))
    try:
        first.activate("v2")
        second.follow("v2")
        assert first.change_labels(LabelChange(add=[NewLabel("a", "kama zani")]))["active"] == "v2.labels-1"
        assert second.active_version == "v2"  # not followed yet
        result = second.change_labels(LabelChange(add=[NewLabel("b", "kama zani")]))
        assert result["active"] == "v2.labels-2" and result["change"].parent == "v2.labels-1"
        assert result["change"].num_labels == 302
        assert second.active.bundle.labels.ids_of(["a", "b"]) == [300, 301]
    finally:
        first.close()
        second.close()


def _unsearched_index_cut(root, version: str, stale: bool) -> None:
    """A copy of v2 named `version` that searches no index (k_w = k_mu = 0, as trained bundles
    serve; its canaries recorded again), so activation never reads one, whose hnsw_w.bin is cut
    to 1,000 bytes: its checksum recomputed (a bundle export wrote that way) or left stale."""
    shutil.copytree(root / "v2", root / version)
    path = root / version / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["version"] = version
    manifest["scoring"]["shortlist"].update(k_w=0, k_mu=0)
    path.write_text(json.dumps(manifest))
    bundle = Bundle.open(root / version)
    try:
        manifest["canary"] = [c.model_dump() for c in canary.record(Predictor(bundle), [
            c.text for c in bundle.manifest.canary])]
    finally:
        bundle.close()
    index = root / version / "hnsw_w.bin"
    index.write_bytes(index.read_bytes()[:1000])
    if not stale:
        manifest["files"]["hnsw_w.bin"] = sha256_file(index)
    path.write_text(json.dumps(manifest))


def test_a_label_change_that_first_reads_a_corrupt_index_is_refused_naming_it(bundle_root_copy, tmp_path):
    """The change reads the serving bundle's index as serving would (checksum, then structure):
    a 422 naming the file, not a 500; the bundle keeps serving and nothing is left staged."""
    root, state = bundle_root_copy, tmp_path / "state"
    for version, stale in (("cut", False), ("stale", True)):
        _unsearched_index_cut(root, version, stale)
    env = _env(state, SHORTLIST_LOAD_CHECK_IN_CHILD="false")
    body = {"labels": [{"uid": "n1", "title": "kama zani"}]}
    with serve(root, version="v2", env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        for version, named in (("cut", "file truncated"), ("stale", "sha256 mismatch")):
            r = c.post("/admin/bundles/activate", json={"version": version})
            assert r.status_code == 200, r.text  # its scoring searches no index: never read
            r = c.post("/admin/labels", json=body)
            assert r.status_code == 422 and r.json()["error"] == "bundle_rejected", r.text
            assert "hnsw_w.bin" in r.json()["message"] and named in r.json()["message"], r.text
            r = c.post("/v1/predict", json={"text": "kama zani", "k": 3})
            assert r.status_code == 200 and r.json()["version"] == version, r.text
            assert sorted(p.name for p in (state / "bundles").iterdir()) == [], "a staging or derived bundle left"
        log = s.log()
    assert '"unhandled_error"' not in log


def test_activating_a_bundle_whose_labels_repeat_a_uid_is_refused_and_the_serving_one_serves(bundle_root_copy,
                                                                                              tmp_path):
    root = bundle_root_copy
    line = _repeat_a_uid(root, "v1", "dup")
    with serve(root, version="v2", env=_env(tmp_path / "state"), log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        r = c.post("/admin/bundles/activate", json={"version": "dup"})
        assert r.status_code == 422 and r.json()["error"] == "bundle_rejected", r.text
        assert f"labels.jsonl:{line}: uid" in r.json()["message"], r.text
        r = c.post("/v1/predict", json={"text": "kama zani", "k": 3})
        assert r.status_code == 200 and r.json()["version"] == "v2", r.text


def test_every_uid_the_add_route_takes_the_delete_route_retires(bundle_root, synthetic_data, tmp_path):
    """A uid with '/' was added but DELETE /admin/labels/{uid} answered an unknown-route 404."""
    uids = ["/x", "x/", "../x", "a/b"]
    added = [NewLabel(uid, lab.title) for uid, lab in zip(uids, _new_labels(synthetic_data, len(uids)), strict=True)]
    env = _env(tmp_path / "state", SHORTLIST_LOAD_CHECK_IN_CHILD="false")
    with serve(bundle_root, env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        assert c.post("/admin/labels", json=_body(added)).status_code == 200
        found = _uids(c, [lab.title for lab in added], k=20)
        assert all(lab.uid in row for lab, row in zip(added, found, strict=True)), found
        for i, uid in enumerate(uids):
            # Percent-encoded, and for 'a/b' also as two path segments (decoded alike).
            path = "/admin/labels/" + (uid if uid == "a/b" else quote(uid, safe=""))
            r = c.delete(path)
            assert r.status_code == 200 and r.json()["retired"] == 1, (uid, r.text)
            assert c.delete(path).status_code == 404  # retired already
            assert uid not in _uids(c, [added[i].title], k=20)[0]
        r = c.delete("/admin/labels/")  # no uid at all: the uid is named, not an unknown route
        assert r.status_code == 422 and r.json()["details"][0]["field"] == "path.uid", r.text
