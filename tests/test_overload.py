"""Admission control and clients that hold the service, on a real `shortlist serve` over loopback
(audit s15 A2, A5): the bounded line in front of the engine (503 `overloaded` with Retry-After),
work whose client left is not computed (499), clients that never read their answers are
disconnected after the send timeout, and a request cancelled at shutdown is one JSON line. The
runner's exact edges (EngineRunner without HTTP) are in test_api_batching.py.

A burst is sent while the server is stopped (SIGSTOP) and released at once (SIGCONT): the
server then reads every request in one turn of its loop, before any engine call ends, so what
the line admits does not depend on the machine's speed. Each connection has had one answer
(GET /healthz) before the burst: a connection the server had accepted but not yet watched
would be read a turn later, behind an engine call (CI once saw 8 answers instead of 4 that way).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from _api_helpers import wait_until

from service.api.settings import SettingsError, load_settings
from shortlist.testing import serve

WORDS = "network traffic monitor python library game arcade kernel driver font editor text audio video".split()


def _texts(n: int, words: int = 40) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words)) for i in range(n)]


def _request(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


def _connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _connect_served(server) -> tuple[socket.socket, object]:
    """A keep-alive connection the server has answered once (so its loop watches it), and its reader."""
    sock = _connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
    reader = sock.makefile("rb")
    status, _, _ = _read_response(sock, reader)
    assert status == 200
    return sock, reader


def _read_response(sock: socket.socket, reader=None) -> tuple[int, dict[str, str], dict]:
    """One answer read from `sock` (through `reader`, its file, when more answers follow on it)."""
    reader = reader or sock.makefile("rb")
    status_line = reader.readline()
    assert status_line, "connection closed before an answer"
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.lower()] = value.strip()
    body = reader.read(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, json.loads(body)


@contextmanager
def _stopped(server) -> Iterator[None]:
    """The server process stopped, and released at the end (its loop then sees everything at once)."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def _burst(server, requests: list[bytes]) -> list[tuple[int, dict[str, str], dict]]:
    """Each request on its own connection, all arriving at once; their answers in order."""
    served = [_connect_served(server) for _ in requests]
    try:
        with _stopped(server):
            for (sock, _), request in zip(served, requests, strict=True):
                sock.sendall(request)
        return [_read_response(sock, reader) for sock, reader in served]
    finally:
        for sock, _ in served:
            sock.close()


def _metric(server, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{key}="{value}"' in line for key, value in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _engine_calls(server, scorer: str) -> float:
    return _metric(server, "shortlist_engine_batch_size_count", scorer=scorer)


def _assert_overloaded(status: int, headers: dict[str, str], body: dict, reason: str) -> None:
    assert status == 503 and body["error"] == "overloaded", body
    assert headers["retry-after"] == "1" and reason in body["message"], (headers, body)


# -- the bounded line -----------------------------------------------------------------------------

# One engine call at a time; 4 texts may wait for it (a request's most texts, MAX_BATCH, too).
LINE = {"SHORTLIST_WORKERS": "1", "SHORTLIST_MAX_BATCH": "4", "SHORTLIST_MAX_QUEUED_TEXTS": "4"}


@pytest.fixture(scope="module")
def small_line(bundle_root, tmp_path_factory):
    with serve(bundle_root, env=LINE, log_dir=tmp_path_factory.mktemp("line")) as s:
        yield s


def test_a_burst_of_batches_past_the_line_gets_503_overloaded_and_the_admitted_are_answered(small_line):
    shed_before = _metric(small_line, "shortlist_requests_shed_total", reason="queue_full")
    batch = _request("/v1/predict/tree", {"texts": _texts(4), "k": 10})
    answers = _burst(small_line, [batch] * 12)
    ok = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] != 200]
    # One batch computes at once, the next waits (4 texts: the line's bound); every other is refused.
    assert len(ok) == 2, [a[0] for a in answers]
    assert all(len(body["results"]) == 4 and all(len(r) == 10 for r in body["results"]) for _, _, body in ok)
    for status, headers, body in refused:
        _assert_overloaded(status, headers, body, "4 texts wait for it")
    assert _metric(small_line, "shortlist_requests_shed_total", reason="queue_full") == shed_before + len(refused)
    assert httpx.post(f"{small_line.url}/v1/predict", json={"texts": _texts(4)}).status_code == 200  # it passes


