"""A served version's files changed under it (audit 4, A1 and A7): written in place, they answer
503 `bundle_changed` naming the file until a version is activated, never a crash or a 500; removed,
the opened files serve on and a label change names the missing file."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
from _api_helpers import wait_until
from test_admin import AUTH, TOKEN

from service.api.registry import _parent_fault
from service.engine.bundle import Bundle
from shortlist.testing import serve

TEXTS = ["network traffic monitor", "python library", "game arcade", "kernel driver", "font", "query 7"]


def _env(state_dir: Path, **extra: str) -> dict[str, str]:
    return {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(state_dir), **extra}


def _predictions(url: str, n: int = 12) -> list[httpx.Response]:
    """n predictions naming many labels (k=50), each on a new connection (every process takes some)."""
    out = []
    for i in range(n):
        with httpx.Client(base_url=url, timeout=30) as c:
            out.append(c.post("/v1/predict", json={"text": TEXTS[i % len(TEXTS)], "k": 50}))
    return out


def _truncate(path: Path) -> None:
    """What `cp other/FILE .` does to the served file: the same inode, cut short."""
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 4)


def _assert_changed(r: httpx.Response, name: str) -> None:
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["error"] == "bundle_changed", body
    assert name in body["message"] and "v2" in body["message"], body


def _serving(state_dir: Path, version: str, processes: int, timeout: float = 90.0) -> set[int]:
    """The pids of the processes once `processes` of them serve `version` (their records)."""
    deadline = time.monotonic() + timeout
    while True:
        records = [json.loads(p.read_text()) for p in (state_dir / "processes").glob("*.json")]
        pids = {r["pid"] for r in records if r.get("version") == version}
        if len(pids) == processes or time.monotonic() > deadline:
            return pids
        time.sleep(0.1)


def _events(log: str, event: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{") and f'"event": "{event}"' in line]


@pytest.mark.parametrize("name", ["labels.jsonl", "classifiers.npy", "encoder.onnx.data"])
def test_a_served_file_truncated_in_place_answers_503_naming_it_until_a_version_is_activated(
        bundle_root_copy, tmp_path, name):
    path = bundle_root_copy / "v2" / name
    original = path.read_bytes()
    with serve(bundle_root_copy, version="v2", env=_env(tmp_path / "state"), log_dir=tmp_path) as s:
        assert all(r.status_code == 200 for r in _predictions(s.url, 3))
        with httpx.Client(base_url=s.url, timeout=30) as c:  # kept alive: the next request within a millisecond
            assert c.post("/v1/predict", json={"text": TEXTS[0], "k": 50}).status_code == 200
            _truncate(path)
            _assert_changed(c.post("/v1/predict", json={"text": TEXTS[1], "k": 50}), name)
        for r in _predictions(s.url):  # checked before each batch: an answer, not a SIGBUS
            _assert_changed(r, name)
        ready = httpx.get(f"{s.url}/readyz")
        assert ready.status_code == 503 and name in ready.json()["message"], ready.text
        assert s.proc.poll() is None
        [event] = _events(s.log(), "bundle_changed")
        assert event["version"] == "v2" and event["file"] == str(path)
        # Activating it again loads and checks it: refused while the file is not as exported.
        r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": "v2"}, headers=AUTH, timeout=120)
        assert r.status_code == 422 and r.json()["error"] == "bundle_rejected" and name in r.text, r.text
        _assert_changed(_predictions(s.url, 1)[0], name)
        # Put back as exported (in place again): still 503 until an operator activates a version.
        with path.open("r+b") as f:
            f.write(original)
        time.sleep(1.5)
        _assert_changed(_predictions(s.url, 1)[0], name)
        r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": "v2"}, headers=AUTH, timeout=120)
        assert r.status_code == 200 and r.json()["active"] == "v2", r.text
        assert all(r.status_code == 200 and r.json()["version"] == "v2" for r in _predictions(s.url, 4))
        assert httpx.get(f"{s.url}/readyz").status_code == 200
    assert '"status":500' not in s.log() and "Traceback" not in s.log()


def test_label_rows_rewritten_at_the_same_size_answer_503_never_500(bundle_root_copy, tmp_path):
    """Rows shifted by a byte decode to something else: the request path names the file, without
    waiting for the periodic check (off here); another version activated serves at once."""
    path = bundle_root_copy / "v2" / "labels.jsonl"
    data = path.read_bytes()
    env = _env(tmp_path / "state", SHORTLIST_BUNDLE_CHECK_INTERVAL_S="0")
    with serve(bundle_root_copy, version="v2", env=env, log_dir=tmp_path) as s:
        assert _predictions(s.url, 1)[0].status_code == 200
        with path.open("r+b") as f:
            f.write(data.replace(b'"title": "', b'"title": "X')[: len(data)])
        for r in _predictions(s.url, 6):
            _assert_changed(r, "labels.jsonl")
        assert "no longer decodes" in r.json()["message"]
        assert httpx.get(f"{s.url}/readyz").status_code == 503
        r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": "v1"}, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        assert all(r.status_code == 200 and r.json()["version"] == "v1" for r in _predictions(s.url, 4))
        assert httpx.get(f"{s.url}/readyz").status_code == 200
    assert '"status":500' not in s.log()


def test_the_periodic_check_finds_a_file_no_request_reads(bundle_root_copy, tmp_path):
    """The tokenizer's file, rewritten in place with its own bytes (another mtime): no request
    reads it again, the check every SHORTLIST_BUNDLE_CHECK_INTERVAL_S finds it."""
    path = next(p for p in (bundle_root_copy / "v2").iterdir() if p.name.startswith("tokenizer"))
    env = _env(tmp_path / "state", SHORTLIST_BUNDLE_CHECK_INTERVAL_S="0.2")
    with serve(bundle_root_copy, version="v2", env=env, log_dir=tmp_path) as s:
        assert _predictions(s.url, 1)[0].status_code == 200
        time.sleep(0.05)  # another mtime, even on a coarse clock
        path.write_bytes(path.read_bytes())  # O_TRUNC then the same bytes: the same inode
        deadline = time.monotonic() + 10
        while httpx.get(f"{s.url}/readyz").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        _assert_changed(_predictions(s.url, 1)[0], path.name)


def test_files_removed_from_the_served_version_serve_on_and_a_label_change_names_them(bundle_root_copy, tmp_path):
    with serve(bundle_root_copy, version="v2", env=_env(tmp_path / "state"), log_dir=tmp_path) as s:
        labels = bundle_root_copy / "v2" / "labels.jsonl"
        shutil.copyfile(labels, tmp_path / "labels.tmp")
        os.replace(tmp_path / "labels.tmp", labels)  # another file (inode) of the same bytes renamed over it
        (bundle_root_copy / "v2" / "hnsw_w.bin").unlink()
        # The periodic check (every 1 s, on its own thread) logs it when it runs.
        wait_until(lambda: f"{labels}: replaced by another file" in s.log(), "the periodic check's warning", 30)
        assert all(r.status_code == 200 for r in _predictions(s.url, 3))
        r = httpx.post(f"{s.url}/admin/labels", json={"labels": [{"uid": "new-1", "title": "network monitor"}]},
                       headers=AUTH, timeout=120)
        assert r.status_code == 422 and r.json()["error"] == "bundle_rejected", r.text
        assert "hnsw_w.bin" in r.json()["message"] and "removed" in r.json()["message"], r.text
        shutil.rmtree(bundle_root_copy / "v2")  # an operator's rm -rf of the served version
        time.sleep(1.5)  # past a periodic check
        assert all(r.status_code == 200 and r.json()["version"] == "v2" for r in _predictions(s.url, 6))
        assert httpx.get(f"{s.url}/readyz").status_code == 200
        r = httpx.post(f"{s.url}/admin/labels/retire", json={"uids": ["new-1"]}, headers=AUTH, timeout=120)
        assert r.status_code == 422 and "removed since it was loaded" in r.json()["message"], r.text
        assert "state_unavailable" not in r.text
    assert "serves on from the files it opened" in s.log()


def test_with_two_processes_a_changed_bundle_is_never_forked_again(bundle_root_copy, tmp_path):
    """The arbiter drops the bundle it preloaded once a file of it changed: a process it forks
    after loads the version itself and is refused naming the file, rather than mapping the
    truncated file and dying by SIGBUS, again and again."""
    path = bundle_root_copy / "v2" / "labels.jsonl"
    env = _env(tmp_path / "state", SHORTLIST_PROCESSES="2", SHORTLIST_ACCESS_LOG="false")
    with serve(bundle_root_copy, version="v2", env=env, log_dir=tmp_path, timeout=120) as s:
        pids = _serving(tmp_path / "state", "v2", 2)
        assert all(r.status_code == 200 for r in _predictions(s.url, 4))
        _truncate(path)
        for r in _predictions(s.url):
            _assert_changed(r, "labels.jsonl")
        os.kill(pids.pop(), signal.SIGKILL)  # a process gone for any reason: the arbiter forks another
        deadline = time.monotonic() + 60
        while "startup_load_failed" not in s.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        log = s.log()
        assert "arbiter dropped its preloaded bundle v2" in log and str(path) in log
        [refused] = _events(log, "startup_load_failed")
        assert "labels.jsonl" in refused["message"]
        # Every answer a 503 saying why (the old process: bundle_changed; the new one: not_ready).
        for r in _predictions(s.url):
            assert r.status_code == 503 and r.json()["error"] in ("bundle_changed", "not_ready"), r.text
        assert s.proc.poll() is None and pids.pop() in {int(p.stem) for p in (tmp_path / "state" / "processes")
                                                        .glob("*.json")}
        r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": "v1"}, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        assert all(r.status_code == 200 and r.json()["version"] == "v1" for r in _predictions(s.url, 8))
    assert "was sent SIGBUS" not in s.log()


def test_with_two_processes_activating_the_version_again_once_its_files_are_back_clears_every_process(
        bundle_root_copy, tmp_path):
    path = bundle_root_copy / "v2" / "labels.jsonl"
    original = path.read_bytes()
    env = _env(tmp_path / "state", SHORTLIST_PROCESSES="2", SHORTLIST_ACCESS_LOG="false",
               SHORTLIST_BUNDLE_CHECK_INTERVAL_S="0.2")
    with serve(bundle_root_copy, version="v2", env=env, log_dir=tmp_path, timeout=120) as s:
        pids = _serving(tmp_path / "state", "v2", 2)
        _truncate(path)
        # Both processes' periodic checks (every 0.2 s), each logging it once when it runs.
        wait_until(lambda: len(_events(s.log(), "bundle_changed")) >= 2, "both processes' bundle_changed", 30)
        for r in _predictions(s.url):
            _assert_changed(r, "labels.jsonl")
        assert len(_events(s.log(), "bundle_changed")) == 2  # once a process
        with path.open("r+b") as f:
            f.write(original)
        r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": "v2"}, headers=AUTH, timeout=120)
        assert r.status_code == 200 and set(r.json()["processes"].values()) == {"v2"}, r.text
        deadline = time.monotonic() + 10
        while any(r.status_code != 200 for r in _predictions(s.url, 8)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(r.status_code == 200 and r.json()["version"] == "v2" for r in _predictions(s.url, 12))
        assert httpx.get(f"{s.url}/readyz").status_code == 200
        assert _serving(tmp_path / "state", "v2", 2) == pids  # the same processes, none restarted


def test_an_error_reading_the_parent_bundle_is_its_own_not_the_state_directorys(bundle_root_copy, tmp_path):
    """What a label change maps to 422 naming the bundle's file (registry._parent_fault), and what
    it leaves to state_unavailable: a failure on a path outside the parent's directory, or on two
    paths (a link into the state directory)."""
    bundle = Bundle.open(bundle_root_copy / "v2")
    try:
        (bundle.path / "hnsw_w.bin").unlink()
        with pytest.raises(OSError) as missing:
            (bundle.path / "hnsw_w.bin").open("rb")
        fault = _parent_fault(missing.value, bundle)
        assert fault is not None and "hnsw_w.bin" in str(fault) and "served version v2" in str(fault)
        with pytest.raises(OSError) as elsewhere:
            (tmp_path / "state" / "bundles" / "x").open("rb")
        assert _parent_fault(elsewhere.value, bundle) is None
        with pytest.raises(OSError) as link:
            os.link(bundle.path / "labels.jsonl", tmp_path / "no-such-dir" / "labels.jsonl")
        assert _parent_fault(link.value, bundle) is None
    finally:
        bundle.close()
