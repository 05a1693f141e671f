"""The operator's choice of bundle, remembered across restarts in a writable state directory.

The bundle root may be read-only (a container mounts it so); SHORTLIST_STATE_DIR holds
`active.json`, replaced atomically (a temporary file, fsync, rename, fsync of the directory)
on every activation and rollback, so a crash leaves the old choice or the new one, never a
torn file. With it, the versions served before (what a rollback returns to), and a lock that
makes activations exclusive among the processes sharing the directory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson

from service.api.events import log_event
from service.engine.jsonlines import os_reason
from service.engine.label_ledger import LEDGER_DIR, QUARANTINE_DIR
from service.engine.schema import BundleError, validate_version_name
from service.engine.small_files import read_small_file, write_atomically
from service.engine.store import DERIVED_DIR, utc_now

log = logging.getLogger("shortlist.state")

ACTIVE_FILE = "active.json"
LOCK_FILE = ".activation.lock"
# Held by the one activation or rollback in progress among the processes sharing the directory,
# from before it waits for LOCK_FILE until it is done: a second one is refused, and label
# changes that find it held let that one take LOCK_FILE first.
OPERATOR_LOCK_FILE = ".activation.operator.lock"
# The most bytes of LOCK_FILE's note on its holder read back.
MAX_HOLDER_NOTE_BYTES = 1024
HISTORY_LENGTH = 16
# What label changes keep in the state directory beside ACTIVE_FILE: found without it, the state
# is partly there.
STATE_RECORDS = (DERIVED_DIR, LEDGER_DIR, QUARANTINE_DIR)
# The most bytes of active.json read. `write` makes at most ~1.2 KB (17 names of <= 64 characters
# and a timestamp); anything larger is not this service's record and is not read (service.engine.
# small_files: nor is a FIFO, a device or a symlink there).
MAX_ACTIVE_FILE_BYTES = 64 * 1024
# What `write` records as `state_format`; a record without one is format 1. A release that changes
# what the state directory means raises it, so that this release, finding a higher one, refuses
# to start rather than serve from a state it cannot read whole and replace its record (a downgrade).
STATE_FORMAT = 1


class StateBusy(Exception):
    """Another process holds the activation lock."""


NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


class StateUnavailable(OSError):
    """The state directory cannot be written (a full disk, a read-only mount, a directory where
    a file of it is expected): the server's storage, not the bundle's nor the client's fault
    (HTTP 507 when out of space, else 503). What serves keeps serving, nothing half-written is
    left, and the next write works once the fault is gone. An OSError, so that the CLI and every
    best-effort `except OSError` report it as they report any storage error."""

    def __init__(self, state_dir: Path, cause: OSError, doing: str) -> None:
        where = cause.filename2 if cause.filename2 is not None else cause.filename
        # The probe, lock or temporary file is an implementation detail; the directory is what to fix.
        path = None if where is None else Path(os.fsdecode(where))
        what = "" if path is None or state_dir in (path, path.parent) else f"{path}: "
        super().__init__(f"the state directory {state_dir} (SHORTLIST_STATE_DIR) cannot be written: cannot {doing}: "
                         f"{what}{os_reason(cause)}")
        self.errno = cause.errno

    @property
    def no_space(self) -> bool:
        return self.errno in NO_SPACE


class NewerStateFormat(ValueError):
    """active.json was written by a later release (its `state_format` past STATE_FORMAT): start-up
    stops (exit 2) instead of replacing that release's record."""

    def __init__(self, path: Path, found: int) -> None:
        super().__init__(
            f"{path} was written by a later release of Shortlist (state format {found}; this release reads "
            f"{STATE_FORMAT}): serving from it would replace its record. Run that release, or give this one a "
            "state directory of its own (SHORTLIST_STATE_DIR)")