def test_a_burst_of_single_texts_past_the_line_gets_503_and_exactly_the_bound_is_answered(small_line):
    single = _request("/v1/predict", {"text": "network traffic monitor", "k": 5})
    answers = _burst(small_line, [single] * 10)
    statuses = [a[0] for a in answers]
    assert statuses.count(200) == 4, statuses  # at the bound: 4 texts wait, and leave as one engine call
    for status, headers, body in answers:
        if status != 200:
            _assert_overloaded(status, headers, body, "at most 4")


def test_the_wait_bound_refuses_what_waited_longer_before_its_engine_call(bundle_root, tmp_path):
    env = {"SHORTLIST_WORKERS": "1", "SHORTLIST_MAX_QUEUE_WAIT_MS": "1"}
    with serve(bundle_root, env=env, log_dir=tmp_path) as s:
        shed_before = _metric(s, "shortlist_requests_shed_total", reason="queue_wait")
        heavy = _request("/v1/predict/tree", {"texts": _texts(128), "k": 100, "beam": 256})
        single = _request("/v1/predict", {"text": "kernel driver", "k": 5})
        answers = _burst(s, [heavy, heavy, heavy, single, single])
        # The first to reach the engine starts at once; everything behind it waits far longer than 1 ms.
        assert [a[0] for a in answers].count(200) == 1, answers
        for status, headers, body in answers:
            if status != 200:
                _assert_overloaded(status, headers, body, "waited")
        assert _metric(s, "shortlist_requests_shed_total", reason="queue_wait") == shed_before + 4
        assert httpx.post(f"{s.url}/v1/predict", json={"text": "kernel"}).status_code == 200  # an idle engine: no wait


def test_a_lone_request_waits_batch_max_wait_for_company(bundle_root, tmp_path):
    """SHORTLIST_BATCH_MAX_WAIT_MS holds a request that finds the engine idle that long, so the
    ones that come meanwhile leave with it in one engine call (it was computed at once, alone)."""
    with serve(bundle_root, env={"SHORTLIST_BATCH_MAX_WAIT_MS": "1000"}, log_dir=tmp_path) as s:
        calls, texts = _engine_calls(s, "alpha"), _metric(s, "shortlist_engine_batch_size_sum", scorer="alpha")
        served = [_connect_served(s) for _ in range(3)]
        started = time.monotonic()
        for sock, _ in served:  # one after another, well within the wait
            sock.sendall(_request("/v1/predict", {"text": "kernel driver", "k": 5}))
            time.sleep(0.05)
        answers = [_read_response(sock, reader) for sock, reader in served]
        assert [a[0] for a in answers] == [200] * 3 and time.monotonic() - started >= 1.0
        assert _engine_calls(s, "alpha") == calls + 1
        assert _metric(s, "shortlist_engine_batch_size_sum", scorer="alpha") == texts + 3
        for sock, _ in served:
            sock.close()


def test_the_defaults_do_not_shed_sixteen_connections_of_full_batches_at_once(bundle_root, tmp_path):
    with serve(bundle_root, log_dir=tmp_path) as s:
        heavy = _request("/v1/predict/tree", {"texts": _texts(128), "k": 100, "beam": 256})
        answers = _burst(s, [heavy] * 16 + [_request("/v1/predict", {"text": "audio video"})] * 16)
        assert [a[0] for a in answers] == [200] * 32
        assert _metric(s, "shortlist_requests_shed_total") == 0


# -- clients that leave while they wait ----------------------------------------------------------------

