"""Label ids and uids across rollbacks and crashes (service.engine.label_ledger): an id or uid given
out once never names another label, even on a version rolled back or made by another process, and
a change that a crash left renamed into place but never activated is never served, and is set
aside (its ids taken back) at the next start-up or change."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
from test_admin import AUTH, TOKEN
from test_label_changes import _new_labels
from test_processes import _wait_for

from service.api.active_state import ActiveVersionFile
from service.api.registry import ActivationFailed, BundleRegistry
from service.engine.bundle import Bundle
from service.engine.label_changes import LabelChange, NewLabel
from service.engine.label_ledger import LEDGER_DIR, QUARANTINE_DIR
from service.engine.store import BundleStore
from shortlist.testing import serve


def _env(state: Path) -> dict[str, str]:
    return {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(state)}


def _body(*labels: NewLabel) -> dict:
    return {"labels": [{"uid": lab.uid, "title": lab.title} for lab in labels]}


def _ids(state: Path, version: str, uids: list[str]) -> tuple[list[int | None], np.ndarray]:
    """The ids the derived version serves these uids under, and which of its rows are retired."""
    bundle = Bundle.open(state / "bundles" / version)
    try:
        return bundle.labels.ids_of(uids), np.asarray(bundle.retired)
    finally:
        bundle.close()


def _registry(bundle_root: Path, state: Path) -> BundleRegistry:
    """A registry as a serving process makes it (its own state record), without the checking child."""
    state.mkdir(exist_ok=True)
    return BundleRegistry(BundleStore(bundle_root, state), check_timeout_s=None, remembered=ActiveVersionFile(state))


@contextmanager
def _serving_one_added(bundle_root: Path, state: Path, label: NewLabel) -> Iterator[BundleRegistry]:
    """A registry serving v2.labels-1: v2 with `label` added (id 300)."""
    registry = _registry(bundle_root, state)
    try:
        registry.activate("v2")
        registry.change_labels(LabelChange(add=[label]))
        yield registry
    finally:
        registry.close()


def test_after_a_rollback_a_new_label_gets_a_new_id_and_a_rolled_back_uid_is_refused(bundle_root, synthetic_data,
                                                                                      tmp_path):
    """The audit's scenario: alpha is given id 300, rolled back; beta must not get 300, and
    alpha cannot come back with another text."""
    state = tmp_path / "state"
    alpha, beta, other = _new_labels(synthetic_data, 3, "lin")
    with serve(bundle_root, version="v2", env=_env(state), log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        r = c.post("/admin/labels", json=_body(alpha))
        assert r.status_code == 200 and r.json()["active"] == "v2.labels-1", r.text
        assert c.post("/admin/bundles/rollback").json()["active"] == "v2"
        for reason in ("given out (id 300) on another version", None):
            r = c.post("/admin/labels", json=_body(NewLabel(alpha.uid, other.title)))
            assert r.status_code == 422, r.text
            assert r.json()["details"][0]["field"] == "body.labels[0].uid"
            assert "uids are never reused" in r.json()["details"][0]["message"]
            assert reason is None or reason in r.json()["details"][0]["message"]
            if reason is not None:
                r = c.post("/admin/labels", json=_body(beta))
                assert r.status_code == 200, r.text
                assert (r.json()["active"], r.json()["num_labels"], r.json()["added"]) == ("v2.labels-2", 302, 1)
        assert c.delete(f"/admin/labels/{alpha.uid}").status_code == 404  # not a live label here
        found = c.post("/v1/predict", json={"text": alpha.title, "k": 50}).json()["results"][0]
        assert alpha.uid not in [label["uid"] for label in found]
        assert {label["id"] for label in found if label["uid"] == beta.uid} <= {301}
    ids, retired = _ids(state, "v2.labels-2", [alpha.uid, beta.uid])
    assert ids == [300, 301] and retired[300] and not retired[301]  # id 300 still names alpha, retired
    assert _ids(state, "v2.labels-1", [alpha.uid])[0] == [300]


@pytest.mark.parametrize("damage", ["missing", "unreadable"])
def test_a_lost_id_record_is_made_again_from_the_versions_on_disk(bundle_root, synthetic_data, tmp_path, damage):
    """Lost after a rollback: the ids of the rolled-back branch are only on disk, in its version."""
    state = tmp_path / "state"
    a, b, c = _new_labels(synthetic_data, 3, "lost")
    with _serving_one_added(bundle_root, state, a) as registry:
        assert registry.rollback()["active"] == "v2"
        record = state / LEDGER_DIR / "v2.json"
        if damage == "missing":
            record.unlink()
        else:
            record.write_text("{torn")
        registry.change_labels(LabelChange(add=[b]))
        ids, retired = _ids(state, "v2.labels-2", [a.uid, b.uid])
        assert ids == [300, 301] and retired[300]
        with pytest.raises(ValueError, match="uids are never reused"):
            registry.change_labels(LabelChange(add=[NewLabel(a.uid, c.title)]))
        assert orjson.loads(record.read_bytes())["uids"] == [a.uid, b.uid]  # written whole again


def test_an_id_record_behind_the_parent_is_caught_up_with_its_rows(bundle_root, synthetic_data, tmp_path):
    state = tmp_path / "state"
    a, b, c = _new_labels(synthetic_data, 3, "rec")
    with _serving_one_added(bundle_root, state, a) as registry:
        record = state / LEDGER_DIR / "v2.json"
        record.write_bytes(orjson.dumps({"base": "v2", "first_id": 300, "uids": []}))  # as if a's were not recorded
        registry.change_labels(LabelChange(add=[b]))  # from v2.labels-1: past its own rows
        assert _ids(state, "v2.labels-2", [a.uid, b.uid])[0] == [300, 301]
        # The record is whole again: after a rollback past b, c gets the next id and b stays b's.
        assert registry.rollback()["active"] == "v2.labels-1"
        registry.change_labels(LabelChange(add=[c]))
        ids, retired = _ids(state, "v2.labels-3", [a.uid, b.uid, c.uid])
        assert ids == [300, 301, 302] and retired[301] and not retired[302]


def test_processes_sharing_a_state_directory_share_the_ids_given_out(bundle_root, synthetic_data, tmp_path):
    """Two registries on one state directory, as two serving processes: a change on the second,
    after the first rolled its own change back, gets the next id, not the rolled-back one's."""
    state = tmp_path / "state"
    a, b, c = _new_labels(synthetic_data, 3, "proc")
    first, second = _registry(bundle_root, state), _registry(bundle_root, state)
    try:
        first.activate("v2")
        second.follow("v2")
        assert first.change_labels(LabelChange(add=[a]))["active"] == "v2.labels-1"
        assert first.rollback()["active"] == "v2"
        assert second.change_labels(LabelChange(add=[b]))["active"] == "v2.labels-2"
        with pytest.raises(ValueError, match="uids are never reused"):
            first.change_labels(LabelChange(add=[NewLabel(a.uid, c.title)]))
        assert first.change_labels(LabelChange(add=[c]))["active"] == "v2.labels-3"
        assert _ids(state, "v2.labels-3", [a.uid, b.uid, c.uid])[0] == [300, 301, 302]
    finally:
        first.close()
        second.close()


