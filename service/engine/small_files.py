"""Small files the service reads whole, by name: a bundle's manifest.json, the state directory's
active.json. What is at such a path is whatever someone put there, so it is opened such that it
cannot hang or exhaust the reader:

- a FIFO would block open() and read() until a writer comes, possibly never: opened with
  O_NONBLOCK (a FIFO's open then returns at once) and refused as not a regular file;
- a character device (/dev/zero) or a huge file would be read whole into memory: only a regular
  file is read (fstat of the descriptor read from, so nothing changes between check and read),
  and at most `max_bytes` of it, one byte more telling "too large";
- a symlink at the path itself is not followed (O_NOFOLLOW); a bundle's files may be symlinks
  inside the bundle, which `bundle_file` resolves first (and refuses leading out of it). A file
  an operator names in a setting (the admin token's: Kubernetes mounts secrets as symlinks) is
  read with `follow_symlinks`, the same rules applying to what the link leads to.
"""

from __future__ import annotations

import errno
import os
import stat
from contextlib import suppress
from pathlib import Path

import numpy as np

_READ_CHUNK = 1 << 16


class RefusedFile(ValueError):
    """A file not read: the message names it and why (not a regular file, too large, a symlink)."""


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_small_file(path: Path, max_bytes: int, follow_symlinks: bool = False) -> bytes:
    """The bytes of the regular file at `path` if it holds at most `max_bytes`. Raises
    FileNotFoundError when nothing is there, RefusedFile (naming the path and the reason) for
    anything else that is not such a file, OSError when it cannot be read."""
    nofollow = 0 if follow_symlinks else os.O_NOFOLLOW
    try:
        fd = os.open(path, os.O_RDONLY | nofollow | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RefusedFile(f"{path}: a symlink, not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedFile(f"{path}: {_kind(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise RefusedFile(f"{path}: {st.st_size} bytes, more than the limit of {max_bytes}")
        chunks, size = [], 0
        # Read to the limit + 1, not to st_size: the file may grow between fstat and read.
        while size <= max_bytes and (chunk := os.read(fd, min(_READ_CHUNK, max_bytes + 1 - size))):
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise RefusedFile(f"{path}: more than the limit of {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def bundle_file(bundle_dir: Path, name: str) -> Path:
    """The real path of file `name` of the bundle at `bundle_dir` (the one rule for every bundle file,
    manifest.json included): present, a regular file, and if a symlink, one to a file of the bundle
    directory itself. A bundle's files are its own: a symlink out of it serves whatever that path
    holds later (or any file the service may read), not what was exported. Raises FileNotFoundError
    when absent, RefusedFile otherwise."""
    path = bundle_dir / name
    st = os.stat(path)  # follows links; never blocks, even on a FIFO
    real = path.resolve()
    if real.parent != bundle_dir.resolve():
        raise RefusedFile(f"{path}: a symlink leading outside the bundle directory")
    if not stat.S_ISREG(st.st_mode):
        raise RefusedFile(f"{path}: {_kind(st.st_mode)}, not a regular file")
    return real


def write_atomically(path: Path, data: bytes) -> None:
    """Replace the file at `path` with `data` so that a crash leaves the old file or the new one,
    never a torn one: a temporary file beside it (named by the pid: processes sharing a directory
    never write the same one), fsync, rename over `path`, fsync of the directory (the rename itself
    survives a power cut). Raises OSError, the file left as it was and no temporary file behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with suppress(OSError):  # a directory in its place stays: not ours to remove
            tmp.unlink()
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_array(path: Path, array: np.ndarray) -> None:
    """np.save(path, array), its data written through Python's file object: numpy's own writer
    (fwrite) reports a short write on a nearly full disk as "N requested and M written", an
    OSError with no errno nor file (audit s14 L1). Raises OSError with the errno the kernel gave
    (ENOSPC on a full disk) naming `path`."""
    array = np.ascontiguousarray(array)
    try:
        with open(path, "wb") as f:
            np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(array))
            f.write(array.reshape(-1).view(np.uint8))
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
