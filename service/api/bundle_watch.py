"""The serving version's files, compared with what was loaded while it serves (service.engine.file_guard).

A file written in place (`cp` over it, `rsync --inplace`) changes what the process has mapped:
the engine is marked changed, and from then on every prediction answers 503 `bundle_changed`
naming the file, /readyz answers 503, and one `bundle_changed` event is logged, until an operator
activates a version (another one, or the same once its files are as exported: it is loaded and
checked again). The service never switches versions by itself. A file removed or replaced by
another (a new inode) leaves what was opened intact: it keeps serving, and logs a warning.

Checked every `bundle_check_interval_s` on a thread of its own, before a label change derives
from the version, and when a request finds a mapped file truncated or a label row that no
longer decodes (LabelTable, Bundle.check_maps).
"""

from __future__ import annotations

import logging
import threading

from service.api.errors import ApiError
from service.api.events import log_event
from service.api.leases import Engine
from service.api.observability import ServiceMetrics
from service.api.processes import every
from service.api.registry import BundleRegistry
from service.engine.file_guard import BundleChanged, check_files

log = logging.getLogger("shortlist.bundle_watch")


def changed_error(version: str, exc: BundleChanged) -> ApiError:
    """The 503 of every request to a version whose files changed on disk since it was loaded."""
    return ApiError(503, "bundle_changed", f"bundle {version} changed on disk: {exc}; a served version's "
                    "files must never be written in place: activate a version whose files are as exported "
                    "(POST /admin/bundles/activate)", headers={"Retry-After": "60"})


class BundleWatch:
    """Marks the serving engine changed when its bundle's files are (and logs what was removed)."""

    def __init__(self, registry: BundleRegistry, metrics: ServiceMetrics, interval_s: float) -> None:
        self.registry, self.metrics, self.interval_s = registry, metrics, interval_s
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def check(self, engine: Engine | None = None) -> BundleChanged | None:
        """What changed in place in the files of `engine` (default: the serving one), or None."""
        engine = engine or self.registry.active
        if engine is None or engine.changed is not None:
            return engine.changed if engine is not None else None
        try:
            gone = check_files(engine.bundle)
        except BundleChanged as exc:
            self.mark(engine, exc)
            return exc
        for sentence in gone:
            if sentence not in self._warned:  # once a file, not every interval
                self._warned.add(sentence)
                log.warning("bundle %s serves on from the files it opened: %s", engine.version, sentence)
        return None

    def mark(self, engine: Engine, exc: BundleChanged) -> None:
        """Serve 503 `bundle_changed` from `engine` on (logged and counted once)."""
        with self._lock:
            if engine.changed is not None:
                return
            engine.changed = exc
        self.metrics.bundle_changed.inc()
        log_event("bundle_changed", logging.ERROR, version=engine.version, file=str(exc.path),
                  message=str(exc))

    def start(self) -> None:
        """Check every interval_s on a daemon thread of its own (none with an interval of 0)."""
        if self.interval_s > 0:
            threading.Thread(target=every, args=(self.interval_s, self._stop, self.check, "bundle file check"),
                             name="bundle-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()  # the thread ends at its next wait; a check meanwhile only reads files
