"""Label ids and uids across rollbacks and crashes (service.engine.label_ledger): an id or uid given
out once never names another label, even on a version rolled back, removed by retention or made by
another process, and a change that a crash left renamed into place but never activated is never
served, and is set aside (its ids taken back) at the next start-up or change; one recorded active
even once never is."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
from _api_helpers import renamed_copy
from test_admin import AUTH, TOKEN
from test_label_changes import _new_labels
from test_processes import _wait_for

from service.api.active_state import ActiveVersionFile
from service.api.registry import ActivationFailed, BundleRegistry
from service.engine.bundle import Bundle
from service.engine.label_changes import LabelChange, NewLabel
from service.engine.label_ledger import LEDGER_DIR, MAX_ID_RECORD_BYTES, MAX_UID_CHARS, QUARANTINE_DIR, UNCONFIRMED_FILE
from service.engine.store import BundleStore
from shortlist.cli import main as cli
from shortlist.testing import serve


def _env(state: Path) -> dict[str, str]:
    return {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(state)}


def _two_processes(state: Path) -> dict[str, str]:
    return {**_env(state), "SHORTLIST_PROCESSES": "2", "SHORTLIST_LOAD_CHECK_IN_CHILD": "false",
            "SHORTLIST_ACCESS_LOG": "false"}


def _post(url: str, path: str, body: dict | None = None) -> httpx.Response:
    """On a new connection: either process may take it."""
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
        return client.post(path, json=body)


def _body(*labels: NewLabel) -> dict:
    return {"labels": [{"uid": lab.uid, "title": lab.title} for lab in labels]}


def _ids(state: Path, version: str, uids: list[str]) -> tuple[list[int | None], np.ndarray]:
    """The ids the derived version serves these uids under, and which of its rows are retired."""
    bundle = Bundle.open(state / "bundles" / version)
    try:
        return bundle.labels.ids_of(uids), np.asarray(bundle.retired)
    finally:
        bundle.close()


def _registry(bundle_root: Path, state: Path, keep_derived_versions: int | None = None) -> BundleRegistry:
    """A registry as a serving process makes it (its own state record), without the checking child."""
    state.mkdir(exist_ok=True)
    return BundleRegistry(BundleStore(bundle_root, state), check_timeout_s=None, remembered=ActiveVersionFile(state),
                          keep_derived_versions=keep_derived_versions)


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
    with serve(bundle_root, version="v2", env=_two_processes(state), log_dir=tmp_path, timeout=120) as s:
        post = functools.partial(_post, s.url)
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


def _gutting_retirement(bundle_dir: Path) -> tuple[list[str], list[int], float]:
    """Labels to retire that gut the validation rows the bundle answers right but leave every other
    row's truths alone: (their uids; the rows whose truths they all are; the bundle's P@1 on the
    rows left, which a retirement cannot lower: their top-1 either stays or was a retired label,
    a miss)."""
    from service.engine.metrics import ranking_metrics
    from service.engine.predictor import Predictor

    predictor = Predictor.load(bundle_dir)
    rows = predictor.bundle.validation_rows()
    truths = [set(r["target_ind"]) for r in rows]
    top = predictor.predict_ids([r["text"] for r in rows], k=5)[0]
    shared = [set().union(*(t for j, t in enumerate(truths) if j != i)) for i in range(len(rows))]
    gutted = [i for i, t in enumerate(truths) if int(top[i, 0]) in t and not t & shared[i]]
    left = [i for i in range(len(rows)) if i not in gutted]
    floor = ranking_metrics(top[left], [truths[i] for i in left], ks=(1,))["P@1"]
    retire = sorted({label for i in gutted for label in truths[i]})
    uids = [predictor.bundle.labels.uids[label] for label in retire]
    predictor.bundle.close()
    return uids, gutted, floor


def test_the_quality_gate_scores_a_retirement_on_the_truths_left_and_still_refuses_a_worse_bundle(
        bundle_root, tmp_path):
    from service.engine.metrics import ranking_metrics
    from service.engine.predictor import Predictor

    uids, gutted, floor = _gutting_retirement(bundle_root / "v2")
    assert len(gutted) >= 5
    registry = _registry(bundle_root, tmp_path / "state")
    try:
        registry.activate("v2")
        registry.quality_gate_min_p1 = floor
        quality = registry.change_labels(LabelChange(retire=uids))["quality"]
        assert registry.active_version == "v2.labels-1"
        derived = Predictor.load(tmp_path / "state" / "bundles" / "v2.labels-1")
        rows = derived.bundle.validation_rows()
        assert quality["P@1"] >= floor
        assert quality["validation_rows_left_out"] == len(gutted)
        assert quality["validation_rows"] == len(rows) - len(gutted)
        assert quality["retired_truths_left_out"] == sum(len(rows[i]["target_ind"]) for i in gutted)
        # Scored with the retired labels as truths, the same version fails the same floor: what the
        # gate refused before, although the rows left are answered as well as ever.
        ids = derived.predict_ids([r["text"] for r in rows], k=5)[0]
        assert ranking_metrics(ids, [r["target_ind"] for r in rows], ks=(1,))["P@1"] < floor
        every_truth = sorted({derived.bundle.labels.uids[label] for r in rows for label in r["target_ind"]})
        derived.bundle.close()
        # The gate still measures the version: a floor above what it answers refuses it.
        registry.activate("v2")
        registry.quality_gate_min_p1 = quality["P@1"] + 0.01
        refusal = (rf"quality gate failed: P@1 {quality['P@1']:.2f} on {len(rows) - len(gutted)} validation rows "
                   rf"\(\d+ retired truths left out, {len(gutted)} rows with only retired truths not scored\)")
        with pytest.raises(ActivationFailed, match=refusal):
            registry.activate("v2.labels-1")
        assert registry.active_version == "v2"
        # A version that can answer no validation truth cannot be measured: refused, at any floor.
        registry.quality_gate_min_p1 = 0.0
        truths = sum(len(r["target_ind"]) for r in rows)
        with pytest.raises(ActivationFailed, match="quality gate failed: no validation row has a truth the bundle "
                           rf"can answer \({truths} retired truths left out, {len(rows)} rows"):
            registry.change_labels(LabelChange(retire=every_truth))
        assert registry.active_version == "v2"
    finally:
        registry.close()


def test_versions_set_aside_are_kept_to_the_derived_versions_limit(bundle_root, synthetic_data, tmp_path):
    # Each refused change sets a whole bundle aside: repeated refusals must not fill the disk.
    state = tmp_path / "state"
    labels = _new_labels(synthetic_data, 3, "aside")
    registry = _registry(bundle_root, state, keep_derived_versions=2)
    try:
        registry.activate("v2")
        registry.quality_gate_min_p1 = 100.5  # no bundle passes it: every change is refused
        for label in labels:
            with pytest.raises(ActivationFailed):
                registry.change_labels(LabelChange(add=[label]))
            time.sleep(0.01)  # mtimes apart even on a coarse clock
        assert sorted(p.name for p in (state / QUARANTINE_DIR).iterdir()) == ["v2.labels-1.2", "v2.labels-1.3"]
        registry.keep_derived_versions = 0  # the one just set aside stays for inspection
        with pytest.raises(ActivationFailed):
            registry.change_labels(LabelChange(add=[labels[0]]))
        assert [p.name for p in (state / QUARANTINE_DIR).iterdir()] == ["v2.labels-1.4"]
        assert registry.active_version == "v2"
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


def _mark(state: Path) -> dict | None:
    path = state / LEDGER_DIR / UNCONFIRMED_FILE
    return orjson.loads(path.read_bytes()) if path.exists() else None


def test_a_version_recorded_active_is_never_set_aside_after_a_rollback(bundle_root, synthetic_data, tmp_path):
    """Audit 3 H1 (a), 2 processes: the process applying a change died after active.json named its
    version and before it cleared the mark, and the other one serves it. (That crash's state, made
    here by writing the mark back.) A rollback, then a change: the version stays, with its name and ids."""
    state = tmp_path / "state"
    a, b = _new_labels(synthetic_data, 2, "h1a")
    with serve(bundle_root, version="v2", env=_two_processes(state), log_dir=tmp_path, timeout=120) as s:
        post = functools.partial(_post, s.url)
        _wait_for(s.url, {"v2"})
        assert post("/admin/labels", _body(a)).json()["active"] == "v2.labels-1"
        (state / LEDGER_DIR / UNCONFIRMED_FILE).write_bytes(
            orjson.dumps({"version": "v2.labels-1", "base": "v2", "first_id": 300, "keep": 0}))
        r = post("/admin/bundles/rollback")
        assert r.status_code == 200 and r.json()["active"] == "v2", r.text
        assert _mark(state) is None  # settled before the rollback dropped it from the history
        r = post("/admin/labels", _body(b))
        assert r.status_code == 200 and r.json()["active"] == "v2.labels-2", r.text
    assert not (state / QUARANTINE_DIR).exists()
    assert _ids(state, "v2.labels-1", [a.uid])[0] == [300]
    assert _ids(state, "v2.labels-2", [a.uid, b.uid])[0] == [300, 301]


def _change_refused_after_its_rename(c: httpx.Client, state: Path, label: NewLabel) -> None:
    """A change whose activation cannot record itself (active.json a directory): 503, its version
    left renamed into place and marked."""
    (state / "active.json").unlink()
    (state / "active.json").mkdir()
    r = c.post("/admin/labels", json=_body(label))
    assert r.status_code == 503 and r.json()["error"] == "state_unavailable", r.text
    assert _mark(state)["version"] == "v2.labels-1"
    (state / "active.json").rmdir()


@pytest.mark.parametrize("record", ["readable", "unreadable"])
def test_activating_an_unconfirmed_version_by_hand(bundle_root, synthetic_data, tmp_path, record):
    """Audit 3 H1 (b). Every activation first settles the mark: with active.json readable and not
    naming the version, it was never activated and is set aside (404). With active.json unreadable
    it cannot be told, the activation goes on, and recording the version active confirms it for
    good: a rollback then does not make it "never activated"."""
    state = tmp_path / "state"
    a, b = _new_labels(synthetic_data, 2, "h1b")
    with serve(bundle_root, version="v2", env=_env(state), log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        _change_refused_after_its_rename(c, state, a)
        listed = {v["version"]: v["unconfirmed"] for v in c.get("/admin/bundles").json()["bundles"]}
        assert listed["v2.labels-1"] is True
        if record == "readable":
            ActiveVersionFile(state).write("v2")
            r = c.post("/admin/bundles/activate", json={"version": "v2.labels-1"})
            assert r.status_code == 404, r.text
            assert (state / QUARANTINE_DIR / "v2.labels-1.1" / "manifest.json").is_file()
            assert c.post("/admin/labels", json=_body(a, b)).json()["active"] == "v2.labels-1"  # the retry
            assert _ids(state, "v2.labels-1", [a.uid, b.uid])[0] == [300, 301]
            return
        os.mkfifo(state / "active.json")
        r = c.post("/admin/bundles/activate", json={"version": "v2.labels-1"})
        assert r.status_code == 200 and r.json()["active"] == "v2.labels-1", r.text
        assert _mark(state) is None
        r = c.post("/admin/bundles/rollback")
        assert r.status_code == 200 and r.json()["active"] == "v2", r.text
        assert c.post("/admin/labels", json=_body(b)).json()["active"] == "v2.labels-2"
        assert c.post("/v1/predict", json={"text": a.title, "k": 3, "exclude": [a.uid]}).status_code == 200
    assert not (state / QUARANTINE_DIR).exists()
    assert _ids(state, "v2.labels-2", [a.uid, b.uid])[0] == [300, 301]


def test_a_change_while_a_mark_cannot_be_settled_is_refused_and_keeps_the_mark(bundle_root, synthetic_data, tmp_path):
    """Audit 3 M4: with a mark pending and active.json unreadable (a FIFO: replaceable), the next
    change would replace the mark with its own, leaving the first version unmarked for ever: it
    is 503 naming active.json instead. Once active.json is fixed, the first change can be sent again."""
    state = tmp_path / "state"
    a, b = _new_labels(synthetic_data, 2, "m4")
    with serve(bundle_root, version="v2", env=_env(state), log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        _change_refused_after_its_rename(c, state, a)
        os.mkfifo(state / "active.json")
        r = c.post("/admin/labels", json=_body(b))
        assert r.status_code == 503 and r.json()["error"] == "state_unavailable", r.text
        assert "active.json" in r.json()["message"] and "v2.labels-1" in r.json()["message"], r.text
        assert _mark(state)["version"] == "v2.labels-1"
        assert not (state / "bundles" / "v2.labels-2").exists()
        (state / "active.json").unlink()  # the operator's fix
        r = c.post("/admin/labels", json=_body(a))
        assert r.status_code == 200 and r.json()["active"] == "v2.labels-1", r.text
        assert c.post("/admin/labels", json=_body(b)).json()["active"] == "v2.labels-2"
    assert _ids(state, "v2.labels-2", [a.uid, b.uid])[0] == [300, 301]
    assert (state / QUARANTINE_DIR / "v2.labels-1.1" / "manifest.json").is_file()


@pytest.mark.parametrize("damage", ["missing", "fifo"])
def test_a_lost_id_record_keeps_the_uids_of_versions_retention_removed(bundle_root, synthetic_data, tmp_path, damage):
    """Audit 3 M3: a version retention removed is not on disk to make the record again from; the
    record retention keeps of its base's removed versions holds its uids, so the next label gets the
    next id and its uid stays refused."""
    state = tmp_path / "state"
    a, b, c = _new_labels(synthetic_data, 3, "m3")
    registry = _registry(bundle_root, state, keep_derived_versions=0)
    try:
        registry.activate("v2")
        registry.change_labels(LabelChange(add=[a]))
        registry.change_labels(LabelChange(add=[b]))
        registry.rollback()
        assert registry.rollback()["active"] == "v2"
        assert not (state / "bundles" / "v2.labels-2").exists()  # removed, its uids kept in its base's record
        assert orjson.loads((state / LEDGER_DIR / ".removed-v2.json").read_bytes())["uids"] == [a.uid, b.uid]
        record = state / LEDGER_DIR / "v2.json"
        record.unlink()
        if damage == "fifo":
            os.mkfifo(record)
        assert registry.change_labels(LabelChange(add=[c]))["active"] == "v2.labels-3"
        ids, retired = _ids(state, "v2.labels-3", [a.uid, b.uid, c.uid])
        assert ids == [300, 301, 302] and retired[300] and retired[301]
        with pytest.raises(ValueError, match="uids are never reused"):
            registry.change_labels(LabelChange(add=[NewLabel(b.uid, a.title)]))
    finally:
        registry.close()


def _record_past_the_disk(state: Path, uids: list[str], size: int | None = None) -> None:
    """An id record holding `uids` (ids 300...), padded with JSON whitespace to `size` bytes."""
    data = orjson.dumps({"base": "v2", "first_id": 300, "uids": uids})
    (state / LEDGER_DIR / "v2.json").write_bytes(data + b" " * ((size or len(data)) - len(data)))


@pytest.mark.parametrize(("size", "used"), [(MAX_ID_RECORD_BYTES, True), (MAX_ID_RECORD_BYTES + 1, False)])
def test_an_id_record_is_read_up_to_its_limit(bundle_root, synthetic_data, tmp_path, size, used):
    """Audit 3 L6: a record past MAX_ID_RECORD_BYTES is not read (made again from the versions on
    disk). "ghost" is a uid only the record holds: used, it keeps id 301."""
    state = tmp_path / "state"
    a, b = _new_labels(synthetic_data, 2, "l6")
    with _serving_one_added(bundle_root, state, a) as registry:
        _record_past_the_disk(state, [a.uid, "ghost"], size)
        registry.change_labels(LabelChange(add=[b]))
        assert _ids(state, "v2.labels-2", [a.uid, "ghost", b.uid])[0] == ([300, 301, 302] if used else [300, None, 301])


@pytest.mark.parametrize(("uid", "used"), [("u" * MAX_UID_CHARS, True), ("u" * (MAX_UID_CHARS + 1), False),
                                           (" \u200b", False), ("", False), (7, False)])
def test_an_id_record_holding_what_is_not_a_uid_is_made_again(bundle_root, synthetic_data, tmp_path, uid, used):
    """Audit 3 L6: a uid the API would refuse (too long, blank, not a string) is never copied into
    a version: the record is made again from the versions on disk."""
    state = tmp_path / "state"
    a, b = _new_labels(synthetic_data, 2, "l6u")
    with _serving_one_added(bundle_root, state, a) as registry:
        _record_past_the_disk(state, [a.uid, uid])
        registry.change_labels(LabelChange(add=[b]))
        bundle = Bundle.open(state / "bundles" / "v2.labels-2")
        try:
            assert len(bundle.labels) == (303 if used else 302)
            assert bundle.labels.ids_of([b.uid]) == [302 if used else 301]
        finally:
            bundle.close()


def test_offline_labels_add_skips_the_version_names_a_server_state_directory_holds(bundle_root_copy, synthetic_data,
                                                                                   tmp_path):
    """Audit 3 M1: `shortlist labels add` with SHORTLIST_STATE_DIR set, its default --out the bundle
    root the server serves from: it must not make a second v2.labels-1 (listed twice, rollback 404)."""
    state = tmp_path / "state"
    a, b = _new_labels(synthetic_data, 2, "m1")
    with _serving_one_added(bundle_root_copy, state, a):
        pass
    labels = tmp_path / "labels.jsonl"
    labels.write_text(orjson.dumps({"uid": b.uid, "title": b.title}).decode() + "\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SHORTLIST_")}, "SHORTLIST_STATE_DIR": str(state)}
    done = subprocess.run([sys.executable, "-m", "shortlist.cli", "labels", "add", str(bundle_root_copy / "v2"),
                           "--labels", str(labels)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert orjson.loads(done.stdout.splitlines()[-1])["version"] == "v2.labels-2"
    assert not (bundle_root_copy / "v2.labels-1").exists()
    registry = _registry(bundle_root_copy, state)
    try:
        assert registry.start()["active"] == "v2.labels-1"  # recorded by the server
        assert registry.activate("v2.labels-2")["active"] == "v2.labels-2"
        assert registry.rollback()["active"] == "v2.labels-1"  # the server's, named once
    finally:
        registry.close()


def _offline_add(bundle_dir: Path, label: NewLabel, state: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    labels = tmp_path / f"{label.uid}.jsonl"
    labels.write_text(orjson.dumps({"uid": label.uid, "title": label.title}).decode() + "\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SHORTLIST_")}, "SHORTLIST_STATE_DIR": str(state)}
    return subprocess.run([sys.executable, "-m", "shortlist.cli", "labels", "add", str(bundle_dir), "--labels",
                           str(labels)], env=env, capture_output=True, text=True, timeout=300)


def test_offline_labels_add_gives_ids_past_the_servers_and_records_its_own(bundle_root_copy, synthetic_data, tmp_path):
    """Audit 3 M1's other half: an offline change beside a server's state directory gave out the
    ids (and took uids) the server had given on another version of the base."""
    state = tmp_path / "state"
    a, b, c = _new_labels(synthetic_data, 3, "m1i")
    with _serving_one_added(bundle_root_copy, state, a):  # the server gave id 300 to a
        pass
    done = _offline_add(bundle_root_copy / "v2", b, state, tmp_path)  # from the base, which lacks a
    assert done.returncode == 0, done.stderr
    offline = Bundle.open(bundle_root_copy / "v2.labels-2")
    try:
        assert offline.labels.ids_of([b.uid]) == [301] and bool(np.asarray(offline.retired)[300])
    finally:
        offline.close()
    refused = _offline_add(bundle_root_copy / "v2", NewLabel(a.uid, c.title), state, tmp_path)
    assert refused.returncode == 2 and "uids are never reused" in refused.stderr, refused.stderr
    registry = _registry(bundle_root_copy, state)
    try:
        assert registry.start()["active"] == "v2.labels-1"
        assert registry.change_labels(LabelChange(add=[c]))["active"] == "v2.labels-3"
        assert _ids(state, "v2.labels-3", [c.uid])[0] == [302]  # past the offline change's 301
    finally:
        registry.close()


def test_export_and_labels_add_refuse_a_version_name_the_state_directory_holds(bundle_root_copy, synthetic_data,
                                                                                 checkpoints, tmp_path, capsys,
                                                                                 monkeypatch):
    """Audit 6 F6: `export --version v2.labels-1` into the bundle root beside a server's state
    directory holding that (derived) version exited 0, and the server then saw one name in two
    places. Export refuses it before any work, naming where it is taken; so does `labels add
    --version` (its own default names already skipped the state directory's)."""
    state = tmp_path / "state"
    a, b = _new_labels(synthetic_data, 2, "f6")
    with _serving_one_added(bundle_root_copy, state, a):
        pass
    monkeypatch.setenv("SHORTLIST_STATE_DIR", str(state))
    taken = state / "bundles" / "v2.labels-1"
    assert cli(["export", str(checkpoints["v1"]), "--out", str(bundle_root_copy), "--version", "v2.labels-1"]) == 2
    err = capsys.readouterr().err
    assert f"{taken} already exists, in the state directory (SHORTLIST_STATE_DIR)" in err and "onnx" not in err, err
    labels = tmp_path / "labels.jsonl"
    labels.write_text(orjson.dumps({"uid": b.uid, "title": b.title}).decode() + "\n")
    assert cli(["labels", "add", str(bundle_root_copy / "v2"), "--labels", str(labels),
                "--version", "v2.labels-1"]) == 2
    assert f"{taken} already exists, in the state directory" in capsys.readouterr().err
    assert sorted(p.name for p in bundle_root_copy.iterdir()) == ["v1", "v2"]


def test_a_version_both_places_hold_is_the_state_directorys_listed_logged_and_served_after_a_restart(
        bundle_root_copy, tmp_path):
    """Audit 6 F6, the service's side: a bundle root's bundle named as a label change's version (an
    export before it refused that, a copy) made the name ambiguous: listed twice unflagged, a
    rollback to it 404 with its history entry dropped, and a restart fell back to the base,
    answering the retired label again. The state directory's is the version (a change is named
    only when no place holds the name, so it came first and the record names it); the root's is
    listed as shadowed and said in the log."""
    state = tmp_path / "state"
    text = "kama kelu zani savi"

    def top(c: httpx.Client) -> tuple[str, list[str]]:
        js = c.post("/v1/predict", json={"text": text, "k": 5}).json()
        return js["version"], [r["uid"] for r in js["results"][0]]

    with serve(bundle_root_copy, version="v2", env=_env(state), log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        gone = top(c)[1][0]
        r = c.post("/admin/labels/retire", json={"uids": [gone]})
        assert r.status_code == 200 and r.json()["active"] == "v2.labels-1", r.text
        renamed_copy(bundle_root_copy, "v1", "v2.labels-1")
        listed = sorted((b["place"], b["shadowed"]) for b in c.get("/admin/bundles").json()["bundles"]
                        if b["version"] == "v2.labels-1")
        assert listed == [("root", True), ("state", False)]
        assert c.post("/admin/bundles/activate", json={"version": "v2"}).status_code == 200
        r = c.post("/admin/bundles/rollback")
        assert r.status_code == 200 and r.json()["active"] == "v2.labels-1", r.text
        served = top(c)
        assert served[0] == "v2.labels-1" and gone not in served[1]
    with serve(bundle_root_copy, env=_env(state), log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=120) as c:
        served = top(c)
        assert served[0] == "v2.labels-1" and gone not in served[1], served
        assert "startup_fallback" not in s.log()
        assert f"{bundle_root_copy.resolve() / 'v2.labels-1'} (bundle root) is shadowed, never served" in s.log()