def test_requests_whose_clients_left_while_waiting_are_not_computed_and_count_499(bundle_root, tmp_path):
    env = {"SHORTLIST_WORKERS": "1", "SHORTLIST_MAX_BATCH": "1024"}
    with serve(bundle_root, env=env, log_dir=tmp_path) as s:
        alpha_before, gone_before = _engine_calls(s, "alpha"), _metric(s, "shortlist_http_requests_total", status="499")
        # A tree batch holds the only engine slot for a while (1,024 texts); alpha requests wait behind it.
        tree_before = _engine_calls(s, "tree")
        holder = _connect(s)
        holder.sendall(_request("/v1/predict/tree", {"texts": _texts(1024), "k": 100, "beam": 256}))
        wait_until(lambda: _engine_calls(s, "tree") > tree_before, "the holder's engine call", 30)
        waiting = [_request("/v1/predict", {"texts": _texts(4)})] * 5 + [_request("/v1/predict", {"text": "font"})] * 4
        socks = [_connect_served(s)[0] for _ in waiting]
        with _stopped(s):
            for sock, request in zip(socks, waiting, strict=True):
                sock.sendall(request)
        for i, sock in enumerate(socks):  # they leave while the holder computes: a close, or a reset
            if i % 2:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()
        status, _, body = _read_response(holder)
        holder.close()
        assert status == 200 and len(body["results"]) == 1024
        # Each is counted, then logged, when its handler returns, on the server's schedule: the
        # log line is the later of the two.
        wait_until(lambda: _gone_lines(s) >= 9, "the 9 requests' 499 lines")
        assert _engine_calls(s, "alpha") == alpha_before  # none of the 9 reached the engine
        assert _metric(s, "shortlist_http_requests_total", status="499") == gone_before + 9
        assert _gone_lines(s) == 9
        assert "Traceback" not in s.log()
        assert httpx.post(f"{s.url}/v1/predict", json={"text": "font"}).status_code == 200


def _gone_lines(server) -> int:
    """The access log's 499 lines for /v1/predict."""
    records = [json.loads(line) for line in server.log().splitlines() if line.startswith('{"ts"')]
    return sum(1 for r in records if r["route"] == "/v1/predict" and r["status"] == 499)


# -- clients that never read -------------------------------------------------------------------------

def _server_connections(pid: int, client_ports: set[int]) -> int:
    """How many of process `pid`'s TCP sockets are connected to these client ports (loopback,
    IPv4): the clients' own connections, whatever else the server opens or closes meanwhile."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").removesuffix("]"))
        except OSError:
            pass  # closed meanwhile
    with open(f"/proc/{pid}/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(1 for row in rows if row[9] in inodes and int(row[2].rsplit(":", 1)[1], 16) in client_ports)


def _never_reading(server, pipelined: int) -> socket.socket:
    """A client that sends `pipelined` requests with large answers (~0.5 MB each) and reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = server.url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    sock.sendall(_request("/v1/predict/tree", {"texts": _texts(128), "k": 100}) * pipelined)
    return sock


def test_a_client_that_never_reads_is_disconnected_after_the_send_timeout(bundle_root, tmp_path):
    with serve(bundle_root, env={"SHORTLIST_SEND_TIMEOUT_S": "1"}, log_dir=tmp_path) as s:
        pid = s.proc.pid
        tree_before, gone_before = _engine_calls(s, "tree"), _metric(s, "shortlist_http_requests_total", status="499")
        clients = [_never_reading(s, 12) for _ in range(4)]
        ports = {sock.getsockname()[1] for sock in clients}
        try:
            wait_until(lambda: _server_connections(pid, ports) == 4, "the 4 connections held", 10)
            # Within the timeout (1 s) of the server's buffers filling, every connection is closed.
            wait_until(lambda: _server_connections(pid, ports) == 0, "the 4 connections closed", 30)
            # What each held: answers buffered, the next one waiting to be written (499, counted
            # once its handler returns, after the close); the requests pipelined behind it were never computed.
            wait_until(lambda: _metric(s, "shortlist_http_requests_total", status="499") >= gone_before + 4,
                       "the 4 requests counted 499")
            assert _engine_calls(s, "tree") - tree_before <= 4 * 6
            assert _metric(s, "shortlist_http_requests_total", status="499") == gone_before + 4
        finally:
            for sock in clients:
                sock.close()
        assert httpx.post(f"{s.url}/v1/predict", json={"text": "kernel"}).status_code == 200
        assert "Traceback" not in s.log()


