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

Before forking, the arbiter also loads the bundle the processes start with (`process_preload`,
gunicorn's preload idea applied to the bundle rather than the app): checked in a child process
as every load is, opened, with the HNSW indices and token table its scoring searches, but no
onnxruntime session (its threads would not survive a fork; each process makes its own and
answers the canaries). What hnswlib copied into its own memory (a 52 MB graph on debian-deps)
and the Python objects of the tokenizer and label table are then pages every process shares
copy-on-write instead of one copy each. Once another version is recorded as active, the
arbiter drops its copy within a second (no process serves it any more) and processes forked
later load their bundle themselves, as every process does after a swap; so it does, before it
forks again, once a file of its copy was written in place (service.engine.file_guard). The arbiter listens
once it has preloaded, on the sockets `serve` bound before it (service.api.listeners): until
then no process answers, not even /healthz, and a connection is refused.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import socket
from typing import Any

from gunicorn.app.base import BaseApplication
from gunicorn.arbiter import Arbiter
from uvicorn_worker import UvicornWorker

from service.api.active_state import ActiveVersionFile
from service.api.app import create_app
from service.api.http_protocol import protocol_kwargs
from service.api.listeners import PortUnavailable, address_text, gunicorn_binds
from service.api.settings import Settings, load_settings
from service.engine import heap
from service.engine.bundle import Bundle
from service.engine.file_guard import BundleChanged, check_files
from service.engine.isolated import check_in_child
from service.engine.predictor import Predictor, PredictorOptions
from service.engine.store import BundleStore

log = logging.getLogger("shortlist.supervisor")


class ServingWorker(UvicornWorker):
    """One serving process: uvicorn with the service's HTTP protocol and limits, no access log
    (the app writes its own), and SIGTERM's drain bounded by `drain_timeout_s`. A process whose
    arbiter is gone (killed by SIGKILL or the OOM killer) drains and exits as on SIGTERM: nothing
    would restart it, a new service could not bind its port, and SIGTERM to that service would
    never reach it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = load_settings()
        for name, value in protocol_kwargs(settings).items():
            setattr(self.config, name, value)
        self.config.access_log = False  # (SIGTERM's drain: protocol_kwargs)
        # Report on each of uvicorn's once-a-second ticks (not every half stall timeout): the
        # report also looks for the arbiter, so an orphan notices within about a second.
        self.config.timeout_notify = 0.0
        self.leaving = False

    def run(self) -> None:
        # uvicorn's event loop takes the listening sockets over: handed gunicorn's wrappers, uvloop
        # closed the descriptor, then the wrapper closed the same number again at every shutdown
        # ("Error while closing socket [Errno 9]"; a number another thread may have reopened).
        self.sockets = [getattr(listener, "sock", listener) for listener in self.sockets]
        super().run()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        # A process joining live ones holds its start-up until it serves (service.api.app,
        # _hold_until_loaded) and reports to the arbiter meanwhile: uvicorn's loop reports only
        # once the start-up is over.
        self.wsgi.state.heartbeat = self.notify

    async def callback_notify(self) -> None:
        self.notify()
        # gunicorn's own workers check this in their loops; uvicorn_worker's does not.
        if os.getppid() != self.ppid and not self.leaving:
            self.leaving = True
            self.log.warning("the arbiter (pid %s) is gone: process %s drains and exits", self.ppid, os.getpid())
            # uvicorn's SIGTERM handler: the same drain, bounded by SHORTLIST_DRAIN_TIMEOUT_S.
            os.kill(os.getpid(), signal.SIGTERM)


class ServingProcesses(BaseApplication):  # type: ignore[misc]
    """`settings.processes` serving processes on one listening socket."""

    def __init__(self, settings: Settings, sockets: list[socket.socket]) -> None:
        self.settings = settings
        self.sockets = sockets  # bound by `serve` (service.api.listeners); the arbiter listens on them
        self.preloaded: Bundle | None = None
        super().__init__()

    def load_config(self) -> None:
        s = self.settings
        options = {
            "bind": gunicorn_binds(self.sockets),
            "workers": s.processes,
            "worker_class": f"{ServingWorker.__module__}.{ServingWorker.__qualname__}",
            # The arbiter's own wait for a draining process: the drain plus a margin to exit.
            "graceful_timeout": math.ceil(s.drain_timeout_s) + 5,
            # A process whose event loop did not report for this long is killed and replaced;
            # bundle loads run off the loop, so only a stuck loop reaches it.
            "timeout": math.ceil(s.process_stall_timeout_s),
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
        # Runs in each serving process after the fork: the app and its state are per process.
        bundle, self.preloaded = self.preloaded, None  # this process's copy: its registry owns it now
        return create_app(preloaded=bundle)

    def run(self) -> None:
        self.preloaded = preload(self.settings) if self.settings.process_preload else None
        gc.collect()
        gc.freeze()
        try:
            PreloadingArbiter(self).run()
        except RuntimeError as exc:  # as BaseApplication.run reports gunicorn's configuration errors
            raise SystemExit(f"Error: {exc}") from exc

    def drop_stale_preload(self) -> None:
        """Release the preloaded bundle once the recorded active version is another one, or once
        one of its files was written in place: a process forked with it would map that file as it
        is now (a truncated one kills it by SIGBUS, over and over); without it, a new process loads
        the version itself, checksums checked, and is refused naming the file."""
        bundle = self.preloaded
        if bundle is None:
            return
        recorded = ActiveVersionFile(self.settings.state_dir).read() if self.settings.state_dir else None
        try:
            check_files(bundle)
        except BundleChanged as exc:
            log.error("arbiter dropped its preloaded bundle %s: %s (a process forked with it would map that file: "
                      "a SIGBUS past its end)", bundle.version, exc)
        else:
            if recorded is None or recorded == bundle.version:
                return
            log.info("arbiter released its preloaded bundle: %s is active", recorded)
        self.preloaded = None
        bundle.close()
        del bundle
        heap.trim()


class PreloadingArbiter(Arbiter):  # type: ignore[misc]
    """gunicorn's arbiter, which also lets go of a preloaded bundle no process serves any more
    (checked each time it looks after its processes: about once a second, and before a fork)."""

    def manage_workers(self) -> None:
        self.app.drop_stale_preload()
        super().manage_workers()

    def start(self) -> None:
        try:
            super().start()  # listens on the sockets `serve` bound (service.api.listeners)
        except OSError as exc:  # another server bound the port beside this one and listened first
            s = self.app.settings
            raise PortUnavailable(f"cannot listen on {address_text((s.host, s.port))}: "
                                  f"{(exc.strerror or str(exc)).lower()}") from None


def preload(settings: Settings) -> Bundle | None:
    """The bundle the serving processes will start with (the recorded version, else the configured
    one, else the newest), checked in a child process and opened with the sources its scoring
    searches, or None (logged) when it cannot be: each process then loads and falls back itself."""
    heap.use_huge_pages(settings.huge_pages)
    store = BundleStore(settings.bundle_root, settings.state_dir, settings.max_manifest_bytes)
    recorded = ActiveVersionFile(settings.state_dir).read() if settings.state_dir else None
    try:
        path = store.resolve(recorded or settings.version or store.newest_version())
        if settings.load_check_in_child:
            check_in_child(path, threads=settings.engine_threads, timeout_s=settings.load_check_timeout_s,
                           max_manifest_bytes=settings.max_manifest_bytes)
        bundle = Bundle.open(path, max_manifest_bytes=settings.max_manifest_bytes)
    except Exception as exc:  # whatever refuses a bundle must not stop the arbiter
        log.warning("the arbiter did not preload a bundle (each process loads its own): %s", exc)
        return None
    try:
        # The indices and token table the processes' scoring searches, opened into this process.
        Predictor(bundle, PredictorOptions(threads=settings.engine_threads, encoder=False))
    except Exception as exc:
        bundle.close()
        log.warning("the arbiter did not preload %s (each process loads its own): %s", path, exc)
        return None
    bundle.release_pages()
    log.info("arbiter preloaded bundle %s for its processes", bundle.version)
    return bundle
