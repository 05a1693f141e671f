"""`shortlist serve`: uvicorn over `create_app`, plus the admin app on its own port if configured;
several processes under gunicorn's arbiter (service.api.supervisor).

The app is imported inside the functions that run it, not here: with several processes,
prometheus-client's multiprocess directory must be in the environment before anything
imports prometheus-client, which picks its mode once, at import.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import fcntl
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from service.api.active_state import ActiveVersionFile
from service.api.http_protocol import protocol_kwargs
from service.api.listeners import BoundServer, PortUnavailable, bind_sockets, close_all
from service.api.processes import MULTIPROCESS_ENV
from service.api.settings import Settings, load_settings

METRICS_DIR_PREFIX = "shortlist-metrics-"
# In each metrics directory: the file its run holds locked (flock) while its arbiter or any of
# the processes it forked (which inherit the lock) lives.
METRICS_DIR_LOCK = ".held"


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Environment (SHORTLIST_*) first, then any flag given on the command line wins; a problem
    names the flag or the variable (load_settings)."""
    flags = {
        name: (f"--{name.replace('_', '-')}", getattr(args, name))
        for name in ("bundle_root", "version", "host", "port", "state_dir", "processes")
        if getattr(args, name, None) is not None
    }
    return load_settings(flags)


def _config(app: object, host: str, port: int, settings: Settings) -> uvicorn.Config:
    # access_log off: the app writes its own JSON access log with request ids and versions.
    return uvicorn.Config(app, host=host, port=port, access_log=False, log_level=settings.log_level,
                          **protocol_kwargs(settings))


async def _serve_two(settings: Settings, main_sockets: list[socket.socket],
                     admin_sockets: list[socket.socket]) -> None:
    from service.api.app import build_state, create_admin_app, create_app, initial_load, shutdown
    from service.api.observability import setup_logging

    setup_logging(settings.log_level)  # before build_state, which may log an event (as create_app does)
    state = build_state(settings)
    main = BoundServer(_config(create_app(settings, state=state, admin=False), settings.host, settings.port, settings))
    admin = BoundServer(_config(create_admin_app(state), _admin_host(settings), int(settings.admin_port or 0),
                                settings))
    load = asyncio.create_task(initial_load(state))
    try:
        # A signal reaches only one server's handler: when either stops, stop the other.
        tasks = [asyncio.create_task(main.serve(sockets=main_sockets)),
                 asyncio.create_task(admin.serve(sockets=admin_sockets))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        main.should_exit = admin.should_exit = True
        await asyncio.gather(*tasks)
    finally:
        load.cancel()
        await shutdown(state)


def _admin_host(settings: Settings) -> str:
    return settings.admin_host or settings.host


def _run_processes(settings: Settings, sockets: list[socket.socket]) -> None:
    """`settings.processes` copies of the app on one listening socket, forked by gunicorn's
    arbiter from this process (service.api.supervisor).

    Each process builds its settings from the environment, so the command line's settings are
    put there first; prometheus-client keeps each process's metric values in files under a
    directory made for this run (service.api.observability).
    """
    if settings.state_dir is not None:
        # Here, not in each process: a state directory that cannot be written stops start-up
        # naming it (exit 2), instead of every process failing to boot under the arbiter.
        ActiveVersionFile(settings.state_dir).prepare()
    os.environ.update(settings.environment())
    with metrics_directory() as metrics_dir:
        os.environ[MULTIPROCESS_ENV] = metrics_dir
        from service.api.supervisor import ServingProcesses

        ServingProcesses(settings, sockets).run()


@contextmanager
def metrics_directory() -> Iterator[str]:
    """A new directory in TMPDIR for the metric files of this run's processes, removed when the
    run stops. Its lock is held until the arbiter and every process it forked have exited, so
    the directory of a run whose arbiter was killed is known once its processes have gone
    too: each start first removes those."""
    sweep_metrics_directories()
    # Made under a name the sweep does not match, and renamed once locked: a concurrent start's
    # sweep never sees it unlocked.
    staging = tempfile.mkdtemp(prefix=f".{METRICS_DIR_PREFIX}")
    held = os.open(os.path.join(staging, METRICS_DIR_LOCK), os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        path = os.path.join(os.path.dirname(staging), os.path.basename(staging)[1:])
        os.rename(staging, path)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(held)
        shutil.rmtree(staging, ignore_errors=True)  # there only if the rename failed


def sweep_metrics_directories() -> None:
    """Remove the metrics directories in TMPDIR whose runs have ended without removing them (an
    arbiter killed by SIGKILL). One without a lock file, or whose lock is held, is left."""
    for path in Path(tempfile.gettempdir()).glob(f"{METRICS_DIR_PREFIX}*"):
        if path.is_symlink() or not path.is_dir():
            continue
        try:
            lock = os.open(path / METRICS_DIR_LOCK, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # not one of ours, or another user's
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # its run still lives
        finally:
            os.close(lock)


def run(settings: Settings) -> None:
    # A serving process killed by a fault (SIGSEGV, SIGBUS from a bundle file truncated under its
    # mapping, SIGFPE, SIGABRT) writes every thread's Python stack to stderr before it dies, so
    # its log says which request path and which engine call it was in; processes forked by
    # gunicorn's arbiter inherit the handler.
    faulthandler.enable(all_threads=True)
    # Bound before anything loads (service.api.listeners says why); raises PortUnavailable.
    sockets = bind_sockets(settings.host, settings.port)
    if settings.processes > 1:
        _run_processes(settings, sockets)
        return
    if settings.admin_token is not None and settings.admin_port is not None:
        try:
            admin_sockets = bind_sockets(_admin_host(settings), settings.admin_port)
        except PortUnavailable:
            close_all(sockets)
            raise
        # The same event loop uvicorn.Server.run would pick (uvloop when installed).
        loop_factory = _config(None, settings.host, settings.port, settings).get_loop_factory()
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(_serve_two(settings, sockets, admin_sockets))
        return
    from service.api.app import create_app

    BoundServer(_config(create_app(settings), settings.host, settings.port, settings)).run(sockets=sockets)


def run_cli(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if not settings.bundle_root.is_dir():
        raise FileNotFoundError(f"bundle root {settings.bundle_root} is not a directory")
    try:
        run(settings)
    except PortUnavailable as exc:
        # 3, as when uvicorn or gunicorn could not start (README, exit statuses).
        print(f"shortlist {getattr(args, 'command', 'serve')}: error: {exc}", file=sys.stderr)
        return 3
    return 0
