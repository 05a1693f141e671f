"""Restarts keep the operator's choice: the active version lives in SHORTLIST_STATE_DIR, and a
bundle that cannot be served at start-up gives way to the newest one that can."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import httpx
from _api_helpers import renamed_copy
from test_admin import AUTH, TOKEN, corrupt_copy

from shortlist.testing import serve


def _env(state_dir) -> dict[str, str]:
    return {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(state_dir)}


def _serving(server) -> str:
    return httpx.get(f"{server.url}/readyz").json()["version"]


def test_a_restart_serves_the_version_last_activated_or_rolled_back_to(bundle_root, tmp_path):
    state = tmp_path / "state"
    with serve(bundle_root, env=_env(state), log_dir=tmp_path) as s:
        assert _serving(s) == "v2"  # nothing remembered yet: the newest
        r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": "v1"}, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
    assert json.loads((state / "active.json").read_text())["version"] == "v1"
    with serve(bundle_root, env=_env(state), log_dir=tmp_path) as s:
        assert _serving(s) == "v1"  # not the newest: the operator's choice
        assert httpx.post(f"{s.url}/v1/predict", json={"text": "x"}).json()["version"] == "v1"
    # The choice outlives an explicit start-up version too, which only stands in when nothing
    # was activated.
    with serve(bundle_root, env=_env(state), version="v2", log_dir=tmp_path) as s:
        assert _serving(s) == "v1"
        # ... and the log says so: `serve --version v2` serving v1 was silent.
        passed_over = _events(s.log())["configured_version_passed_over"]
        assert passed_over["configured"] == "v2" and passed_over["serving"] == "v1"
        r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": "v2"}, headers=AUTH, timeout=60)
        assert r.status_code == 200
        r = httpx.post(f"{s.url}/admin/bundles/rollback", headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json()["active"] == "v1"
    with serve(bundle_root, env=_env(state), log_dir=tmp_path) as s:
        assert _serving(s) == "v1"


def test_a_remembered_bundle_that_no_longer_loads_gives_way_to_the_newest_that_does(bundle_root_copy, tmp_path):
    state = tmp_path / "state"
    corrupt_copy(bundle_root_copy, "v1", "v0bad")  # an older, broken bundle
    state.mkdir()
    (state / "active.json").write_text(json.dumps({"version": "v0bad"}))
    with serve(bundle_root_copy, env=_env(state), log_dir=tmp_path) as s:
        assert _serving(s) == "v2"
        metrics = httpx.get(f"{s.url}/metrics").text
        assert 'shortlist_startup_fallback{wanted="v0bad"} 1.0' in metrics
        events = [json.loads(line) for line in s.log().splitlines() if line.startswith("{")]
        fallback = [e for e in events if e.get("event") == "startup_fallback"]
        assert fallback and fallback[0]["serving"] == "v2" and "v0bad" in fallback[0]["wanted"]
    # The fallback is not the operator's choice (audit s15 A10: recorded, it became every process's
    # and outlived the fault): the record keeps v0bad, so once it loads again a restart serves it.
    assert json.loads((state / "active.json").read_text())["version"] == "v0bad"
    shutil.rmtree(bundle_root_copy / "v0bad")
    renamed_copy(bundle_root_copy, "v1", "v0bad")  # repaired
    with serve(bundle_root_copy, env=_env(state), log_dir=tmp_path) as s:
        assert _serving(s) == "v0bad"
        assert "shortlist_startup_fallback{" not in httpx.get(f"{s.url}/metrics").text


def test_a_broken_newest_bundle_does_not_keep_the_service_down(bundle_root_copy, tmp_path):
    corrupt_copy(bundle_root_copy, "v2", "v3bad")  # the newest (same created_at, later name)
    with serve(bundle_root_copy, env=_env(tmp_path / "state"), log_dir=tmp_path) as s:
        assert _serving(s) == "v2"
        assert 'shortlist_startup_fallback{wanted="(newest)"} 1.0' in httpx.get(f"{s.url}/metrics").text


def test_an_unwritable_state_dir_stops_start_up_naming_it(bundle_root, tmp_path):
    not_a_dir = tmp_path / "state-file"
    not_a_dir.write_text("")
    env = {"PATH": "/usr/bin:/bin", "SHORTLIST_STATE_DIR": str(not_a_dir / "sub")}
    r = subprocess.run([sys.executable, "-m", "shortlist.cli", "serve", "--bundle-root", str(bundle_root)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0
    assert str(not_a_dir) in r.stderr


def test_a_process_that_cannot_load_the_recorded_version_does_not_switch_the_others(bundle_root_copy, tmp_path):
    """Audit s15 A10: a restarted process that could not load the active version fell back and
    recorded its fallback, which every other process then followed, and the history was lost."""
    from test_processes import _env as processes_env
    from test_processes import _serving as serving_by_pid
    from test_processes import replacement_that_cannot_load

    state = tmp_path / "state"
    with serve(bundle_root_copy, env=processes_env(state), log_dir=tmp_path, timeout=120) as s:
        # The replacement of a killed process joins a live one: it serves what that one serves or
        # nothing, never a version of its own choosing, and says why.
        survivor, _ = replacement_that_cannot_load(s, bundle_root_copy, state)
        time.sleep(2)  # several process-sync ticks: the survivor follows nobody
        assert serving_by_pid(s.url) == {survivor: "v1"}
        recorded = json.loads((state / "active.json").read_text())
        assert recorded["version"] == "v1" and "v2" in recorded["history"], recorded


def _events(log: str) -> dict[str, dict]:
    """The structured events of a server's log, by name."""
    lines = (json.loads(line) for line in log.splitlines() if line.startswith("{"))
    return {e["event"]: e for e in lines if "event" in e}


