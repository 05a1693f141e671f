"""shortlist.testing.serve, what every server test (and a user's integration tests) starts a real
server with: a free port taken by another process before the server binds it is replaced, a port
the caller chose is not."""

from __future__ import annotations

import socket
import urllib.request

import pytest

import shortlist.testing as testing


def test_a_free_port_taken_before_the_server_binds_it_is_replaced(bundle_root_copy, tmp_path, monkeypatch):
    taker = socket.create_server(("127.0.0.1", 0))  # what another process listening there would do
    taken = taker.getsockname()[1]
    given: list[int] = []
    real_free_port = testing.free_port

    def free_port_taken_first() -> int:
        given.append(taken if not given else real_free_port())
        return given[-1]

    monkeypatch.setattr(testing, "free_port", free_port_taken_first)
    with taker, testing.serve(bundle_root_copy, log_dir=tmp_path) as server:
        assert given[0] == taken and len(given) >= 2
        assert server.url.endswith(f":{given[-1]}")
        with urllib.request.urlopen(f"{server.url}/readyz", timeout=10) as r:
            assert r.status == 200
        assert "address already in use" in (tmp_path / f"server-{taken}.log").read_text()


def test_a_port_the_caller_chose_is_not_replaced(bundle_root_copy, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taker:
        port = taker.getsockname()[1]
        with pytest.raises(testing.PortTaken, match="address already in use"):
            with testing.serve(bundle_root_copy, log_dir=tmp_path, port=port):
                pass
