"""`shortlist serve`: uvicorn over `create_app`, plus the admin app on its own port if configured;
several processes under gunicorn's arbiter (service.api.supervisor).

The app is imported inside the functions that run it, not here: with several processes,
prometheus-client's multiprocess directory must be in the environment before anything
imports prometheus-client, which picks its mode once, at import.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile

import uvicorn

from service.api.active_state import ActiveVersionFile
from service.api.http_protocol import protocol_kwargs
from service.api.processes import MULTIPROCESS_ENV
from service.api.settings import Settings, load_settings


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
                          timeout_graceful_shutdown=int(settings.drain_timeout_s) or None, **protocol_kwargs(settings))


async def _serve_two(settings: Settings) -> None:
    from service.api.app import build_state, create_admin_app, create_app, initial_load, shutdown

    state = build_state(settings)
    main = uvicorn.Server(_config(create_app(settings, state=state, admin=False),
                                  settings.host, settings.port, settings))
    admin = uvicorn.Server(_config(create_admin_app(state), settings.admin_host or settings.host,
                                   int(settings.admin_port or 0), settings))
    load = asyncio.create_task(initial_load(state))
    try:
        # A signal reaches only one server's handler: when either stops, stop the other.
        tasks = [asyncio.create_task(main.serve()), asyncio.create_task(admin.serve())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        main.should_exit = admin.should_exit = True
        await asyncio.gather(*tasks)
    finally:
        load.cancel()
        await shutdown(state)


def _run_processes(settings: Settings) -> None:
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
    with tempfile.TemporaryDirectory(prefix="shortlist-metrics-") as metrics_dir:
        os.environ[MULTIPROCESS_ENV] = metrics_dir
        from service.api.supervisor import ServingProcesses

        ServingProcesses(settings).run()


def run(settings: Settings) -> None:
    if settings.processes > 1:
        _run_processes(settings)
        return
    if settings.admin_token is not None and settings.admin_port is not None:
        # The same event loop uvicorn.Server.run would pick (uvloop when installed).
        loop_factory = _config(None, settings.host, settings.port, settings).get_loop_factory()
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(_serve_two(settings))
        return
    from service.api.app import create_app

    uvicorn.Server(_config(create_app(settings), settings.host, settings.port, settings)).run()


def run_cli(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if not settings.bundle_root.is_dir():
        raise FileNotFoundError(f"bundle root {settings.bundle_root} is not a directory")
    run(settings)
    return 0
