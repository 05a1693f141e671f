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
from service.engine.removed_names import MAX_NAMES_BYTES, NAMES_FILE, RemovedNames
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


def _derived(state: Path) -> tuple[list[str], dict[str, int]]:
    """(the versions in STATE_DIR/bundles, the highest N of each stem's removed BASE.labels-N: the
    names removed versions keep taken, in one record, not a file each: audit 7 F7)."""
    entries = sorted(p for p in (state / "bundles").iterdir() if p.name != NAMES_FILE)
    assert all(p.is_dir() for p in entries), entries
    return [p.name for p in entries], RemovedNames(state / "bundles").highest()


@pytest.mark.parametrize(("keep", "removed"), [(0, {"v2": 2}), (1, {"v2": 2}), (2, {})])
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
        kept = [v for v in ("v2.labels-1", "v2.labels-2", "v2.labels-3") if not removed or v != "v2.labels-2"]
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
        assert _derived(state) == (["v2.labels-2"], {"v2": 1})  # labels-2 is in the history
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


def _changes(registry: BundleRegistry, uids: range | list[str]) -> list[str]:
    return [str(registry.change_labels(LabelChange(add=[NewLabel(f"g-{i}", "kama zani")]))["active"]) for i in uids]


def test_removed_versions_keep_their_names_taken_in_bounded_space_across_restarts(bundle_root, tmp_path,
                                                                                 monkeypatch):
    """Audit 7 F7: each removed version left a file of its name for ever (~170 k a day at the
    permitted change rate, in one directory listed at start-up and by GET /admin/bundles). The
    rollback history is cut to 2 so that most changes remove a version."""
    monkeypatch.setattr("service.api.activation.HISTORY_LENGTH", 2)
    monkeypatch.setattr("service.api.active_state.HISTORY_LENGTH", 2)
    state = tmp_path / "state"
    state.mkdir()

    def registry() -> BundleRegistry:
        return BundleRegistry(BundleStore(bundle_root, state), check_timeout_s=None,
                              remembered=ActiveVersionFile(state), keep_derived_versions=1)

    made, first = [], registry()
    try:
        first.activate("v2")
        for batch in (range(0, 5), range(5, 10)):
            made += _changes(first, batch)
            # The active version (the newest, kept) and 2 in the history, and the names' record, however many
            # changes.
            assert len(list((state / "bundles").iterdir())) == 4
    finally:
        first.close()
    again = registry()
    try:
        again.start()
        made += _changes(again, range(10, 12))
        assert BundleStore(bundle_root, state).exists("v2.labels-1")
    finally:
        again.close()
    assert made == [f"v2.labels-{n}" for n in range(1, 13)]  # each name given once, counting on past a restart
    assert _derived(state) == ([f"v2.labels-{n}" for n in range(10, 13)], {"v2": 9})
    # What the removed versions gave out is kept beside the id record, in one file.
    removed = json.loads((state / "label_ledger" / ".removed-v2.json").read_bytes())
    assert removed["uids"] == [f"g-{i}" for i in range(9)]


def test_the_files_older_releases_left_for_removed_versions_are_honoured_then_folded(bundle_root, tmp_path):
    """A state directory from before audit 7 F7: a file per removed name, holding the uids its
    version gave out (or none: older still). Their names stay taken and their uids refused;
    the next removal folds them into the records and removes them."""
    state = tmp_path / "state"
    (state / "bundles").mkdir(parents=True)
    (state / "bundles" / "v2.labels-1").write_bytes(b"")
    (state / "bundles" / "v2.labels-2").write_bytes(json.dumps({"base": "v2", "first_id": 300,
                                                                "uids": ["old-1", "old-2"]}).encode())
    registry = BundleRegistry(BundleStore(bundle_root, state), check_timeout_s=None,
                              remembered=ActiveVersionFile(state), keep_derived_versions=0)
    try:
        registry.activate("v2")
        with pytest.raises(ValueError, match="uids are never reused"):
            registry.change_labels(LabelChange(add=[NewLabel("old-2", "kama zani")]))
        assert _changes(registry, ["a"]) == ["v2.labels-3"]
        assert _derived(state) == (["v2.labels-3"], {"v2": 2})  # folded at the activation's removal
        registry.activate("v1")
        assert _changes(registry, ["b"]) == ["v1.labels-1"]
        assert _derived(state) == (["v1.labels-1", "v2.labels-3"], {"v2": 2})
    finally:
        registry.close()
    removed = json.loads((state / "label_ledger" / ".removed-v2.json").read_bytes())
    assert removed["uids"] == ["old-1", "old-2"]


def test_a_record_of_removed_names_that_cannot_be_read_refuses_to_name_a_version(bundle_root, tmp_path):
    """Which names were given out is then unknown: a name is never guessed (it could name two bundles)."""
    state = tmp_path / "state"
    (state / "bundles").mkdir(parents=True)
    (state / "bundles" / NAMES_FILE).write_text("{not json")
    registry = BundleRegistry(BundleStore(bundle_root, state), check_timeout_s=None,
                              remembered=ActiveVersionFile(state), keep_derived_versions=0)
    try:
        registry.activate("v2")
        with pytest.raises(OSError, match="removed version names cannot be read"):
            registry.change_labels(LabelChange(add=[NewLabel("u-1", "kama zani")]))
        assert sorted(p.name for p in (state / "bundles").iterdir()) == [NAMES_FILE]
    finally:
        registry.close()


@pytest.mark.parametrize("extra", [0, 1])
def test_the_record_of_removed_names_is_read_up_to_its_limit_and_refused_past_it(tmp_path, extra):
    """MAX_NAMES_BYTES bounds what is read of the record: at the limit it is read, one byte past
    it is refused as unreadable (EIO: no name is then given out), never read whole."""
    record = json.dumps({"highest": {"v2": 7}}).encode()
    (tmp_path / NAMES_FILE).write_bytes(record + b" " * (MAX_NAMES_BYTES + extra - len(record)))
    names = RemovedNames(tmp_path)
    if extra == 0:
        assert names.highest() == {"v2": 7} and names.holds("v2.labels-7") and not names.holds("v2.labels-8")
    else:
        with pytest.raises(OSError, match="removed version names cannot be read"):
            names.highest()
