"""What the image's entry relies on, on a real `shortlist serve` (audit s13 G8): the admin token
from a file (a Docker or compose secret), `shortlist healthcheck` on the port SHORTLIST_PORT sets,
and start-up's fallback kept for a well-formed version that cannot be served."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_admin import TOKEN

from shortlist.testing import free_port, serve

AUTH = {"authorization": f"Bearer {TOKEN}"}


def _token_file(tmp_path: Path) -> Path:
    path = tmp_path / "admin-token"
    path.write_text(TOKEN + "\n")  # as `echo` or `openssl rand -hex 32 >` writes it
    return path


def _healthcheck(**env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHORTLIST_")}
    return subprocess.run([sys.executable, "-m", "shortlist.cli", "healthcheck"], capture_output=True, text=True,
                          timeout=60, env={**base, **env})


def test_a_token_file_opens_the_admin_api_to_its_token_without_the_newline(bundle_root, tmp_path):
    env = {"SHORTLIST_ADMIN_TOKEN_FILE": str(_token_file(tmp_path))}
    with serve(bundle_root, env=env, log_dir=tmp_path) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        assert c.get("/admin/bundles", headers=AUTH).status_code == 200
        assert c.get("/admin/bundles", headers={"authorization": f"Bearer {TOKEN}x"}).status_code == 403
        r = c.post("/admin/bundles/activate", json={"version": "v1"}, headers=AUTH)
        assert r.status_code == 200, r.text


def test_several_processes_each_read_the_token_file(bundle_root, tmp_path):
    # The arbiter hands its settings to the processes as variables: the token stays in its
    # file (both set would stop each process), and every process takes it.
    env = {"SHORTLIST_ADMIN_TOKEN_FILE": str(_token_file(tmp_path)), "SHORTLIST_STATE_DIR": str(tmp_path / "state"),
           "SHORTLIST_PROCESSES": "2", "SHORTLIST_ACCESS_LOG": "false"}
    with serve(bundle_root, env=env, log_dir=tmp_path, timeout=120) as s:
        for _ in range(4):  # a new connection each: both processes answer some
            assert httpx.get(f"{s.url}/admin/bundles", headers=AUTH, timeout=60).status_code == 200
        r = httpx.post(f"{s.url}/admin/bundles/activate", json={"version": "v1"}, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
    assert "both set" not in s.log()


def test_healthcheck_follows_the_port_and_is_healthy_only_when_ready(bundle_root, tmp_path):
    with serve(bundle_root, log_dir=tmp_path) as s:
        port = s.url.rsplit(":", 1)[1]
        # The image binds every address; the check asks over loopback.
        r = _healthcheck(SHORTLIST_HOST="0.0.0.0", SHORTLIST_PORT=port)
        assert r.returncode == 0 and r.stdout.startswith(f"ready: http://127.0.0.1:{port}/readyz answered 200"), r
        r = _healthcheck(SHORTLIST_HOST="127.0.0.1", SHORTLIST_PORT=port)
        assert r.returncode == 0, r
    empty = tmp_path / "empty"
    empty.mkdir()
    with serve(empty, ready=False, log_dir=tmp_path) as s:  # alive, nothing to serve: /readyz 503
        r = _healthcheck(SHORTLIST_PORT=s.url.rsplit(":", 1)[1])
        assert r.returncode == 1 and "answered 503: start-up could not serve a bundle: " in r.stdout, r
    r = _healthcheck(SHORTLIST_PORT=str(free_port()))  # nothing listens
    assert r.returncode == 1 and r.stdout.startswith("not ready: ") and "refused" in r.stdout, r
    r = _healthcheck(SHORTLIST_PORT="http")
    assert r.returncode == 1 and "nonnumeric port" in r.stdout and "Traceback" not in r.stderr, r


def test_a_well_formed_version_that_is_not_there_still_falls_back_to_the_newest(bundle_root, tmp_path):
    with serve(bundle_root, env={"SHORTLIST_VERSION": "v9"}, log_dir=tmp_path) as s:
        assert httpx.get(f"{s.url}/readyz").json()["version"] == "v2"
        assert 'shortlist_startup_fallback{wanted="v9"} 1.0' in httpx.get(f"{s.url}/metrics").text


class _ProxySaysOk(http.server.BaseHTTPRequestHandler):
    """A proxy that answers 200 to whatever it is asked, as a corporate proxy's error page might."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.asked.append(self.path)  # type: ignore[attr-defined]
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_healthcheck_never_asks_through_a_proxy(bundle_root, tmp_path):
    # Audit s14 M2: Docker copies the client's proxy settings into every container.
    proxy = http.server.HTTPServer(("127.0.0.1", 0), _ProxySaysOk)
    proxy.asked = []  # type: ignore[attr-defined]
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    via = f"http://127.0.0.1:{proxy.server_address[1]}"
    proxied = {"http_proxy": via, "HTTP_PROXY": via, "all_proxy": via}
    try:
        r = _healthcheck(SHORTLIST_PORT=str(free_port()), **proxied)  # nothing listens: unhealthy
        assert r.returncode == 1 and "refused" in r.stdout, r
        with serve(bundle_root, log_dir=tmp_path) as s:  # a proxy that cannot reach it does not matter
            r = _healthcheck(SHORTLIST_PORT=s.url.rsplit(":", 1)[1], **proxied)
            assert r.returncode == 0 and "answered 200" in r.stdout, r
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert proxy.asked == []  # type: ignore[attr-defined]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_serve_and_healthcheck_agree_on_the_bracketed_ipv6_wildcard(bundle_root, tmp_path):
    # Audit s14 L7: SHORTLIST_HOST=[::] passed the healthcheck's reading and stopped serve (exit 3).
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SHORTLIST_")},
           "SHORTLIST_HOST": "[::]", "SHORTLIST_PORT": str(free_port())}
    with (tmp_path / "serve.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "shortlist.cli", "serve", "--bundle-root", str(bundle_root)],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while (r := _healthcheck(**env)).returncode != 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert r.returncode == 0 and f"[::1]:{env['SHORTLIST_PORT']}/readyz answered 200" in r.stdout, (
            r, (tmp_path / "serve.log").read_text())
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_healthcheck_says_it_cannot_find_a_port_picked_at_start_up():
    r = _healthcheck(SHORTLIST_PORT="0")
    assert r.returncode == 1 and r.stdout.startswith("not ready: SHORTLIST_PORT=0 serves on a port picked"), r


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "soon"])
def test_healthcheck_refuses_a_timeout_that_is_no_wait_as_a_usage_error(timeout):
    # -1 and nan reached urllib and were reported as the server not ready (exit 1): a bad flag
    # is the command's usage error (exit 2, naming it), not an unhealthy container.
    r = subprocess.run([sys.executable, "-m", "shortlist.cli", "healthcheck", "--timeout", timeout],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--timeout" in r.stderr and "above 0" in r.stderr, r.stderr + r.stdout
