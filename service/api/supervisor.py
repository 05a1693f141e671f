"""The supervisor of several serving processes (`SHORTLIST_PROCESSES` > 1): gunicorn's arbiter.

gunicorn forks each serving process from this one, after the service's modules (FastAPI,
pydantic, numpy, onnxruntime, hnswlib) were imported and frozen out of the garbage collector
(`gc.freeze`: a collection would write to every object's header and unshare its page). The
processes share those pages with each other; uvicorn's own supervisor spawns fresh
interpreters, each importing everything again (per process USS with 2 processes: 75 -> 44
MiB on debian-tags, 139 -> 109 MiB on debian-deps). Each process builds its app after the
fork (the registry, its threads and its pid are its own) from the SHORTLIST_* environment,
and runs uvicorn with the same HTTP limits as a single process. The arbiter restarts a
process that dies and drains them all on SIGTERM.
"""

from __future__ import annotations

import gc
import math
from typing import Any

from gunicorn.app.base import BaseApplication
from uvicorn_worker import UvicornWorker

from service.api.app import create_app
from service.api.http_protocol import protocol_kwargs
from service.api.settings import Settings


class ServingWorker(UvicornWorker):
    """One serving process: uvicorn with the service's HTTP protocol and limits, no access log
    (the app writes its own), and SIGTERM's drain bounded by `drain_timeout_s`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = Settings()
        for name, value in protocol_kwargs(settings).items():
            setattr(self.config, name, value)
        self.config.access_log = False
        self.config.timeout_graceful_shutdown = int(settings.drain_timeout_s) or None


class ServingProcesses(BaseApplication):  # type: ignore[misc]
    """`settings.processes` serving processes on one listening socket."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        super().__init__()

    def load_config(self) -> None:
        s = self.settings
        options = {
            "bind": f"[{s.host}]:{s.port}" if ":" in s.host else f"{s.host}:{s.port}",
            "workers": s.processes,
            "worker_class": f"{ServingWorker.__module__}.{ServingWorker.__qualname__}",
            # The arbiter's own wait for a draining process: the drain plus a margin to exit.
            "graceful_timeout": math.ceil(s.drain_timeout_s) + 5,
            # A process whose event loop did not report for this long is killed and replaced;
            # bundle loads run off the loop, so only a stuck loop reaches it.
            "timeout": 60,
            "keepalive": math.ceil(s.keep_alive_timeout_s),  # gunicorn takes whole seconds
            "loglevel": s.log_level,
            "accesslog": None,
            # No control socket (gunicornc): the admin API is the service's control, and the
            # socket's default path in $HOME would be shared by every instance of one user.
            "control_socket_disable": True,
        }
        for name, value in options.items():
            self.cfg.set(name, value)

    def load(self) -> Any:
        # Runs in each serving process after the fork (no preload): the app and its state are per process.
        return create_app()

    def run(self) -> None:
        gc.collect()
        gc.freeze()
        super().run()
