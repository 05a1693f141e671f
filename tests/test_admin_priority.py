"""An operator's activation or rollback during a feed of label changes (audit 5, B4), over a real
uvicorn: it waits for the change in progress instead of a 409, goes before the changes still queued
(here or in another process sharing the state directory), and past SHORTLIST_ACTIVATION_LOCK_WAIT_S
answers 503 naming what held the lock; a second activation or rollback meanwhile is still a 409."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from _api_helpers import wait_until
from pydantic import ValidationError
from test_admin import AUTH, TOKEN
from test_admin_labels import _Load
from test_label_changes import _new_labels
from test_processes import _wait_for

from service.api.active_state import LOCK_FILE, OPERATOR_LOCK_FILE
from service.api.settings import Settings
from shortlist.testing import serve

# A steady feed: the audit's 8 clients, scaled to a 2-core CI machine.
FEED_THREADS = 4


def _env(state_dir: Path, **extra: str) -> dict[str, str]:
    return {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(state_dir),
            "SHORTLIST_LABEL_CHANGES_PER_MINUTE": "100000", "SHORTLIST_ACCESS_LOG": "false", **extra}


class _Feed(_Load):
    """Threads each sending label changes one after another (a catalogue feed) until stopped, each
    on its own connection; every answer kept as (sent, answered, status, body), in monotonic time."""

    def __init__(self, url: str, synthetic_data: Path, threads: int = FEED_THREADS) -> None:
        super().__init__(url, [], clients=threads)
        self.answers = []
        self._labels = [_new_labels(synthetic_data, 100, f"feed{i}") for i in range(threads)]

    def _run(self, seed: int) -> None:
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=300) as c:
            for lab in self._labels[seed]:
                if self._stop.is_set():
                    return
                sent = time.monotonic()
                r = c.post("/admin/labels", json={"labels": [{"uid": lab.uid, "title": lab.title}]})
                self.answers.append((sent, time.monotonic(), r.status_code, r.json()))

    def wait_for_answers(self, n: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.answers) < n:
            assert time.monotonic() < deadline, f"{len(self.answers)} label changes answered, waited for {n}"
            time.sleep(0.05)


def _timed(client: httpx.Client, method: str, path: str, **kw) -> tuple[httpx.Response, float, float]:
    """(answer, sent, answered) in monotonic time."""
    sent = time.monotonic()
    r = client.request(method, path, **kw)
    return r, sent, time.monotonic()


def _ids_given_once(state: Path) -> None:
    """Across every version the changes wrote, each added uid has one id and each id one uid (per base)."""
    ids_of, uids_of = defaultdict(set), defaultdict(set)
    for version in (state / "bundles").iterdir():
        if not version.is_dir():  # what retention leaves of a version it removed
            continue
        base = version.name.split(".labels-")[0]
        for i, line in enumerate((version / "labels.jsonl").read_text().splitlines()):
            uid = json.loads(line)["uid"]
            if uid.startswith("feed"):
                ids_of[base, uid].add(i)
                uids_of[base, i].add(uid)
    assert ids_of and all(len(v) == 1 for v in ids_of.values()), ids_of
    assert all(len(v) == 1 for v in uids_of.values()), uids_of


def _consistent(url: str, state: Path) -> str:
    """The version active.json records, once it is what is served and listed (and none is left unconfirmed)."""
    recorded = json.loads((state / "active.json").read_text())["version"]
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        assert c.get("/readyz").json()["version"] == recorded
        assert c.post("/v1/predict", json={"text": "x"}).json()["version"] == recorded
        listed = c.get("/admin/bundles").json()
        assert listed["active"] == recorded and not any(b["unconfirmed"] for b in listed["bundles"]), listed
    return recorded


def test_an_activation_and_a_rollback_go_before_a_feed_of_label_changes(bundle_root, synthetic_data, tmp_path):
    state = tmp_path / "state"
    env = _env(state, SHORTLIST_LOAD_CHECK_IN_CHILD="false")
    with serve(bundle_root, env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=300) as c:
        with _Feed(s.url, synthetic_data) as feed:
            feed.wait_for_answers(FEED_THREADS)  # changes now queue back to back
            act, act_sent, act_done = _timed(c, "POST", "/admin/bundles/activate", json={"version": "v1"})
            assert act.status_code == 200 and act.json()["active"] == "v1", act.text
            assert act_done - act_sent < 60  # SHORTLIST_ACTIVATION_LOCK_WAIT_S's default, and the load
            feed.wait_for_answers(len(feed.answers) + FEED_THREADS)  # changes derived from v1 serve meanwhile
            rb, rb_sent, rb_done = _timed(c, "POST", "/admin/bundles/rollback")
            assert rb.status_code == 200 and rb.json()["active"].startswith("v1"), rb.text
            assert rb_done - rb_sent < 60
            feed.wait_for_answers(len(feed.answers) + FEED_THREADS)
        assert [a for a in feed.answers if a[2] != 200] == []  # no label change refused or lost
        changes = [body for _, _, _, body in feed.answers]
        # The changes queued when the activation arrived were applied after it (derived from v1):
        # only the one in progress (if any) went before it.
        queued = [body["active"] for sent, answered, _, body in feed.answers if sent < act_sent and answered > act_done]
        assert queued and sum(not v.startswith("v1.") for v in queued) <= 1, queued
        # No change answered after the rollback derives from the version it replaced.
        after = [body["previous"] for _, answered, _, body in feed.answers if answered > rb_done]
        assert after and rb.json()["previous"] not in after, (rb.json(), after)
        # What is recorded is what serves: the last change's version, from which nothing derived.
        recorded = _consistent(s.url, state)
        assert recorded in {b["active"] for b in changes} and recorded not in {b["previous"] for b in changes}
    _ids_given_once(state)


@contextmanager
def _held(path: Path, note: str = ""):
    """Another process's hold on one of the state directory's activation locks (this test process,
    not the server's): flock'd until the block ends."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if note:
            os.ftruncate(fd, 0)
            os.write(fd, note.encode())
        yield
    finally:
        os.close(fd)


def _flock_held(path: Path, pid: int) -> bool:
    """Whether process `pid` holds a flock on `path`, read from /proc/locks: probing it with a lock
    of the test's own would make the server's non-blocking attempt at that moment fail."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as f:
        rows = [line.split() for line in f]
    return any(row[1] == "FLOCK" and row[4] == str(pid) and int(row[5].rsplit(":", 1)[1]) == inode for row in rows)


def test_an_activation_waits_for_the_lock_up_to_its_bound_then_answers_503_naming_the_holder(bundle_root,
                                                                                             tmp_path):
    state = tmp_path / "state"
    env = _env(state, SHORTLIST_ACTIVATION_LOCK_WAIT_S="3", SHORTLIST_LOAD_CHECK_IN_CHILD="false")
    with serve(bundle_root, env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=60) as c:
        # Held for less than the bound: the activation waits, then goes through.
        with ThreadPoolExecutor(1) as pool:
            with _held(state / LOCK_FILE):
                waiting = pool.submit(_timed, c, "POST", "/admin/bundles/activate", json={"version": "v1"})
                time.sleep(1.5)
                assert not waiting.done()
            r, sent, answered = waiting.result()
        assert r.status_code == 200 and r.json()["active"] == "v1", r.text
        assert answered - sent >= 1.4

        # Held past it: 503 naming the holder, with Retry-After; nothing changed.
        with _held(state / LOCK_FILE, "process 4242: shortlist labels add (offline), since noon"), \
                ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(_timed, c, "POST", "/admin/bundles/rollback")
            # In progress once it holds the operator's turn (then it waits for the lock held here):
            # sent sooner, a second one could take the turn first and wait in its place.
            wait_until(lambda: _flock_held(state / OPERATOR_LOCK_FILE, s.proc.pid), "the rollback's turn", 30)
            # A second activation or rollback meanwhile: 409 at once, as ever.
            for second in (c.post("/admin/bundles/activate", json={"version": "v2"}),
                           c.post("/admin/bundles/rollback")):
                assert second.status_code == 409 and second.json()["error"] == "activation_in_progress", second.text
            r, sent, answered = waiting.result()
        assert r.status_code == 503 and r.json()["error"] == "activation_lock_busy", r.text
        assert 3 <= answered - sent < 15
        assert int(r.headers["retry-after"]) >= 1
        message = r.json()["message"]
        assert "after 3 s (SHORTLIST_ACTIVATION_LOCK_WAIT_S)" in message and "shortlist labels add (offline)" in message
        assert json.loads((state / "active.json").read_text())["version"] == "v1"
        assert c.get("/readyz").json()["version"] == "v1"
        # Free again: the rollback goes through.
        r = c.post("/admin/bundles/rollback")
        assert r.status_code == 200 and r.json()["active"] == "v2", r.text


def test_with_no_wait_an_activation_meeting_a_held_lock_is_refused_at_once(bundle_root, tmp_path):
    state = tmp_path / "state"
    env = _env(state, SHORTLIST_ACTIVATION_LOCK_WAIT_S="0", SHORTLIST_LOAD_CHECK_IN_CHILD="false")
    with serve(bundle_root, env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=60) as c:
        with _held(state / LOCK_FILE):
            r, sent, answered = _timed(c, "POST", "/admin/bundles/activate", json={"version": "v1"})
        assert r.status_code == 503 and r.json()["error"] == "activation_lock_busy", r.text
        assert answered - sent < 2 and "another process sharing the state directory" in r.json()["message"]
        assert c.post("/admin/bundles/activate", json={"version": "v1"}).status_code == 200


def test_the_activation_lock_wait_is_bounded(tmp_path):
    assert Settings(activation_lock_wait_s=3600).activation_lock_wait_s == 3600
    assert Settings(activation_lock_wait_s=0).activation_lock_wait_s == 0
    for past_edge in (-0.1, 3600.5):
        with pytest.raises(ValidationError):
            Settings(activation_lock_wait_s=past_edge)


def test_label_changes_let_another_process_activation_go_first(bundle_root, synthetic_data, tmp_path):
    """The turn of an activation or rollback in progress on another process (its lock file held by
    this test process): a label change waits for it, is applied after it, and is never refused."""
    state = tmp_path / "state"
    env = _env(state, SHORTLIST_LOAD_CHECK_IN_CHILD="false")
    label = _new_labels(synthetic_data, 1, "late")[0]
    with serve(bundle_root, env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=300) as c:
        with ThreadPoolExecutor(1) as pool:
            with _held(state / OPERATOR_LOCK_FILE):
                # Here too, a concurrent activation or rollback is a 409.
                r = c.post("/admin/bundles/activate", json={"version": "v1"})
                assert r.status_code == 409 and r.json()["error"] == "activation_in_progress", r.text
                change = pool.submit(c.post, "/admin/labels",
                                     json={"labels": [{"uid": label.uid, "title": label.title}]})
                time.sleep(1.5)
                assert not change.done()
                assert json.loads((state / "active.json").read_text())["version"] == "v2"
            r = change.result()
        assert r.status_code == 200 and r.json()["active"] == "v2.labels-1", r.text


def test_with_two_processes_an_activation_and_a_rollback_go_before_a_feed(bundle_root, synthetic_data, tmp_path):
    state = tmp_path / "state"
    env = _env(state, SHORTLIST_PROCESSES="2", SHORTLIST_LOAD_CHECK_IN_CHILD="false")

    def admin(method: str, path: str, **kw) -> tuple[httpx.Response, float, float]:
        with httpx.Client(base_url=s.url, headers=AUTH, timeout=300) as c:  # a new connection: either process
            return _timed(c, method, path, **kw)

    with serve(bundle_root, env=env, log_dir=tmp_path, timeout=120) as s:
        pids = _wait_for(s.url, {"v2"})
        with _Feed(s.url, synthetic_data) as feed:
            feed.wait_for_answers(FEED_THREADS)
            act, sent, answered = admin("POST", "/admin/bundles/activate", json={"version": "v1"})
            assert act.status_code == 200 and act.json()["active"] == "v1", act.text
            assert answered - sent < 60 and set(act.json()["processes"]) == set(pids)
            feed.wait_for_answers(len(feed.answers) + FEED_THREADS)
            rb, sent, answered = admin("POST", "/admin/bundles/rollback")
            assert rb.status_code == 200 and rb.json()["active"].startswith("v1"), rb.text
            assert answered - sent < 60
        assert [a for a in feed.answers if a[2] != 200] == []
        recorded = json.loads((state / "active.json").read_text())["version"]
        _wait_for(s.url, {recorded})  # every process serves what is recorded
        assert _consistent(s.url, state) == recorded
    _ids_given_once(state)


def test_an_operator_turn_taken_between_a_changes_look_and_its_lock_still_goes_first(tmp_path):
    """The window the turn left open: a label change looked (no operator waiting), then another
    process's activation took its turn before the change took the activation lock. The change lets
    the lock go again and waits for the turn to end, instead of going first."""
    from service.api.activation import ActivationGate
    from service.api.active_state import ActiveVersionFile

    state = ActiveVersionFile(tmp_path / "state")
    state.prepare()
    turn_taken, turn_over = threading.Event(), threading.Event()

    class TurnTakenAfterTheLook(ActivationGate):
        def operator_waiting(self) -> bool:
            waiting = super().operator_waiting()
            if not turn_taken.is_set():  # the other process's activation arrives right after this look
                threading.Thread(target=_hold_turn, args=(tmp_path / "state" / OPERATOR_LOCK_FILE,),
                                 daemon=True).start()
                turn_taken.wait(10)
            return waiting

    def _hold_turn(path: Path) -> None:
        with _held(path):
            turn_taken.set()
            turn_over.wait(30)

    applied: list[float] = []

    def change() -> None:
        with TurnTakenAfterTheLook(state).exclusive("a label change", wait_s=30, change=True):
            applied.append(time.monotonic())

    worker = threading.Thread(target=change)
    worker.start()
    assert turn_taken.wait(10)
    time.sleep(1.0)
    assert not applied, "the change went before the operator's turn"
    released = time.monotonic()
    turn_over.set()
    worker.join(30)
    assert applied and applied[0] >= released


def test_a_holder_killed_with_the_lock_leaves_no_note_to_the_next(tmp_path):
    """A process killed while it held the activation lock leaves its note in the lock file (the
    kernel frees the lock, nothing clears the note). Whoever holds the lock next names itself,
    with or without saying what for: those that find it busy are not told of the dead process."""
    from service.api.active_state import ActiveVersionFile

    state = ActiveVersionFile(tmp_path / "state")
    state.prepare()
    (tmp_path / "state" / LOCK_FILE).write_text("process 999999: a label change, since 2026-01-01T00:00:00Z")
    for what in ("", "a label change"):
        with state.exclusive(what):
            note = state.holder()
            assert note is not None and note.startswith(f"process {os.getpid()}: ") and "999999" not in note, note
        assert state.holder() is None
