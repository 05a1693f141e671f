"""Whether an opened bundle's files are still the ones it opened.

A bundle is immutable once written (export and label changes write new versions), but its
directory is an ordinary one: an operator's `cp`, `rsync --inplace` or editor may write into a
served version. A file written in place (same inode) changes under the service's memory maps:
a map past the new end of a truncated file kills the process by SIGBUS on its next read, which
Python cannot catch, and rows rewritten at the same size decode to other bytes. A file removed
or replaced by another (a new inode: `rm`, or written to a temporary name and renamed) leaves
what the service opened intact: the maps keep the old inode alive.

`FileStamps` records each file's (device, inode, size, mtime) when the bundle opens and tells
the two apart later; `BundleChanged` is an in-place change, naming the file.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class BundleChanged(Exception):
    """A file of an opened bundle was modified in place since it was opened: what the process
    has mapped of it is no longer what was checked."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"{path}: {what}")
        self.path, self.what = path, what


@dataclass(frozen=True)
class Stamp:
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> Stamp:
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class FileStamps:
    """The stamps of a bundle directory's files, taken when it was opened."""

    def __init__(self, directory: Path, names: list[str]) -> None:
        self.directory = directory
        self._stamps: dict[str, Stamp] = {}
        for name in names:
            try:
                self._stamps[name] = Stamp.of(directory / name)
            except OSError:
                continue  # the bundle's own checks name a file that is not there

    def check(self) -> list[str]:
        """BundleChanged for the first file written in place since the stamps were taken (same
        inode, another size or mtime); otherwise what was removed or replaced (the maps of the
        files opened keep serving), one sentence a file."""
        gone = []
        for name, was in self._stamps.items():
            path = self.directory / name
            try:
                now = Stamp.of(path)
            except FileNotFoundError:
                gone.append(f"{path}: removed since it was loaded")
                continue
            except OSError as exc:
                gone.append(f"{path}: cannot be read ({exc.strerror})")
                continue
            if (now.device, now.inode) != (was.device, was.inode):
                gone.append(f"{path}: replaced by another file since it was loaded")
            elif now != was:
                raise BundleChanged(path, _how(was, now))
        return gone


def _how(was: Stamp, now: Stamp) -> str:
    if now.size != was.size:
        return f"modified in place since it was loaded ({was.size} -> {now.size} bytes)"
    return "modified in place since it was loaded (same size, another modification time)"


def check_not_truncated(mm: mmap.mmap, path: Path) -> None:
    """BundleChanged if the file under `mm` is now shorter than what was mapped: a read past a
    truncated file's end is a SIGBUS. One fstat (mmap.size), ~1 us."""
    size = mm.size()
    if size < len(mm):
        raise BundleChanged(path, f"truncated in place since it was loaded ({len(mm)} -> {size} bytes)")


class GuardedBundle(Protocol):
    """What check_files needs of a bundle (service.engine.bundle.Bundle, which imports this module)."""

    stamps: FileStamps

    def check_maps(self) -> None: ...


def check_files(bundle: GuardedBundle) -> list[str]:
    """BundleChanged naming a file of `bundle` truncated or written in place since it opened
    (its maps' sizes, then every file's stamp: ~20 stats); else what was removed or replaced
    (the opened files serve on), a sentence each."""
    bundle.check_maps()
    return bundle.stamps.check()
