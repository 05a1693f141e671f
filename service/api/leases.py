"""What serves requests for a while, and the leases requests hold on it: a swap never changes the
bundle under a request, and the one swapped out is released once its last request is done
(service.api.registry swaps; the Ray Serve app's ingress leases its sharded engines the same way)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

from service.engine.bundle import Bundle
from service.engine.file_guard import BundleChanged
from service.engine.predictor import Predictor


class NoBundle(Exception):
    """Nothing is serving yet (HTTP 503)."""


class Leased:
    """What serves requests for a while: counts the requests using it, so that once retired
    (another took its place) it is released when the last of them is done."""

    def __init__(self) -> None:
        self._leases = 0
        self._retired = False
        self._closed = False
        self._lock = threading.Lock()
        self._drained = threading.Event()
        # Set once a file it serves from is found written in place (service.api.bundle_watch): it
        # answers 503 from then on, until an activation replaces it.
        self.changed: BundleChanged | None = None

    @property
    def version(self) -> str:
        raise NotImplementedError

    def _acquire(self) -> bool:
        with self._lock:
            if self._retired:
                return False
            self._leases += 1
            return True

    def _release(self) -> None:
        with self._lock:
            self._leases -= 1
            if self._retired and self._leases == 0:
                self._drained.set()

    def _retire(self) -> None:
        with self._lock:
            self._retired = True
            if self._leases == 0:
                self._drained.set()

    def _close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._release_resources()

    def _release_resources(self) -> None:
        """What closing frees (once, after the drain)."""


L = TypeVar("L", bound=Leased)


class Lease(AbstractContextManager[L]):
    """current(), guaranteed not to be closed until the block exits; NoBundle while it is None.

    A class rather than a @contextmanager generator: every request takes one, and a generator
    context manager costs several times the lock operations it wraps."""

    __slots__ = ("_current", "_leased")

    def __init__(self, current: Callable[[], L | None]) -> None:
        self._current = current

    def __enter__(self) -> L:
        while True:
            leased = self._current()
            if leased is None:
                raise NoBundle("no bundle is loaded yet")
            # A swap may retire it between the read and the acquire; then take the new one.
            if leased._acquire():
                self._leased = leased
                return leased

    def __exit__(self, *exc: object) -> None:
        self._leased._release()


lease = Lease  # the name callers use: `with lease(current) as leased:`


class Engine(Leased):
    """One loaded bundle and its predictor, with a count of requests using it."""

    def __init__(self, bundle: Bundle, predictor: Predictor) -> None:
        super().__init__()
        self.bundle = bundle
        self.predictor = predictor

    @property
    def version(self) -> str:
        return self.bundle.version

    def _release_resources(self) -> None:
        self.bundle.close()
