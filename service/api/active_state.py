"""The operator's choice of bundle, remembered across restarts in a writable state directory.

The bundle root may be read-only (a container mounts it so); SHORTLIST_STATE_DIR holds
`active.json`, replaced atomically (a temporary file, fsync, rename, fsync of the directory)
on every activation and rollback, so a crash leaves the old choice or the new one, never a
torn file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from service.engine.schema import BundleError, validate_version_name
from service.engine.store import utc_now

ACTIVE_FILE = "active.json"


class ActiveVersionFile:
    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / ACTIVE_FILE

    def prepare(self) -> None:
        """Create the directory and prove it writable now, not at the first activation."""
        self.dir.mkdir(parents=True, exist_ok=True)
        probe = self.dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()

    def read(self) -> str | None:
        """The remembered version; None when nothing was recorded or the record is unreadable."""
        try:
            version = json.loads(self.path.read_text(encoding="utf-8"))["version"]
            validate_version_name(version)
            return version
        except (OSError, ValueError, KeyError, TypeError, BundleError):
            return None

    def write(self, version: str) -> None:
        tmp = self.dir / f".{ACTIVE_FILE}.{os.getpid()}.tmp"
        data = json.dumps({"version": version, "activated_at": utc_now()}).encode()
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