class StateDirMissing(OSError):
    """SHORTLIST_STATE_DIR names a directory that does not exist, nor does its parent: most
    likely a volume that is not mounted or a wrong path, where an empty state would serve another
    version than the recorded one and lose the rollback history (exit 2, naming both)."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(errno.ENOENT, (
            f"the state directory {state_dir} (SHORTLIST_STATE_DIR) does not exist, nor does {state_dir.parent}: "
            "is a volume not mounted, or the path wrong? A state directory is created only where its parent "
            "exists; create it to start with nothing recorded"))


class ActiveVersionFile:
    def __init__(self, state_dir: str | Path, max_bytes: int = MAX_ACTIVE_FILE_BYTES) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / ACTIVE_FILE
        self.max_bytes = max_bytes
        self._last_problem: str | None = None  # logged once, not at every process-sync tick

    def prepare(self) -> None:
        """Prove the directory writable now, not at the first activation (StateUnavailable naming
        it), and say what start-up finds there (_say_what_is_recorded). A directory that does not
        exist is created only where its parent does (StateDirMissing otherwise): a path under a
        volume that is not mounted, or a wrong one, must not start an empty state unnoticed."""
        created = self._create()
        try:
            probe = self.dir / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise StateUnavailable(self.dir, exc, "create a file there") from None
        self._refuse_a_later_format()
        self._say_what_is_recorded(created)

    def _refuse_a_later_format(self) -> None:
        """NewerStateFormat when the record says a later release wrote it; a record that cannot
        be read is left to read(), which says why (and start-up replaces it, as before)."""
        try:
            record = orjson.loads(read_small_file(self.path, self.max_bytes))
        except (OSError, ValueError):
            return
        found = record.get("state_format", 1) if isinstance(record, dict) else 1
        if isinstance(found, int) and not isinstance(found, bool) and found > STATE_FORMAT:
            raise NewerStateFormat(self.path, found)

    def _create(self) -> bool:
        """Whether the directory had to be made (StateDirMissing when its parent is missing too)."""
        if self.dir.is_dir():
            return False
        if not os.path.lexists(self.dir.absolute().parent):
            raise StateDirMissing(self.dir)
        try:
            self.dir.mkdir()
        except FileExistsError as exc:
            if self.dir.is_dir():  # made meanwhile by another process starting on it
                return False
            raise StateUnavailable(self.dir, exc, "create a file there") from None
        except OSError as exc:
            raise StateUnavailable(self.dir, exc, "create a file there") from None
        return True

    def _say_what_is_recorded(self, created: bool) -> None:
        """One structured line when nothing is recorded: loud (`state_dir_created`, or
        `state_incomplete` when what label changes keep is there but active.json is not: a file
        lost, a partial restore) since the service then serves SHORTLIST_VERSION or the newest
        bundle, not the operator's last choice, and its rollback history starts empty; a quiet
        one (`state_dir_empty`) for an empty directory, a first start."""
        if os.path.lexists(self.path):
            return  # recorded (or unreadable: read() says why)
        consequence = ("no version is recorded: SHORTLIST_VERSION, or else the newest bundle, is served and the "
                       "rollback history starts empty")
        found = [name for name in STATE_RECORDS if os.path.lexists(self.dir / name)]
        if created:
            log_event("state_dir_created", logging.ERROR, state_dir=str(self.dir), message=(
                f"the state directory {self.dir} (SHORTLIST_STATE_DIR) did not exist and was created empty; "
                f"{consequence}. If the state is elsewhere (a volume not mounted, a wrong path), stop the service "
                "and correct SHORTLIST_STATE_DIR"))
        elif found:
            log_event("state_incomplete", logging.ERROR, state_dir=str(self.dir), found=found, message=(
                f"{self.path} is missing while {', '.join(found)} of label changes are there; {consequence}. "
                "Restore it, or activate the version to serve"))
        else:
            log_event("state_dir_empty", state_dir=str(self.dir),
                      message=f"the state directory {self.dir} holds no record; {consequence}")

    def read(self) -> str | None:
        """The remembered version; None when nothing was recorded or the record is unreadable."""
        return self._record()[0]

    def history(self) -> list[str]:
        """The versions served before the remembered one, most recent last."""
        return self._record()[1]

    @property
    def problem(self) -> str | None:
        """Why the record could not be used, as the last read that failed logged it (None before any)."""
        return self._last_problem

    def readable_history(self) -> list[str] | None:
        """history(), or None when a record is there that cannot be read (a FIFO, a symlink, a
        directory, garbage; logged): a writer then keeps the history it holds instead of taking it
        as empty, and its next write does not drop the rollback history (audit s14 L3)."""
        loaded = self._load()
        return None if loaded is None else loaded[1]

    def _record(self) -> tuple[str | None, list[str]]:
        """(version, history) as recorded; (None, []) when nothing is, or when the record cannot be
        used: start-up then serves the configured or newest bundle, and the next activation
        replaces the file."""
        return self._load() or (None, [])

    def _load(self) -> tuple[str | None, list[str]] | None:
        """(version, history) as recorded, (None, []) when nothing is; None when a record is there
        that cannot be used (logged, naming the file and why)."""
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
            return None

    @contextmanager
    def exclusive(self, holder: str = "") -> Iterator[None]:
        """Hold the activation lock of the directory; StateBusy at once if another process does.
        (flock: released by the kernel when its holder dies, so a crash leaves no stale lock.)
        `holder` says what holds it, for holder(); every holder writes its note (a process killed
        holding the lock leaves its own, which the next holder must not show as its own).
        StateUnavailable when the lock file cannot be opened."""
        with self._flock(LOCK_FILE, "activating a bundle or changing labels") as fd:
            _note_holder(fd, f"process {os.getpid()}: {holder or 'activating a bundle'}, since {utc_now()}")
            try:
                yield
            finally:
                _note_holder(fd, "")  # while no one holds the lock, its note names no one

    @contextmanager
    def operator_turn(self) -> Iterator[None]:
        """The one activation or rollback in progress among the processes (OPERATOR_LOCK_FILE);
        StateBusy at once if another process has it."""
        with self._flock(OPERATOR_LOCK_FILE, "activating or rolling back a bundle"):
            yield

    def operator_waiting(self) -> bool:
        """Whether an activation or rollback (of any process, this one included) holds its turn.
        A lock file that cannot be opened says no: the activation lock's own open reports it."""
        try:
            fd = os.open(self.dir / OPERATOR_LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # releases the probe's shared lock with it

    def holder(self) -> str | None:
        """What the process holding the activation lock noted it holds it for (None if unknown)."""
        try:
            note = read_small_file(self.dir / LOCK_FILE, MAX_HOLDER_NOTE_BYTES).decode("utf-8", "replace")
        except (OSError, ValueError):
            return None
        return note.strip() or None

    @contextmanager
    def _flock(self, name: str, doing: str) -> Iterator[int]:
        try:
            fd = os.open(self.dir / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StateUnavailable(self.dir, exc, "open the activation lock") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StateBusy(f"another process is {doing} ({self.dir / name})") from None
            yield fd
        finally:
            os.close(fd)

    def records(self, version: str, history: list[str]) -> bool:
        """Whether the record names `version` with `history` already (as write() would keep it)."""
        return self._load() == (version, history[-HISTORY_LENGTH:])

    def write(self, version: str, history: list[str] | None = None) -> None:
        """Record `version` (and the history before it); StateUnavailable, the old record left as
        it was and no temporary file behind, when the directory cannot take it."""
        data = json.dumps({"version": version, "activated_at": utc_now(),
                           "history": (history or [])[-HISTORY_LENGTH:], "state_format": STATE_FORMAT}).encode()
        try:
            write_atomically(self.path, data)
        except OSError as exc:
            raise StateUnavailable(self.dir, exc, f"record the active version in {ACTIVE_FILE}") from None


def _note_holder(fd: int, note: str) -> None:
    """`note` as the activation lock file's content. Best effort: a state directory that cannot
    take these few bytes fails the section's own writes, with a message naming why."""
    data = note.encode("utf-8", "replace")[:MAX_HOLDER_NOTE_BYTES]
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError:
        pass
