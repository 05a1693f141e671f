"""Whether the state directory still takes writes while the service serves (/healthz, /metrics).

Predictions never touch the state directory, so one that goes (a volume unmounted, a directory
moved away), turns read-only or fills up (no free block or inode) is found otherwise only by the
next admin write's 503 or 507 `state_unavailable`. This check gives the operator a signal before
that: /healthz's `reason` and the `shortlist_state_writable` gauge. It is a stat, an access(2) and
a statvfs(2) call, made at most once per CHECK_INTERVAL_S whatever the probe and scrape rate.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

# At most one look at the directory this often: probes and scrapes read the cached answer between.
CHECK_INTERVAL_S = 2.0


class StateDirCheck:
    """The state directory's problem (a sentence naming it and why), or None while it takes writes."""

    def __init__(self, state_dir: str | Path, interval_s: float = CHECK_INTERVAL_S) -> None:
        self.dir = Path(state_dir)
        self.interval_s = interval_s
        self._checked: tuple[float, str | None] | None = None  # (when, problem)
        self._lock = threading.Lock()  # /metrics' collector may run on another thread than the probes

    def problem(self) -> str | None:
        now = time.monotonic()
        with self._lock:
            if self._checked is not None and now - self._checked[0] < self.interval_s:
                return self._checked[1]
            problem = self._look()
            self._checked = (now, problem)
            return problem

    def _look(self) -> str | None:
        why = None
        try:
            st = os.stat(self.dir)
        except OSError as exc:
            why = exc.strerror or str(exc)
        else:
            if not stat.S_ISDIR(st.st_mode):
                why = "not a directory"
            elif not os.access(self.dir, os.W_OK | os.X_OK):  # read-only mount (EROFS) or permissions
                why = "not writable"
            else:
                why = _full(self.dir)
        if why is None:
            return None
        return (f"state directory {self.dir} (SHORTLIST_STATE_DIR): {why}; predictions serve on, admin writes "
                "answer 503 (507 when out of space) state_unavailable until it is back")


def _full(path: Path) -> str | None:
    """Why nothing more can be written on `path`'s filesystem (no block, or no inode, left to an
    unprivileged writer: the container's user), None otherwise or when it cannot be asked. Every
    admin write then answers 507; said here before one finds it (audit s25 F1)."""
    try:
        fs = os.statvfs(path)
    except OSError:
        return None
    if fs.f_bavail == 0:
        return "no space left on device (0 bytes free)"
    if fs.f_files > 0 and fs.f_favail == 0:  # f_files 0: a filesystem without an inode count (btrfs)
        return "no space left on device (no free inode)"
    return None