def test_over_several_serving_processes_an_id_is_given_out_once(bundle_root, synthetic_data, tmp_path):
    """The audit's scenario with SHORTLIST_PROCESSES=2, every request on a new connection (either
    process may take it): the record in the state directory is the processes' common one."""
    state = tmp_path / "state"
    a, b, c = _new_labels(synthetic_data, 3, "two")
    env = {**_env(state), "SHORTLIST_PROCESSES": "2", "SHORTLIST_LOAD_CHECK_IN_CHILD": "false",
           "SHORTLIST_ACCESS_LOG": "false"}

    def post(path: str, body: dict | None = None) -> httpx.Response:
        with httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as client:
            return client.post(path, json=body)

    with serve(bundle_root, version="v2", env=env, log_dir=tmp_path, timeout=120) as s:
        _wait_for(s.url, {"v2"})
        assert post("/admin/labels", _body(a)).json()["active"] == "v2.labels-1"
        assert post("/admin/bundles/rollback").json()["active"] == "v2"
        assert post("/admin/labels", _body(b)).json()["active"] == "v2.labels-2"
        assert post("/admin/labels", _body(NewLabel(a.uid, c.title))).status_code == 422
        assert post("/admin/labels", _body(c)).json()["active"] == "v2.labels-3"
    assert _ids(state, "v2.labels-3", [a.uid, b.uid, c.uid])[0] == [300, 301, 302]


