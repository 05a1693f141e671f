"""Read-only memory maps of a bundle's arrays: .npy files, and the stored (uncompressed) members
of an .npz, whose pages a full scan made resident can be handed back.

A bundle's label vectors are checked in full when it opens (every value finite), which reads
every page of a map into the process: at 10^6 labels that left the whole of classifiers.npy and
centroids.npy resident (PSS) although serving touches a few rows a query. `release()` drops the
pages from this process (madvise MADV_DONTNEED; they stay in the page cache, shared, and the next
access maps them again). np.load cannot map an .npz member, so tree.npz's [L, D] classifier
weights were read into private memory; here a stored member is mapped where its bytes lie.
"""

from __future__ import annotations

import mmap
import struct
import zipfile
from pathlib import Path

import numpy as np

from service.engine.file_guard import check_not_truncated

# Members of an .npz of a page or more are mapped; smaller ones are read.
MAP_AT_LEAST = 1 << 12
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length


class MappedArrays:
    """Opens arrays as read-only maps and keeps the maps, so their pages can be released."""

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []
        # One map of each file (all map it whole): its size is checked (check_sizes).
        self._by_file: dict[Path, mmap.mmap] = {}

    def npy(self, path: Path) -> np.ndarray:
        """The .npy file at `path`, mapped; ValueError if it holds anything but the array its
        header declares (bytes past it, fewer bytes, an object or Fortran-order array)."""
        size = path.stat().st_size
        with path.open("rb") as f:
            shape, dtype, offset = _read_header(f)
        return self._map(path, shape, dtype, offset, size)

    def npz(self, path: Path) -> dict[str, np.ndarray]:
        """Every member of the .npz at `path` by its name without ".npy": stored members of at
        least MAP_AT_LEAST bytes mapped, the rest read."""
        out: dict[str, np.ndarray] = {}
        with zipfile.ZipFile(path) as z, path.open("rb") as f:
            for info in z.infolist():
                name = info.filename.removesuffix(".npy")
                if info.compress_type != zipfile.ZIP_STORED or info.file_size < MAP_AT_LEAST:
                    with z.open(info) as member:
                        out[name] = np.lib.format.read_array(member, allow_pickle=False)
                    continue
                f.seek(info.header_offset)
                signature, name_len, extra_len = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
                if signature != b"PK\x03\x04":
                    raise ValueError(f"member {info.filename}: no local file header at its offset")
                start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
                f.seek(start)
                shape, dtype, offset = _read_header(f)
                out[name] = self._map(path, shape, dtype, offset, start + info.file_size)
        return out

    def _map(self, path: Path, shape: tuple[int, ...], dtype: np.dtype, offset: int, end: int) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        if offset + count * dtype.itemsize != end:
            raise ValueError(f"{end - offset} bytes of data, the header declares {count * dtype.itemsize}")
        if count == 0:
            return np.zeros(shape, dtype=dtype)
        with path.open("rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if offset + count * dtype.itemsize > len(mm):
            raise ValueError("file shorter than its header declares")
        self._maps.append(mm)
        self._by_file.setdefault(path, mm)
        return np.frombuffer(mm, dtype=dtype, count=count, offset=offset).reshape(shape)

    def release_rows(self, values: np.ndarray, start: int, stop: int) -> None:
        """Drop this process's pages of rows start..stop-1 of `values` (the pages wholly inside
        them), an array over one of these maps; a no-op for any other array."""
        if not hasattr(mmap, "MADV_DONTNEED") or not values.flags.c_contiguous:
            return
        address = values.__array_interface__["data"][0]
        row = values.strides[0] if values.ndim else values.nbytes
        for mm in self._maps:
            base = np.frombuffer(mm, dtype=np.uint8, count=1).__array_interface__["data"][0]
            if base <= address and address + values.nbytes <= base + len(mm):
                first = -(-(address - base + start * row) // mmap.PAGESIZE) * mmap.PAGESIZE
                end = (address - base + stop * row) // mmap.PAGESIZE * mmap.PAGESIZE
                if end > first:
                    mm.madvise(mmap.MADV_DONTNEED, first, end - first)
                return

    def release(self) -> None:
        """Drop every mapped page from this process (the page cache keeps them)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        for mm in self._maps:
            mm.madvise(mmap.MADV_DONTNEED)

    def also_check(self, path: Path, mm: mmap.mmap | None) -> None:
        """Check the size of `mm`, a map made elsewhere (the label table's), with these."""
        if mm is not None:
            self._by_file.setdefault(path, mm)

    def also_check_file(self, path: Path) -> None:
        """Check the size of `path`, a file another reader maps (onnxruntime's external data), with
        these: mapped here only to be checked (nothing is read); a no-op for a missing or empty file."""
        try:
            with path.open("rb") as f:
                self._by_file.setdefault(path, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        except (FileNotFoundError, ValueError):
            return

    def check_sizes(self) -> None:
        """BundleChanged naming the first file truncated since it was mapped (file_guard)."""
        for path, mm in list(self._by_file.items()):
            check_not_truncated(mm, path)

    def clear(self) -> None:
        """Forget the maps (each closes when the last array over it is gone)."""
        self._maps.clear()
        self._by_file.clear()


def _read_header(f) -> tuple[tuple[int, ...], np.dtype, int]:
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise ValueError(f"npy format version {version}")
    if dtype.hasobject:
        raise ValueError("an object array")
    if fortran and len(shape) > 1:
        raise ValueError("a Fortran-order array")
    return tuple(shape), dtype, f.tell()
