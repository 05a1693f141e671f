"""What the state directory and a writable bundle root keep (audit s13, G7): staging directories of
writers that died are removed at start-up and before the next write, never one a live writer holds
(its pid may be any: pids repeat in containers); derived versions past SHORTLIST_KEEP_DERIVED_VERSIONS
are removed after an activation, never the active one, one in the rollback history or one a process
sharing the state directory serves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_admin import AUTH, TOKEN

from service.api.active_state import ActiveVersionFile
from service.api.processes import PROCESSES_DIR, ProcessesDiverged, ProcessGroup
from service.api.registry import BundleRegistry
from service.api.settings import SettingsError, load_settings
from service.engine.label_changes import LabelChange, NewLabel
from service.engine.store import BundleStore
from shortlist.testing import serve

HOLD = "import fcntl, os, sys, time\nfds = [os.open(d, os.O_RDONLY) for d in sys.argv[1:]]\n" \
       "[fcntl.flock(fd, fcntl.LOCK_EX) for fd in fds]\nprint('held', flush=True)\ntime.sleep(600)\n"


def _holding(*dirs: Path) -> subprocess.Popen:
    """Another process writing into `dirs`, as a writer holds its staging directory."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, *map(str, dirs)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def _made(*dirs: Path) -> list[Path]:
    for d in dirs:
        d.mkdir(parents=True)
        (d / "classifiers.npy").write_bytes(b"\0" * 1000)
    return list(dirs)


def _add(c: httpx.Client, uid: str) -> str:
    r = c.post("/admin/labels", json={"labels": [{"uid": uid, "title": "kama zani"}]})
    assert r.status_code == 200, r.text
    return r.json()["active"]


def test_staging_of_dead_writers_is_swept_at_start_and_before_a_write_never_a_live_ones(bundle_root_copy, tmp_path):
    state, root = tmp_path / "state", bundle_root_copy
    derived = state / "bundles"
    # Left by writers that died: an older release's name (pid only), this release's, and a version
    # whose removal was cut short. Pid 1 is alive: a pid says nothing about the writer.
    stale = _made(root / ".staging-v9-1", root / ".staging-v9-1-0123abcd", derived / ".staging-v2.labels-1-7-ab",
                  derived / ".removing-v2.labels-5-cd")
    live = _made(root / ".staging-v8-1-ef", derived / ".staging-v2.labels-2-1-01")
    holder = _holding(*live)
    try:
        env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(state)}
        with serve(root, version="v2", env=env, log_dir=tmp_path) as s, \
                httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
            assert [d for d in stale if d.exists()] == [] and all(d.exists() for d in live)
            assert _add(c, "g-1") == "v2.labels-1"
            assert all(d.exists() for d in live)
            holder.kill()
            holder.wait()
            assert _add(c, "g-2") == "v2.labels-2"
            assert not live[1].exists()  # swept before the write into its directory
            assert live[0].exists()  # the service never writes to the bundle root
            assert sorted(p.name for p in derived.iterdir()) == ["v2.labels-1", "v2.labels-2"]
    finally:
        holder.kill()
        holder.wait()


def _versions(c: httpx.Client) -> list[str]:
    return [b["version"] for b in c.get("/admin/bundles").json()["bundles"]]


def _derived(state: Path) -> tuple[list[str], list[str]]:
    """(the versions in STATE_DIR/bundles, the names removed ones keep taken: files holding the uids
    each gave out past its base)."""
    entries = sorted((state / "bundles").iterdir())
    assert all(p.is_dir() or json.loads(p.read_bytes())["base"] == "v2" for p in entries)
    return [p.name for p in entries if p.is_dir()], [p.name for p in entries if not p.is_dir()]


@pytest.mark.parametrize(("keep", "removed"), [(0, ["v2.labels-2"]), (1, ["v2.labels-2"]), (2, [])])
def test_derived_versions_past_the_setting_are_removed_but_never_one_in_use(bundle_root, tmp_path, keep, removed):
    state = tmp_path / "state"
    env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(state),
           "SHORTLIST_KEEP_DERIVED_VERSIONS": str(keep)}
    with serve(bundle_root, version="v2", env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        assert _add(c, "r-1") == "v2.labels-1"
        assert _add(c, "r-2") == "v2.labels-2"
        # Rolled back from: labels-2 is neither served nor in the history any more.
        assert c.post("/admin/bundles/rollback").json()["active"] == "v2.labels-1"
        assert _add(c, "r-3") == "v2.labels-3"  # labels-1 in the history, labels-3 active
        kept = [v for v in ("v2.labels-1", "v2.labels-2", "v2.labels-3") if v not in removed]
        assert _versions(c) == ["v1", "v2", *kept]
        assert _derived(state) == (kept, removed)  # nothing half removed
        r = c.post("/admin/bundles/rollback")  # what the history holds still loads
        assert r.status_code == 200 and r.json()["active"] == "v2.labels-1", r.text
        r = c.post("/admin/bundles/activate", json={"version": "v2.labels-2"})
        assert r.status_code == (404 if removed else 200), r.text
        assert _add(c, "r-4") == "v2.labels-4"  # a removed version's name is never given to another


def test_a_derived_version_another_process_serves_is_kept_until_it_no_longer_does(bundle_root, tmp_path):
    """Registries sharing a state directory as serving processes do; the other process is a live
    process whose published record says it still serves an old version."""
    state = tmp_path / "state"
    state.mkdir()
    registry = BundleRegistry(BundleStore(bundle_root, state), check_timeout_s=None,
                              remembered=ActiveVersionFile(state), keep_derived_versions=0)
    group = ProcessGroup(state, registry, interval_s=60.0, converge_timeout_s=0.5)
    other = subprocess.Popen(["sleep", "600"])
    try:
        registry.activate("v2")
        group.start()
        assert registry.change_labels(LabelChange(add=[NewLabel("p-1", "kama zani")]))["active"] == "v2.labels-1"
        (state / PROCESSES_DIR / f"{other.pid}.json").write_text(
            json.dumps({"pid": other.pid, "version": "v2.labels-1", "failed": None}))
        with pytest.raises(ProcessesDiverged):  # the other process does not follow: it serves labels-1 on
            registry.rollback()
        with pytest.raises(ProcessesDiverged):
            registry.change_labels(LabelChange(add=[NewLabel("p-2", "kama zani")]))
        assert registry.active_version == "v2.labels-2"
        assert (state / "bundles" / "v2.labels-1").is_dir()  # not active, not in the history: served
        other.kill()
        other.wait()
        registry.activate("v1")
        assert _derived(state) == (["v2.labels-2"], ["v2.labels-1"])  # labels-2 is in the history
    finally:
        other.kill()
        other.wait()
        group.stop()
        registry.close()


@pytest.mark.parametrize(("value", "refused"), [(-1, "greater than or equal to 0"), (0, None), (10_000, None),
                                                (10_001, "less than or equal to 10000")])
def test_keep_derived_versions_is_bounded(value, refused, monkeypatch):
    monkeypatch.setenv("SHORTLIST_KEEP_DERIVED_VERSIONS", str(value))
    if refused is None:
        assert load_settings().keep_derived_versions == value
    else:
        expected = f"^SHORTLIST_KEEP_DERIVED_VERSIONS='{value}': input should be {refused}$"
        with pytest.raises(SettingsError, match=expected):
            load_settings()
