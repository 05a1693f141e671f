"""Several serving processes on one port (SHORTLIST_PROCESSES): every process serves what any of
them activated, the metrics cover them all and say which process serves what, and a process
that dies comes back serving the recorded version."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError
from test_admin import AUTH, TOKEN

from service.api.settings import Settings
from shortlist.testing import serve

ACTIVE = re.compile(r'^shortlist_active_bundle\{pid="(\d+)",version="([^"]+)"\} 1\.0$', re.M)


def _env(state_dir, preload: bool = True) -> dict[str, str]:
    return {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(state_dir), "SHORTLIST_PROCESSES": "2",
            "SHORTLIST_ACCESS_LOG": "false", "SHORTLIST_PROCESS_PRELOAD": str(preload).lower()}


def _serving(url: str) -> dict[str, str]:
    """pid -> the version that process serves, from /metrics."""
    return dict(ACTIVE.findall(httpx.get(f"{url}/metrics").text))


def _wait_for(url: str, want: set[str], processes: int = 2, timeout: float = 90.0, gone: str = "") -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        serving = _serving(url)
        if len(serving) == processes and set(serving.values()) == want and gone not in serving:
            return serving
        if time.monotonic() > deadline:
            raise AssertionError(f"processes serve {serving}, wanted {processes} serving {want}")
        time.sleep(0.2)


def _versions_answering(url: str, n: int) -> set[str]:
    """The versions in n answers, each on a new connection (so both processes take some)."""
    seen = set()
    for i in range(n):
        with httpx.Client(base_url=url) as c:
            r = c.post("/v1/predict", json={"text": f"query {i}", "k": 3})
            assert r.status_code == 200, r.text
            seen.add(r.json()["version"])
    return seen


@pytest.mark.parametrize("preload", [True, False], ids=["arbiter-preloads", "each-process-loads"])
def test_an_activation_on_one_process_is_served_by_every_process(bundle_root, tmp_path, preload):
    state = tmp_path / "state"
    with serve(bundle_root, env=_env(state, preload), log_dir=tmp_path, timeout=120) as s:
        pids = _wait_for(s.url, {"v2"})
        r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": "v1"}, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["processes"] == {pid: "v1" for pid in pids}  # answered once all serve it
        assert _versions_answering(s.url, 40) == {"v1"}
        metrics = httpx.get(f"{s.url}/metrics").text
        assert _serving(s.url) == {pid: "v1" for pid in pids}
        # Counters are summed over the processes: at least the 40 predictions above.
        total = sum(float(v) for v in re.findall(
            r'^shortlist_http_requests_total\{method="POST",route="/v1/predict",status="200"\} (\S+)$', metrics, re.M))
        assert total >= 40
        r = httpx.post(f"{s.url}/admin/bundles/rollback", headers=AUTH, timeout=120)
        assert r.status_code == 200 and r.json()["active"] == "v2", r.text
        assert set(r.json()["processes"].values()) == {"v2"}
        assert _versions_answering(s.url, 20) == {"v2"}
    # Stopped (SIGTERM): each process let its listening socket go once; a second close of the
    # same descriptor was logged at every shutdown.
    assert s.log().count("Finished server process") == 2 and "Shutting down: Master" in s.log()
    assert "Error while closing socket" not in s.log()


def test_a_process_that_dies_comes_back_serving_the_recorded_version(bundle_root, tmp_path):
    state = tmp_path / "state"
    with serve(bundle_root, env=_env(state), log_dir=tmp_path, timeout=120) as s:
        _wait_for(s.url, {"v2"})
        r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": "v1"}, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        first, second = (int(pid) for pid in r.json()["processes"])
        os.kill(first, signal.SIGKILL)
        # The supervisor starts another process; it serves v1, and the dead one leaves /metrics.
        _wait_for(s.url, {"v1"}, gone=str(first))
        assert _versions_answering(s.url, 20) == {"v1"}
        # A process killed by a fault writes its threads' stacks to the log before it dies.
        os.kill(second, signal.SIGSEGV)
        _wait_for(s.url, {"v1"}, gone=str(second))
        assert "Fatal Python error: Segmentation fault" in s.log() and "Current thread" in s.log()
        assert _versions_answering(s.url, 20) == {"v1"}
    # A clean stop leaves no process record behind.
    assert not list((state / "processes").glob("*.json"))


def test_an_activation_sent_while_a_process_restarts_is_neither_refused_nor_held(bundle_root, tmp_path):
    """An activation sent while the arbiter restarts a process, at any point of its start-up,
    answers 200: not 409 activation_in_progress (a start-up is not another operator's activation)
    nor 503 processes_diverged after PROCESS_CONVERGE_TIMEOUT_S (the activation waited, holding
    the activation lock, for a process whose start-up waited for that lock; audit s25). The
    restarted process then serves what was activated."""
    state = tmp_path / "state"
    env = {**_env(state), "SHORTLIST_PROCESS_CONVERGE_TIMEOUT_S": "8"}
    with serve(bundle_root, env=env, log_dir=tmp_path, timeout=120) as s:
        pids = _wait_for(s.url, {"v2"})
        for delay, version in ((0.2, "v1"), (0.5, "v2"), (0.8, "v1"), (1.1, "v2")):
            victim = max(pids)
            os.kill(int(victim), signal.SIGKILL)
            time.sleep(delay)
            r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": version}, headers=AUTH, timeout=60)
            assert r.status_code == 200, (delay, r.text)
            assert set(r.json()["processes"].values()) <= {version, None}, r.text  # None: still starting
            pids = _wait_for(s.url, {version}, gone=victim)
            assert _versions_answering(s.url, 10) == {version}


def _maps_of(pid: int, directory) -> bool:
    """Whether process `pid` maps a file of `directory`."""
    with open(f"/proc/{pid}/maps") as f:
        return any(str(directory) in line for line in f)


def test_the_arbiter_shares_the_bundle_it_forked_with_until_another_version_is_active(bundle_root, tmp_path):
    """The processes start on a bundle the arbiter loaded before forking them (one copy of its
    pages for all of them); a process that dies comes back on it, and once another version is
    active the arbiter lets go of the old one."""
    state = tmp_path / "state"
    with serve(bundle_root, env=_env(state), log_dir=tmp_path, timeout=120) as s:
        pids = _wait_for(s.url, {"v2"})
        assert _maps_of(s.proc.pid, bundle_root / "v2")
        assert all(_maps_of(int(pid), bundle_root / "v2") for pid in pids)
        victim = next(iter(pids))
        os.kill(int(victim), signal.SIGKILL)
        _wait_for(s.url, {"v2"}, gone=victim)
        assert _versions_answering(s.url, 10) == {"v2"}
        r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": "v1"}, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while _maps_of(s.proc.pid, bundle_root / "v2") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _maps_of(s.proc.pid, bundle_root / "v2")
        assert _versions_answering(s.url, 10) == {"v1"}


def test_several_processes_need_a_state_directory_and_the_admin_routes_on_the_main_port(tmp_path):
    with pytest.raises(ValidationError, match="needs state_dir"):
        Settings(processes=2)
    with pytest.raises(ValidationError, match="admin_port"):
        Settings(processes=2, state_dir=tmp_path, admin_port=9000)
    Settings(processes=2, state_dir=tmp_path)
    with pytest.raises(ValidationError):
        Settings(processes=65, state_dir=tmp_path)
    with pytest.raises(ValidationError):
        Settings(processes=0)


def _gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie waiting for init to reap it has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_processes_of_a_killed_arbiter_drain_and_exit_freeing_the_port(bundle_root, tmp_path):
    """kill -9 of the arbiter: its processes notice within about a second, drain as on SIGTERM
    (SHORTLIST_DRAIN_TIMEOUT_S) and exit, so a service restarted on the port can bind it."""
    state, tmp = tmp_path / "state", tmp_path / "tmp"
    tmp.mkdir()
    env = {**_env(state), "SHORTLIST_DRAIN_TIMEOUT_S": "2", "TMPDIR": str(tmp)}
    with serve(bundle_root, env=env, log_dir=tmp_path, timeout=120) as s:
        pids = [int(pid) for pid in _wait_for(s.url, {"v2"})]
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait()
        deadline = time.monotonic() + 1 + 2 + 10  # noticed, drained, shut down
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(pid) for pid in pids), s.log()[-3000:]
        assert "the arbiter" in s.log() and "is gone" in s.log()
        port = int(s.url.rsplit(":", 1)[1])
    with serve(bundle_root, env=env, log_dir=tmp_path, timeout=120, port=port) as again:
        assert len(_wait_for(again.url, {"v2"})) == 2
        assert _versions_answering(again.url, 10) == {"v2"}
    # The run that was killed left its metrics directory; the next one removed it, and its own at its stop.
    assert not list(tmp.glob("shortlist-metrics-*"))


def _stop_one_and_activate_v1(url: str, pids: dict[str, str]) -> tuple[str, httpx.Response, float]:
    """SIGSTOP one of the serving processes, then activate v1: that pid, the answer, and its seconds."""
    stopped = next(iter(pids))
    os.kill(int(stopped), signal.SIGSTOP)
    start = time.monotonic()
    r = httpx.post(f"{url}/admin/bundles/activate", json={"version": "v1"}, headers=AUTH, timeout=120)
    return stopped, r, time.monotonic() - start


def test_an_admin_write_answers_503_naming_a_stopped_process_within_the_converge_timeout(bundle_root, tmp_path):
    """A process that is alive but does not follow (SIGSTOP, a debugger, a stuck load) holds an
    admin write no longer than SHORTLIST_PROCESS_CONVERGE_TIMEOUT_S; the change stays applied, and
    the process follows once it runs again."""
    state = tmp_path / "state"
    env = {**_env(state), "SHORTLIST_PROCESS_CONVERGE_TIMEOUT_S": "2"}
    with serve(bundle_root, env=env, log_dir=tmp_path, timeout=120) as s:
        pids = _wait_for(s.url, {"v2"})
        try:
            stopped, r, took = _stop_one_and_activate_v1(s.url, pids)
            assert r.status_code == 503 and r.json()["error"] == "processes_diverged", r.text
            message = r.json()["message"]
            assert f"process {stopped}: still serves v2 after 2 s" in message, message
            assert "SHORTLIST_PROCESS_CONVERGE_TIMEOUT_S" in message and "recorded" in message
            # The check-in-child load of v1, then 2 s: far below the stall timeout (60 s) that ended it before.
            assert took < 30, took
            assert _versions_answering(s.url, 10) == {"v1"}  # the other process serves the change already
        finally:
            for pid in pids:
                os.kill(int(pid), signal.SIGCONT)
        assert _wait_for(s.url, {"v1"}, timeout=30) == {pid: "v1" for pid in pids}


def test_metrics_name_only_the_version_each_live_process_serves(bundle_root, tmp_path):
    """However many activations, /metrics has one shortlist_active_bundle series per live process
    (as one process has one), each the version it serves, none for a process that died."""
    state = tmp_path / "state"
    with serve(bundle_root, env=_env(state), log_dir=tmp_path, timeout=120) as s:
        pids = _wait_for(s.url, {"v2"})
        for version in ["v1", "v2"] * 3:
            r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": version}, headers=AUTH, timeout=120)
            assert r.status_code == 200, r.text
        series = [line for line in httpx.get(f"{s.url}/metrics").text.splitlines()
                  if line.startswith("shortlist_active_bundle{")]
        assert sorted(series) == sorted(f'shortlist_active_bundle{{pid="{pid}",version="v2"}} 1.0' for pid in pids)
        victim = next(iter(pids))
        os.kill(int(victim), signal.SIGKILL)
        _wait_for(s.url, {"v2"}, gone=victim)  # the replacement serves
        series = [line for line in httpx.get(f"{s.url}/metrics").text.splitlines()
                  if line.startswith("shortlist_active_bundle{")]
        assert len(series) == 2 and victim not in _serving(s.url), series


def test_a_stopped_process_is_replaced_after_the_stall_timeout_and_the_replacement_follows(bundle_root, tmp_path):
    """SHORTLIST_PROCESS_STALL_TIMEOUT_S: the arbiter kills a process whose loop stopped reporting
    and starts another, which serves the version activated meanwhile; the admin write waiting for
    the stopped one answers 200 once it is gone."""
    state = tmp_path / "state"
    env = {**_env(state), "SHORTLIST_PROCESS_STALL_TIMEOUT_S": "5"}
    with serve(bundle_root, env=env, log_dir=tmp_path, timeout=120) as s:
        stopped, r, took = _stop_one_and_activate_v1(s.url, _wait_for(s.url, {"v2"}))
        assert r.status_code == 200, r.text
        assert stopped not in r.json()["processes"] and set(r.json()["processes"].values()) == {"v1"}
        assert took < 30, took  # not gunicorn's former hard-coded 60 s
        assert _gone(int(stopped))
        assert stopped not in _wait_for(s.url, {"v1"}, gone=stopped)  # the replacement serves v1


def test_the_process_timeouts_are_bounded(tmp_path):
    ok = Settings(processes=2, state_dir=tmp_path, process_converge_timeout_s=3600, process_stall_timeout_s=5)
    assert (ok.process_converge_timeout_s, ok.process_stall_timeout_s) == (3600, 5)
    for past_edge in ({"process_converge_timeout_s": 0}, {"process_converge_timeout_s": 3600.5},
                      {"process_stall_timeout_s": 4.9}, {"process_stall_timeout_s": 86_401}):
        with pytest.raises(ValidationError):
            Settings(processes=2, state_dir=tmp_path, **past_edge)


def test_publishing_from_two_threads_at_once_never_fails(bundle_root, tmp_path):
    """The sync thread and an admin request's wait for the others publish at once: through the one
    temporary file, the second rename found it gone and the activation answered 503 (CI, once)."""
    import threading

    from service.api.active_state import ActiveVersionFile
    from service.api.processes import ProcessGroup
    from service.api.registry import BundleRegistry
    from service.engine.store import BundleStore

    state = tmp_path / "state"
    state.mkdir()
    registry = BundleRegistry(BundleStore(bundle_root, state), check_timeout_s=None,
                              remembered=ActiveVersionFile(state))
    group = ProcessGroup(state, registry, interval_s=3600, converge_timeout_s=1)
    group.dir.mkdir()
    errors: list[Exception] = []

    def publish(name: str) -> None:
        for i in range(300):
            group.cannot_serve(f"{name}{i}", "a new record each time")
            try:
                group._publish()
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)

    threads = [threading.Thread(target=publish, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    registry.close()
    assert errors == []
    assert list(group.dir.iterdir()) == [group.dir / f"{os.getpid()}.json"]


def _readyz_on_new_connections(url: str, n: int) -> list[tuple[int, dict]]:
    """/readyz n times, each on a new connection (so both processes answer some)."""
    out = []
    for _ in range(n):
        with httpx.Client(base_url=url) as c:
            r = c.get("/readyz")
            out.append((r.status_code, r.json()))
    return out


def replacement_that_cannot_load(s, bundle_root: Path, state: Path) -> tuple[str, str]:
    """Two processes serving v1 (activated over v2), one killed once v1's labels.jsonl is gone: its
    replacement joins the live one and cannot load v1 (the survivor's maps stay whole). Returns
    (the survivor's pid, the replacement's), once the replacement has published its failure."""
    _wait_for(s.url, {"v2"})
    r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": "v1"}, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    victim, survivor = r.json()["processes"]
    time.sleep(2)  # the arbiter drops its preloaded v2 (no process serves it): a new process loads
    (bundle_root / "v1" / "labels.jsonl").unlink()
    os.kill(int(victim), signal.SIGKILL)
    published, deadline = state / "processes", time.monotonic() + 90
    while not (failed := [r["pid"] for r in map(json.loads, (p.read_text() for p in published.glob("*.json")))
                          if r["pid"] not in (int(victim), int(survivor)) and r.get("failed")]):
        assert time.monotonic() < deadline, s.log()[-3000:]
        time.sleep(0.2)
    return survivor, str(failed[0])


def test_readyz_answers_for_every_process_naming_one_that_serves_nothing(bundle_root_copy, tmp_path):
    """Audit 7 F2: /readyz was the answering process's, so with one process serving nothing a probe
    landing on the other said 200 (and flapped by connection). Every process now answers for all:
    503 naming the pid that serves nothing and why, until every process serves. The access log
    names the process that answered (I2)."""
    state = tmp_path / "state"
    env = {**_env(state), "SHORTLIST_ACCESS_LOG": "true"}
    with serve(bundle_root_copy, env=env, log_dir=tmp_path, timeout=120) as s:
        survivor, stuck = replacement_that_cannot_load(s, bundle_root_copy, state)
        answers = _readyz_on_new_connections(s.url, 12)
        assert {status for status, _ in answers} == {503}, answers
        for _, body in answers:
            assert set(body["processes"]) == {stuck}, body
            assert "v1" in body["processes"][stuck] and "labels.jsonl" in body["processes"][stuck], body
        # Another activation: the process that could not serve v1 follows v2, and every process is ready.
        r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": "v2"}, headers=AUTH, timeout=120)
        assert r.status_code == 200 and set(r.json()["processes"]) == {survivor, stuck}, r.text
        answers = _readyz_on_new_connections(s.url, 12)
        assert {status for status, _ in answers} == {200}, answers
        assert "shortlist_state_writable 1.0" in httpx.get(f"{s.url}/metrics").text
        lines = [json.loads(line) for line in s.log().splitlines() if line.startswith('{"ts"')]
        assert {rec["pid"] for rec in lines if rec.get("route") == "/readyz"} >= {int(survivor), int(stuck)}


def test_a_process_restarted_beside_a_serving_one_takes_no_connection_until_it_serves(bundle_root, tmp_path):
    """Audit 7 F2: a restarted process accepted from the shared socket before it had a bundle, so
    a share of the predictions got 503 not_ready while a process that serves was there. It now
    holds its start-up until its first load ends: every prediction across the restart is 200, and
    /readyz stays 200 (the process loading answers nobody)."""
    state = tmp_path / "state"
    with serve(bundle_root, env=_env(state), log_dir=tmp_path, timeout=120) as s:
        _wait_for(s.url, {"v2"})
        r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": "v1"}, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        victim = next(iter(r.json()["processes"]))
        time.sleep(2)  # the arbiter drops its preloaded v2: the new process loads (and checks) v1 itself
        os.kill(int(victim), signal.SIGKILL)
        deadline, answers, serving = time.monotonic() + 60, [], {}
        while time.monotonic() < deadline:
            for _ in range(10):
                with httpx.Client(base_url=s.url) as c:
                    answers.append((c.post("/v1/predict", json={"text": "a", "k": 1}).status_code,
                                    c.get("/readyz").status_code))
            serving = _serving(s.url)
            if len(serving) == 2 and victim not in serving:
                break
        assert len(serving) == 2 and set(serving.values()) == {"v1"} and victim not in serving, serving
        assert set(answers) == {(200, 200)}, [a for a in answers if a != (200, 200)][:5]


def test_a_restarted_process_whose_load_outlasts_the_converge_timeout_takes_connections_and_says_so(
        bundle_root, tmp_path):
    """The hold above is bounded by PROCESS_CONVERGE_TIMEOUT_S: a restarted process still loading
    then takes connections (a load that never ends must not keep a process out of service
    unseen), logs startup_hold_timeout naming itself, answers 503 not_ready (never a 500) until its
    load ends, then serves the recorded version like the others."""
    state = tmp_path / "state"
    env = {**_env(state, preload=False), "SHORTLIST_PROCESS_CONVERGE_TIMEOUT_S": "0.001"}
    with serve(bundle_root, env=env, log_dir=tmp_path, timeout=120) as s:
        first = _wait_for(s.url, {"v2"})
        victim = next(iter(first))
        os.kill(int(victim), signal.SIGKILL)
        deadline, answers, serving = time.monotonic() + 60, [], {}
        while time.monotonic() < deadline:
            with httpx.Client(base_url=s.url) as c:
                r = c.post("/v1/predict", json={"text": "a", "k": 1})
                answers.append((r.status_code, r.json().get("error")))
            serving = _serving(s.url)
            if len(serving) == 2 and victim not in serving:
                break
        assert len(serving) == 2 and set(serving.values()) == {"v2"} and victim not in serving, serving
        assert set(answers) <= {(200, None), (503, "not_ready")}, answers
        (replacement,) = set(serving) - set(first)
        held = [json.loads(line) for line in s.log().splitlines() if "startup_hold_timeout" in line]
        assert any(f"process {replacement} still loads" in rec["message"] for rec in held), held
