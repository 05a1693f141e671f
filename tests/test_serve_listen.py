"""`shortlist serve` binds its ports before it loads anything (service.api.listeners): a port that
cannot be had stops it at once with exit status 3 and one line naming the address, in every
serving mode (one process, the admin API on a port of its own, several processes under the
arbiter), with no bundle loaded and no `bundle_activated` logged for a server that never listened."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import uvicorn
from test_admin import TOKEN

from service.api.listeners import BoundServer, PortUnavailable, bind_sockets


def serve(bundle_root, port: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "shortlist.cli", "serve", "--bundle-root", str(bundle_root), "--host",
               "127.0.0.1", "--port", str(port)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SHORTLIST_LOG_LEVEL": "info", **env})


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["one process", "several processes"])
def test_a_taken_port_stops_serve_before_any_load(bundle_root, tmp_path, mode):
    env = {"SHORTLIST_PROCESSES": "2", "SHORTLIST_STATE_DIR": str(tmp_path / "state")} if mode != "one process" else {}
    with socket.create_server(("127.0.0.1", 0)) as taker:
        port = taker.getsockname()[1]
        r = serve(bundle_root, port, env)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines()[-1] == \
        f"shortlist serve: error: cannot listen on 127.0.0.1:{port}: address already in use"
    assert "bundle_activated" not in r.stdout + r.stderr and "Connection in use" not in r.stderr  # no retries


def test_a_taken_admin_port_stops_serve_naming_it(bundle_root, tmp_path):
    main_port = free_port()
    with socket.create_server(("127.0.0.1", 0)) as taker:
        admin_port = taker.getsockname()[1]
        r = serve(bundle_root, main_port, {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_ADMIN_PORT": str(admin_port)})
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert f"cannot listen on 127.0.0.1:{admin_port}: address already in use" in r.stderr
    assert "bundle_activated" not in r.stdout
    with socket.create_server(("127.0.0.1", main_port)):
        pass  # the main port was let go


def test_bound_sockets_do_not_listen_until_handed_over():
    sockets = bind_sockets("127.0.0.1", 0)
    try:
        assert len(sockets) == 1
        port = sockets[0].getsockname()[1]
        with pytest.raises(ConnectionRefusedError):  # bound, not yet listening: refused, not left waiting
            socket.create_connection(("127.0.0.1", port), timeout=5)
        sockets[0].listen()
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with pytest.raises(PortUnavailable, match=f"cannot listen on 127.0.0.1:{port}: address already in use"):
            bind_sockets("127.0.0.1", port)
    finally:
        for s in sockets:
            s.close()


def test_every_address_gets_a_socket_and_an_unknown_name_is_named():
    sockets = bind_sockets("", 0)
    try:
        assert {s.family for s in sockets} >= {socket.AF_INET}
        assert all(s.getsockname()[1] > 0 for s in sockets)
    finally:
        for s in sockets:
            s.close()
    with pytest.raises(PortUnavailable, match="cannot listen on no-such-host.invalid:0: "):
        bind_sockets("no-such-host.invalid", 0)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])  # asyncio raises; uvloop closes the socket, says nothing
def test_a_port_another_server_listened_on_first_stops_the_server_with_status_3(loop):
    """Two servers may bind one port while neither listens (SO_REUSEADDR): the one that listens
    second stops as uvicorn does when its own bind fails (status 3), not with a traceback."""
    first = bind_sockets("127.0.0.1", 0)[0]
    port = first.getsockname()[1]
    second = bind_sockets("127.0.0.1", port)  # allowed: nobody listens yet
    first.listen()

    async def app(scope, receive, send):  # a bare ASGI app (lifespan unsupported: uvicorn goes on)
        raise RuntimeError("never called")

    server = BoundServer(uvicorn.Config(app, port=port, lifespan="off", log_level="critical", loop=loop))
    try:
        with pytest.raises(SystemExit) as stop:
            server.run(sockets=second)
        assert stop.value.code == 3
    finally:
        first.close()
        for s in second:
            s.close()
