"""Files the commands write: an OSError that names no file (a full disk's ENOSPC comes from a
write or a close, which carry no path) raised again naming the file, and a dataset's files
written as one set, under temporary names renamed into place once all of them are whole."""

from __future__ import annotations

import gzip
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from training.data import SPLIT_SUFFIXES


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """OSErrors inside that carry no file name are raised again naming `path` (the CLI then says
    which file the disk was full for, not only that it was)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, os.fspath(path)) from exc


class StagedFiles:
    """Files of one folder written as a set: each under a temporary name beside its own
    (.NAME.writing-PID), renamed to NAME when the block ends without an error, else removed, so a
    failure (a full disk) leaves the folder's files as they were: never a truncated file under its
    final name, nor a set of new and old files."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._temporary: dict[str, Path] = {}

    def write_gz_lines(self, name: str, lines: Iterable[str], compresslevel: int = 9) -> None:
        """NAME (gzip, UTF-8): one line per item of `lines`."""
        self._refuse_other_forms(name)
        temporary = self.folder / f".{name}.writing-{os.getpid()}"
        self._temporary[name] = temporary
        with naming(self.folder / name), gzip.open(temporary, "wt", encoding="utf-8",
                                                   compresslevel=compresslevel) as f:
            for line in lines:
                f.write(line)
                f.write("\n")

    def copy(self, name: str, source: Path) -> None:
        """NAME: a copy of `source`."""
        self._refuse_other_forms(name)
        temporary = self.folder / f".{name}.writing-{os.getpid()}"
        self._temporary[name] = temporary
        with naming(self.folder / name):
            shutil.copyfile(source, temporary)

    def _refuse_other_forms(self, name: str) -> None:
        """A split's file (trn.json.gz) where the folder holds it in another form (trn.json): the
        two would be one split in two files, which every reader refuses (exit 0 here, then
        `train` refused the folder). Not removed: it may be someone's data."""
        split = name.split(".", 1)[0]
        for other in (self.folder / f"{split}{suffix}" for suffix in SPLIT_SUFFIXES):
            if other.name != name and os.path.lexists(other):
                raise ValueError(f"{other}: the {split} split in another form than the {name} written here (a "
                                 "split in two files is refused when read): remove it or write to another folder")

    def __enter__(self) -> StagedFiles:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if exc_type is None:
                for name, temporary in self._temporary.items():
                    os.replace(temporary, self.folder / name)
        finally:
            for temporary in self._temporary.values():
                temporary.unlink(missing_ok=True)