def test_a_change_whose_activation_is_refused_is_set_aside_and_its_ids_taken_back(bundle_root, synthetic_data,
                                                                                  tmp_path):
    state = tmp_path / "state"
    (a,) = _new_labels(synthetic_data, 1, "gate")
    registry = _registry(bundle_root, state)
    try:
        registry.activate("v2")
        registry.quality_gate_min_p1 = 100.5  # no bundle passes it: the new version is refused
        with pytest.raises(ActivationFailed):
            registry.change_labels(LabelChange(add=[a]))
        assert registry.active_version == "v2"
        assert "v2.labels-1" not in [b.version for b, _ in registry.list()]
        assert (state / QUARANTINE_DIR / "v2.labels-1.1" / "manifest.json").is_file()
        registry.quality_gate_min_p1 = None
        assert registry.change_labels(LabelChange(add=[a]))["active"] == "v2.labels-1"
        assert _ids(state, "v2.labels-1", [a.uid])[0] == [300]  # nobody was given the refused one's id
    finally:
        registry.close()


def _kill_between_rename_and_activation(bundle_root: Path, state: Path, label: NewLabel, log_dir: Path) -> None:
    """A real crash in the window G3 found: the server's active.json temporary file is a FIFO with
    no reader, so the change's activation blocks writing it, after its version was renamed into
    place; the server is then killed with SIGKILL."""
    with serve(bundle_root, version="v2", env=_env(state), log_dir=log_dir) as s:
        fifo = state / f".active.json.{s.proc.pid}.tmp"
        os.mkfifo(fifo)

        def post() -> None:
            try:
                httpx.post(f"{s.url}/admin/labels", json=_body(label), headers=AUTH, timeout=120)
            except httpx.HTTPError:
                pass  # the server dies under it

        threading.Thread(target=post, daemon=True).start()
        deadline = time.monotonic() + 120
        while not (state / "bundles" / "v2.labels-1").is_dir():
            assert time.monotonic() < deadline, s.log()[-3000:]
            time.sleep(0.05)
        listed = httpx.get(f"{s.url}/admin/bundles", headers=AUTH, timeout=30).json()["bundles"]
        assert [(b["version"], b["unconfirmed"]) for b in listed if b["place"] == "state"] == [("v2.labels-1", True)]
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait()
    fifo.unlink()


@pytest.mark.parametrize("active_json", ["intact", "torn"])
def test_a_change_killed_before_its_activation_is_never_served_and_is_set_aside(bundle_root, synthetic_data,
                                                                                tmp_path, active_json):
    state = tmp_path / "state"
    a, b = _new_labels(synthetic_data, 2, "kill")
    _kill_between_rename_and_activation(bundle_root, state, a, tmp_path)
    if active_json == "torn":  # and the record of the active version is lost too
        (state / "active.json").write_text("{torn")
    with serve(bundle_root, env=_env(state), log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        served = c.get("/readyz").json()["version"]
        listed = {b["version"]: b["unconfirmed"] for b in c.get("/admin/bundles").json()["bundles"]}
        if active_json == "intact":
            assert served == "v2" and "v2.labels-1" not in listed  # set aside at start-up
        else:  # the newest bundle that was ever confirmed, never the unconfirmed one, still marked
            assert served in ("v1", "v2") and listed["v2.labels-1"] is True
            assert c.post("/admin/bundles/activate", json={"version": "v2"}).status_code == 200
        r = c.post("/v1/predict", json={"text": a.title, "k": 3, "exclude": [a.uid]})
        assert r.status_code == 422  # the killed change's label is served nowhere
        # Its uid and id were taken back: the client's retry gets the id the change would have had.
        r = c.post("/admin/labels", json=_body(a, b))
        assert r.status_code == 200 and r.json()["active"] == "v2.labels-1", r.text
        assert all(not b["unconfirmed"] for b in c.get("/admin/bundles").json()["bundles"])
    assert _ids(state, "v2.labels-1", [a.uid, b.uid])[0] == [300, 301]
    assert (state / QUARANTINE_DIR / "v2.labels-1.1" / "manifest.json").is_file()