def test_a_state_dir_that_is_not_there_is_never_taken_silently_for_an_empty_one(bundle_root, tmp_path):
    """Audit 7 F3: a missing state directory (a volume not mounted, a wrong path) was made empty
    without a word: the newest bundle served instead of the recorded one, the history lost."""
    state = tmp_path / "state"
    with serve(bundle_root, env=_env(state), log_dir=tmp_path) as s:
        assert _serving(s) == "v2"
        created = _events(s.log())["state_dir_created"]
    assert created["state_dir"] == str(state) and "no version is recorded" in created["message"]
    # Its parent missing too: refused, naming both, nothing made.
    deeper = tmp_path / "volume" / "state"
    env = {"PATH": "/usr/bin:/bin", "SHORTLIST_STATE_DIR": str(deeper)}
    r = subprocess.run([sys.executable, "-m", "shortlist.cli", "serve", "--bundle-root", str(bundle_root)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    assert f"the state directory {deeper} (SHORTLIST_STATE_DIR) does not exist, nor does {deeper.parent}" in r.stderr
    assert not deeper.parent.exists()


def test_a_state_dir_whose_record_is_gone_but_not_the_rest_is_said_loudly(bundle_root, tmp_path):
    """Audit 7 F3: label changes' records without active.json (a file lost, a partial restore)."""
    state = tmp_path / "state"
    with serve(bundle_root, env=_env(state), log_dir=tmp_path) as s:
        r = httpx.post(f"{s.url}/admin/labels", json={"labels": [{"uid": "f3", "title": "kama zani"}]},
                       headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        assert "state_dir_empty" not in _events(s.log())  # made here: state_dir_created says it
    (state / "active.json").unlink()
    with serve(bundle_root, env=_env(state), log_dir=tmp_path) as s:
        incomplete = _events(s.log())["state_incomplete"]
    assert incomplete["found"] == ["bundles", "label_ledger"]
    assert f"{state / 'active.json'} is missing" in incomplete["message"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with serve(bundle_root, env=_env(empty), log_dir=tmp_path) as s:
        events = _events(s.log())
    assert "state_dir_empty" in events and "state_incomplete" not in events and "state_dir_created" not in events


def test_a_restart_leaves_the_record_of_the_operators_activation_alone(bundle_root, tmp_path):
    """Audit 7 F5: every start-up rewrote active.json (a new activated_at) though nothing was activated."""
    from service.api.active_state import ActiveVersionFile
    from service.api.registry import BundleRegistry
    from service.engine.store import BundleStore

    state = tmp_path / "state"
    state.mkdir()

    def registry() -> BundleRegistry:
        return BundleRegistry(BundleStore(bundle_root, state), check_timeout_s=None,
                              remembered=ActiveVersionFile(state))

    first = registry()
    first.activate("v2")
    first.activate("v1")
    first.close()
    activated = (state / "active.json").read_bytes()
    for _ in range(2):
        again = registry()
        try:
            assert again.start()["active"] == "v1"
            assert (state / "active.json").read_bytes() == activated
        finally:
            again.close()
    again = registry()
    try:
        again.start()
        assert again.activate("v2")["active"] == "v2"  # an activation records, as ever
        assert json.loads((state / "active.json").read_bytes())["history"] == ["v2", "v1"]
    finally:
        again.close()
