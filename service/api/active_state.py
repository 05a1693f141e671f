"""The operator's choice of bundle, remembered across restarts in a writable state directory.

The bundle root may be read-only (a container mounts it so); SHORTLIST_STATE_DIR holds
`active.json`, replaced atomically (a temporary file, fsync, rename, fsync of the directory)
on every activation and rollback, so a crash leaves the old choice or the new one, never a
torn file. With it, the versions served before (what a rollback returns to), and a lock that
makes activations exclusive among the processes sharing the directory.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson

from service.engine.schema import BundleError, validate_version_name
from service.engine.small_files import read_small_file, write_atomically
from service.engine.store import utc_now

log = logging.getLogger("shortlist.state")

ACTIVE_FILE = "active.json"
LOCK_FILE = ".activation.lock"
HISTORY_LENGTH = 16
# The most bytes of active.json read. `write` makes at most ~1.2 KB (17 names of <= 64 characters
# and a timestamp); anything larger is not this service's record and is not read (service.engine.
# small_files: nor is a FIFO, a device or a symlink there).
MAX_ACTIVE_FILE_BYTES = 64 * 1024


class StateBusy(Exception):
    """Another process holds the activation lock."""


class ActiveVersionFile:
    def __init__(self, state_dir: str | Path, max_bytes: int = MAX_ACTIVE_FILE_BYTES) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / ACTIVE_FILE
        self.max_bytes = max_bytes
        self._last_problem: str | None = None  # logged once, not at every process-sync tick

    def prepare(self) -> None:
        """Create the directory and prove it writable now, not at the first activation."""
        self.dir.mkdir(parents=True, exist_ok=True)
        probe = self.dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()

    def read(self) -> str | None:
        """The remembered version; None when nothing was recorded or the record is unreadable."""
        return self._record()[0]

    def history(self) -> list[str]:
        """The versions served before the remembered one, most recent last."""
        return self._record()[1]

    def _record(self) -> tuple[str | None, list[str]]:
        """(version, history) as recorded; (None, []) when nothing is, or when the record cannot be
        used (logged, naming the file and why): start-up then serves the configured or newest
        bundle, and the next activation replaces the file."""
        try:
            record = orjson.loads(read_small_file(self.path, self.max_bytes))
            version = record["version"]
            validate_version_name(version)
            history = [v for v in record.get("history", []) if isinstance(v, str)]
            for v in history:
                validate_version_name(v)
            return version, history
        except FileNotFoundError:
            return None, []
        except (OSError, ValueError, KeyError, TypeError, AttributeError, BundleError) as exc:
            # RefusedFile is a ValueError: a FIFO, a device, a symlink or a file past max_bytes.
            if str(exc) != self._last_problem:
                log.error("ignoring the recorded active version: %s: %s", self.path, exc)
                self._last_problem = str(exc)
            return None, []

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the activation lock of the directory; StateBusy at once if another process does.
        (flock: released by the kernel when its holder dies, so a crash leaves no stale lock.)"""
        fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StateBusy(f"another process is activating a bundle ({self.dir / LOCK_FILE})") from None
            yield
        finally:
            os.close(fd)

    def write(self, version: str, history: list[str] | None = None) -> None:
        write_atomically(self.path, json.dumps({"version": version, "activated_at": utc_now(),
                                                "history": (history or [])[-HISTORY_LENGTH:]}).encode())