def test_a_client_that_reads_late_but_within_the_send_timeout_gets_every_answer(bundle_root, tmp_path):
    with serve(bundle_root, env={"SHORTLIST_SEND_TIMEOUT_S": "3"}, log_dir=tmp_path) as s:
        sock = _never_reading(s, 4)
        try:
            time.sleep(1)  # the server's buffers fill; it waits for this client to read
            sock.settimeout(30)
            reader = sock.makefile("rb")
            answers = [_read_response(sock, reader) for _ in range(4)]
        finally:
            sock.close()
        assert [a[0] for a in answers] == [200] * 4 and all(len(a[2]["results"]) == 128 for a in answers)


def test_a_request_cancelled_at_shutdown_is_one_json_line_not_a_traceback(bundle_root, tmp_path):
    env = {"SHORTLIST_SEND_TIMEOUT_S": "600", "SHORTLIST_DRAIN_TIMEOUT_S": "1"}
    with serve(bundle_root, env=env, log_dir=tmp_path) as s:
        tree_before = _engine_calls(s, "tree")
        clients = [_never_reading(s, 4) for _ in range(3)]
        try:
            # Each connection holds a request waiting to write its answer (the second computed).
            wait_until(lambda: _engine_calls(s, "tree") >= tree_before + 6, "the 6 engine calls", 30)
            time.sleep(0.5)
            s.proc.send_signal(signal.SIGTERM)
            s.proc.wait(timeout=20)  # stops within the drain timeout (uvicorn then re-raises SIGTERM: -15)
        finally:
            for sock in clients:
                sock.close()
        log = s.log()
    cancelled = [json.loads(line) for line in log.splitlines() if '"request_cancelled"' in line]
    assert len(cancelled) == 3 and all(c["path"] == "/v1/predict/tree" for c in cancelled), log[-3000:]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


@pytest.mark.parametrize("drain", ["0", "0.5"])
def test_sigterm_drains_no_longer_than_a_drain_timeout_below_one_second(bundle_root, tmp_path, drain):
    # `int(DRAIN_TIMEOUT_S) or None` made 0 and 0.5 None, uvicorn's "no bound": a request held
    # mid-body kept the process until BODY_TIMEOUT_S (here 30 s), not the drain the README promises.
    env = {"SHORTLIST_DRAIN_TIMEOUT_S": drain, "SHORTLIST_BODY_TIMEOUT_S": "30"}
    with serve(bundle_root, env=env, log_dir=tmp_path) as s:
        sock = socket.create_connection(("127.0.0.1", int(s.url.rsplit(":", 1)[1])))
        try:
            sock.sendall(b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b'content-length: 100\r\n\r\n{"text"')
            time.sleep(0.5)  # the request is in flight, its body a third of the way
            start = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            s.proc.wait(timeout=60)
            took = time.monotonic() - start
        finally:
            sock.close()
    assert took < float(drain) + 3, took


# -- the settings' edges ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("env", "problem"), [
    ({"SHORTLIST_MAX_QUEUED_TEXTS": "0"}, "SHORTLIST_MAX_QUEUED_TEXTS='0': input should be greater than or equal to 1"),
    ({"SHORTLIST_MAX_QUEUED_TEXTS": "127"}, "SHORTLIST_MAX_QUEUED_TEXTS=127 is below SHORTLIST_MAX_BATCH=128"),
    ({"SHORTLIST_MAX_QUEUE_WAIT_MS": "0.5"},
     "SHORTLIST_MAX_QUEUE_WAIT_MS='0.5': input should be greater than or equal to 1"),
    ({"SHORTLIST_SEND_TIMEOUT_S": "0"}, "SHORTLIST_SEND_TIMEOUT_S='0': input should be greater than 0"),
])
def test_limits_past_their_bounds_are_refused_naming_the_variable(monkeypatch, env, problem):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert problem in str(err.value)


def test_limits_at_their_bounds_are_taken(monkeypatch):
    for name, value in {"SHORTLIST_MAX_QUEUED_TEXTS": "128", "SHORTLIST_MAX_QUEUE_WAIT_MS": "1",
                        "SHORTLIST_SEND_TIMEOUT_S": "0.001"}.items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    assert (settings.max_queued_texts, settings.max_queue_wait_ms, settings.send_timeout_s) == (128, 1.0, 0.001)
