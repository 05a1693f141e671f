"""Rollback past history entries that no longer load (audit s13, F10), over a real uvicorn: they are
skipped, named in the answer and dropped from the recorded history, instead of failing every
rollback for good."""

from __future__ import annotations

import json
import shutil

import httpx
from _api_helpers import flip_a_byte, renamed_copy

from shortlist.testing import serve

TOKEN = "s3cret-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def test_rollback_skips_entries_that_no_longer_load_and_drops_them(bundle_root_copy, tmp_path):
    for version in ("a", "b", "c", "d"):
        renamed_copy(bundle_root_copy, "v1", version)
    state_dir = tmp_path / "state"
    env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(state_dir)}
    with serve(bundle_root_copy, version="v2", env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        for version in ("a", "b", "c", "d"):
            r = c.post("/admin/bundles/activate", json={"version": version})
            assert r.status_code == 200, r.text
        assert json.loads((state_dir / "active.json").read_text())["history"] == ["v2", "a", "b", "c"]
        shutil.rmtree(bundle_root_copy / "c")  # deleted
        flip_a_byte(bundle_root_copy / "b" / "classifiers.npy")  # broken

        r = c.post("/admin/bundles/rollback")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["active"] == "a" and body["previous"] == "d"
        assert [x["version"] for x in body["skipped"]] == ["c", "b"]
        assert "no bundle 'c'" in body["skipped"][0]["reason"]
        assert "classifiers.npy" in body["skipped"][1]["reason"] and "sha256" in body["skipped"][1]["reason"]
        assert c.post("/v1/predict", json={"text": "x"}).json()["version"] == "a"
        assert json.loads((state_dir / "active.json").read_text())["history"] == ["v2"]

        # Nothing loadable left: a 404 naming what was passed over, the history emptied for good.
        shutil.rmtree(bundle_root_copy / "v2")
        r = c.post("/admin/bundles/rollback")
        assert r.status_code == 404, r.text
        assert "no previously active bundle to roll back to; skipped v2: no bundle 'v2'" in r.json()["message"]
        assert json.loads((state_dir / "active.json").read_text()) | {"activated_at": None} == \
            {"version": "a", "history": [], "activated_at": None, "state_format": 1}
        r = c.post("/admin/bundles/rollback")
        assert r.status_code == 404 and r.json()["message"] == "no previously active bundle to roll back to"
        assert c.get("/readyz").json()["version"] == "a"
        # Each swap is one structured event saying what and why (audit 7 F8: plain text, no cause).
        events = [json.loads(line) for line in s.log().splitlines() if line.startswith('{"event": "bundle_activated"')]
    assert [(e["version"], e["previous"], e["cause"]) for e in events] == [
        ("v2", None, "start"), ("a", "v2", "activate"), ("b", "a", "activate"), ("c", "b", "activate"),
        ("d", "c", "activate"), ("a", "d", "rollback")], events
    assert all(e["recorded"] and e["seconds"] >= 0 and isinstance(e["pid"], int) for e in events)


def test_activating_the_served_version_changes_nothing_and_rollback_passes_over_it(bundle_root, tmp_path):
    """Audit s13, G6: an idempotent deploy that activates what serves must not fill the history with
    it, and a history recorded so (by an older release) must not make rollbacks stand still."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    # As an older release recorded three activations of the served version.
    (state_dir / "active.json").write_text(json.dumps({"version": "v2", "history": ["v1", "v2", "v2", "v2"]}))
    env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(state_dir)}
    with serve(bundle_root, env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        for _ in range(3):
            r = c.post("/admin/bundles/activate", json={"version": "v2"})
            assert r.status_code == 200, r.text
            assert r.json() | {"seconds": 0} == {"active": "v2", "previous": "v2", "unchanged": True, "seconds": 0,
                                                  "quality": {}, "processes": {}, "skipped": []}
        assert json.loads((state_dir / "active.json").read_text())["history"] == ["v1", "v2", "v2", "v2"]
        r = c.post("/admin/bundles/rollback")
        assert r.status_code == 200 and r.json()["active"] == "v1" and r.json()["skipped"] == [], r.text
        assert json.loads((state_dir / "active.json").read_text())["history"] == []
        # An activation that changes something pushes what served.
        r = c.post("/admin/bundles/activate", json={"version": "v2"})
        assert r.status_code == 200 and r.json()["active"] == "v2" and not r.json()["unchanged"], r.text
        assert json.loads((state_dir / "active.json").read_text())["history"] == ["v1"]
        r = c.post("/admin/bundles/activate", json={"version": "v2"})
        assert r.status_code == 200 and r.json()["unchanged"], r.text
        assert json.loads((state_dir / "active.json").read_text())["history"] == ["v1"]


def test_a_retried_rollback_with_the_version_it_saw_active_rolls_back_once(bundle_root_copy, tmp_path):
    """Audit 9: a client whose rollback's answer was lost and retries it rolled back two versions.
    With `expected_active` the retry is refused, naming what is active, and nothing moves."""
    renamed_copy(bundle_root_copy, "v1", "v3")
    env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(tmp_path / "state")}
    with serve(bundle_root_copy, version="v1", env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        for version in ("v2", "v3"):
            assert c.post("/admin/bundles/activate", json={"version": version}).status_code == 200
        for attempt in range(2):
            r = c.post("/admin/bundles/rollback", json={"expected_active": "v3"})
            if attempt == 0:
                assert r.status_code == 200 and r.json()["active"] == "v2", r.text
            else:
                assert r.status_code == 409 and r.json()["error"] == "active_version_changed", r.text
                assert r.json()["message"] == ("the active version is v2, not v3 (expected_active): "
                                               "nothing was rolled back")
        assert c.get("/readyz").json()["version"] == "v2"
        assert 'reason="changed"' in c.get("/metrics").text
        # Bad preconditions are the request's fault, named; {} and no body roll back as before.
        for body, field in (({"expected_active": 3}, "body.expected_active"),
                            ({"expected_active": "../v1"}, "body.expected_active"),
                            ({"expected": "v2"}, "body.expected")):
            r = c.post("/admin/bundles/rollback", json=body)
            assert r.status_code == 422 and r.json()["details"][0]["field"] == field, r.text
        r = c.post("/admin/bundles/rollback", json={})
        assert r.status_code == 200 and r.json()["active"] == "v1", r.text
        r = c.post("/admin/bundles/rollback")
        assert r.status_code == 404, r.text
