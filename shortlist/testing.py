"""A real `shortlist serve` (uvicorn) in a subprocess on a free loopback port: what the tests and
the benchmarks talk to, and what a user's own integration tests can start the same way."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now and, if the kernel offers one within 100 tries, not handed out
    before by this process: it may give a port closed a moment ago again, and a server's main and
    admin ports come from two calls."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            break
    _HANDED_OUT.add(port)
    return port


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path
    admin_url: str | None = None

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if _status(f"{self.url}/readyz") == 200:
                return
            time.sleep(0.05)
        raise TimeoutError(f"server not ready after {timeout}s; log:\n{self.log()[-4000:]}")


_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy


def _status(url: str) -> int | None:
    """The HTTP status of GET url, None when nothing answers."""
    try:
        with _LOOPBACK.open(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


# What uvicorn logs when its port was taken between free_port() and its bind.
_PORT_TAKEN = "address already in use"
# Tries of fresh ports when a port free_port() gave is taken before the server binds it.
PORT_TRIES = 3


class PortTaken(RuntimeError):
    """The server could not bind its port (taken since free_port() found it free)."""


@contextmanager
def serve(
    bundle_root: Path,
    *,
    version: str | None = None,
    env: Mapping[str, str] | None = None,
    log_dir: Path | None = None,
    admin_port: bool = False,
    ready: bool = True,
    timeout: float = 60.0,
    wrap: Sequence[str] = (),
    port: int | None = None,
) -> Iterator[Server]:
    """Start `shortlist serve` and wait for /healthz (and /readyz unless ready=False). `wrap`: a
    command that execs the server's command given after it (e.g. `unshare -m` with a mount
    first), so the server's pid is the process started. `port`: a free one unless given; a free
    one another process takes before the server binds it is replaced (PORT_TRIES in all)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SHORTLIST_")}
    full_env.update(env or {})
    log_dir = log_dir or bundle_root.parent
    deadline = time.monotonic() + timeout
    for attempt in range(1 if port else PORT_TRIES):
        try:
            server = _start(bundle_root, version, full_env, log_dir, admin_port, wrap, port or free_port(), timeout)
            break
        except PortTaken:
            if port or attempt == PORT_TRIES - 1:
                raise
    try:
        if ready:
            server.wait_ready(max(1.0, deadline - time.monotonic()))
        yield server
    finally:
        _stop(server.proc)


def _start(bundle_root: Path, version: str | None, env: dict[str, str], log_dir: Path, admin_port: bool,
           wrap: Sequence[str], port: int, timeout: float) -> Server:
    """A started server answering /healthz on `port` (PortTaken when it could not bind it)."""
    env = dict(env)
    admin_url = None
    if admin_port:
        aport = free_port()
        env["SHORTLIST_ADMIN_PORT"] = str(aport)
        admin_url = f"http://127.0.0.1:{aport}"
    cmd = [*wrap, sys.executable, "-m", "shortlist.cli", "serve", "--bundle-root", str(bundle_root),
           "--host", "127.0.0.1", "--port", str(port)]
    if version is not None:
        cmd += ["--version", version]
    log_path = log_dir / f"server-{port}.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path, admin_url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                failure = PortTaken if _PORT_TAKEN in server.log() else RuntimeError
                raise failure(f"server exited with {proc.returncode}; log:\n{server.log()[-4000:]}")
            if _status(f"{server.url}/healthz") == 200:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no /healthz after {timeout}s; log:\n{server.log()[-4000:]}")
            time.sleep(0.05)
    except BaseException:
        _stop(proc)
        raise
    return server


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
