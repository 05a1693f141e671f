"""The label table: row i is label i in every array, index and response."""

from __future__ import annotations

import array
import json
import mmap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np
import orjson

from service.engine.file_guard import BundleChanged

_ROWS_PER_CHUNK = 1024


class LabelTable:
    """Each label's uid and title. Built from sequences (training, shards), a table holds them
    as Python strings; loaded from a bundle's labels.jsonl, it reads a row from a read-only map
    of the file when asked (`MappedRows`)."""

    def __init__(self, uids: Sequence[str], titles: Sequence[str]) -> None:
        if len(uids) != len(titles):
            raise ValueError(f"{len(uids)} label uids but {len(titles)} titles")
        # Tuples, not lists: the cyclic GC stops tracking a tuple of strings, while it walks a
        # list's every element at each full collection (~3 ms per collection on debian-deps,
        # with the GIL held, about once a second under load).
        self.uids: Sequence[str] = tuple(uids)
        self.titles: Sequence[str] = tuple(titles)
        self._rows: MappedRows | None = None
        self._ids: dict[str, int] | None = None

    def __len__(self) -> int:
        return len(self.uids)

    def row(self, i: int) -> tuple[str, str]:
        """(uid, title) of label i: one read of a mapped row."""
        return self._rows.row(i) if self._rows is not None else (self.uids[i], self.titles[i])

    def named(self, ids: list[int]) -> list[dict[str, str]]:
        """{"uid", "title"} of each label id in `ids` (every id in range), in order: an answer's
        labels named together (a mapped table decodes them in one call). Fresh dicts: a caller
        may keep or change them."""
        if self._rows is not None:
            return self._rows.named(ids)
        uids, titles = self.uids, self.titles
        return [{"uid": uids[i], "title": titles[i]} for i in ids]

    @property
    def file_map(self) -> mmap.mmap | None:
        """The map of labels.jsonl a loaded table reads its rows from (None: built, or an empty file)."""
        rows = self._rows
        return rows._map if rows is not None and isinstance(rows._map, mmap.mmap) else None

    def ids_of(self, uids: Sequence[str]) -> list[int | None]:
        """The row of each uid, None for a uid not in the table (first occurrence if repeated: a
        table loaded from a file never repeats one, MappedRows refuses it).

        A table loaded from a file looks uids up in its rows' hash index (MappedRows.ids_of).
        Built from sequences, the uid -> row dict is built on first use (~5 ms and a few MB per
        40K labels), not at load: only requests that name labels by uid need it.
        """
        if self._rows is not None:
            return self._rows.ids_of(uids)
        index = self._ids
        if index is None:
            index = {}
            for row, uid in enumerate(self.uids):
                index.setdefault(uid, row)
            self._ids = index  # a concurrent first call builds the same dict; either may win
        return [index.get(uid) for uid in uids]

    def save(self, path: str | Path) -> None:
        with Path(path).open("w", encoding="utf-8") as f:
            for uid, title in zip(self.uids, self.titles, strict=True):
                f.write(json.dumps({"uid": uid, "title": title}, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LabelTable:
        """The table of a labels.jsonl file, every row checked, the rows read from a map of it."""
        rows = MappedRows(path)
        table = cls((), ())
        table._rows = rows
        table.uids, table.titles = _Column(rows, 0), _Column(rows, 1)
        return table


class MappedRows:
    """The rows of a JSON-lines label file, decoded one at a time from a read-only map.

    As Python strings, a label's uid and title cost ~170 bytes of private memory in every
    serving process (7.3 MiB on debian-deps, ~170 MB at 10^6 labels); mapped, the file's pages
    are shared by every process that serves the bundle, and a row costs 16 bytes (its offsets)
    and ~0.4 us to decode when an answer names it. Rows are found by uid through the uids'
    hashes, sorted (12 bytes a row, computed while the rows are checked): a dict of uid -> row
    took over 2 s with the GIL held and 187 MiB at 10^6 labels, built by the first request that
    named a label.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            size = f.seek(0, 2)
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        data = np.frombuffer(self._map, dtype=np.uint8)
        ends = np.flatnonzero(data == ord("\n"))
        if size and (not len(ends) or ends[-1] != size - 1):
            ends = np.append(ends, size)  # a last row without a newline
        starts = np.concatenate([[0], ends[:-1] + 1]) if len(ends) else np.zeros(0, dtype=np.int64)
        # array.array, not ndarray: indexing it gives a Python int without a numpy scalar's cost.
        self._starts = array.array("q", starts.astype(np.int64).tobytes())
        self._ends = array.array("q", ends.astype(np.int64).tobytes())
        self._check()
        # Python's str hash: fixed within a process and its forks (the preloading arbiter's).
        self._by_hash = np.argsort(self._hashes, kind="stable").astype(np.int32)
        self._hashes = self._hashes[self._by_hash]
        self._refuse_repeated_uids()
        if isinstance(self._map, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)  # the check read every page: hand them back

    def __len__(self) -> int:
        return len(self._starts)

    def _refuse_repeated_uids(self) -> None:
        """ValueError naming the line of a uid an earlier row has: lookups by uid find the first
        row, so `exclude` and retire would act on one row while the other keeps being served.
        Equal uids have equal hashes: only rows in a run of equal hashes (rare) are decoded."""
        hashes = self._hashes
        same = np.flatnonzero(hashes[1:] == hashes[:-1])
        if not len(same):
            return
        first_row: dict[str, int] = {}
        for row in sorted(int(self._by_hash[p]) for p in np.union1d(same, same + 1)):
            uid = self.row(row)[0]
            if uid in first_row:
                shown = repr(uid) if len(uid) <= 64 else f"{uid[:64]!r}..."
                raise ValueError(f"{self.path}:{row + 1}: uid {shown} is also the uid of line {first_row[uid] + 1} "
                                 "(a label's uid is unique)")
            first_row[uid] = row

    def row(self, i: int) -> tuple[str, str]:
        try:
            obj = orjson.loads(self._map[self._starts[i] : self._ends[i]])
            return str(obj["uid"]), str(obj["title"])
        except (ValueError, KeyError, TypeError):
            raise self._changed(f"line {i + 1}") from None

    def _changed(self, where: str) -> BundleChanged:
        """Every row was checked when the file was mapped: one that no longer decodes was
        written in place since (the map shows the file as it is now)."""
        return BundleChanged(self.path, f"{where} no longer decodes: the file was modified in place since it was "
                             "loaded")

    def ids_of(self, uids: Sequence[str]) -> list[int | None]:
        """The first row whose uid is each of `uids`, None where no row's is."""
        hashes, by_hash = self._hashes, self._by_hash
        if not len(hashes) or not len(uids):
            return [None] * len(uids)
        wanted = np.array([hash(uid) for uid in uids], dtype=np.int64)
        at = np.minimum(np.searchsorted(hashes, wanted), len(hashes) - 1)
        hit = hashes[at] == wanted
        first = iter(self.named(by_hash[at[hit]].tolist()))  # the first row of each hash, decoded at once
        out: list[int | None] = []
        for uid, position, found in zip(uids, at.tolist(), hit.tolist(), strict=True):
            if not found:
                out.append(None)
            elif next(first)["uid"] == uid:
                out.append(int(by_hash[position]))
            else:  # another uid of the same hash comes first: the rest of the run of that hash
                out.append(self._row_among_equal_hashes(uid, position + 1))
        return out

    def _row_among_equal_hashes(self, uid: str, at: int) -> int | None:
        hashes, h = self._hashes, hash(uid)
        while at < len(hashes) and hashes[at] == h:
            if self.row(int(self._by_hash[at]))[0] == uid:
                return int(self._by_hash[at])
            at += 1
        return None

    def named(self, ids: list[int]) -> list[dict[str, str]]:
        """{"uid", "title"} of every row in `ids` (in range), the rows decoded as one JSON array by
        one orjson call: an answer's labels at about half the cost of a row() each."""
        m, starts, ends = self._map, self._starts, self._ends
        try:
            rows = orjson.loads(b"[%b]" % b",".join([m[starts[i] : ends[i]] for i in ids]))
            # Each row is exactly {"uid": str, "title": str} already, unless written since it was checked.
            if self._plain and all(type(row) is dict and len(row) == 2 and "uid" in row and "title" in row
                                   for row in rows):
                return rows
            return [{"uid": str(row["uid"]), "title": str(row["title"])} for row in rows]
        except (ValueError, KeyError, TypeError):
            for i in ids:
                self.row(i)  # raises naming the first row that no longer decodes
            raise self._changed(f"a row of lines {min(ids) + 1}-{max(ids) + 1}") from None

    def _check(self) -> None:
        # Bundles load on a background thread while the service answers requests: a thousand
        # rows per orjson.loads call (~0.5 ms), then the GIL is handed over.
        self._plain = True  # every row exactly {"uid": str, "title": str}, as LabelTable.save writes
        self._hashes = np.zeros(len(self), dtype=np.int64)
        for first in range(0, len(self), _ROWS_PER_CHUNK):
            if first:
                time.sleep(0)
            last = min(first + _ROWS_PER_CHUNK, len(self)) - 1
            chunk = self._map[self._starts[first] : self._ends[last]]
            try:
                rows = orjson.loads(b"[" + chunk.replace(b"\n", b",") + b"]")
                if len(rows) != last - first + 1:
                    raise ValueError(f"{self.path}: rows {first + 1}-{last + 1} do not hold one label each")
                self._hashes[first : last + 1] = [hash(str(row["uid"])) for row in rows]
                for row in rows:
                    str(row["uid"]), str(row["title"])
                    if self._plain and not (len(row) == 2 and type(row["uid"]) is str and type(row["title"]) is str):
                        self._plain = False
            except (ValueError, KeyError, TypeError):
                _raise_at_bad_row(self.path, chunk.split(b"\n"), first)
                raise


class _Column(Sequence[str]):
    """One field of every row of a MappedRows, as a read-only sequence."""

    def __init__(self, rows: MappedRows, field: int) -> None:
        self._rows, self._field = rows, field

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...
    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):  # a tuple, as a table built from sequences slices
            return tuple(self._rows.row(j)[self._field] for j in range(*i.indices(len(self))))
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"label row {i} out of range")
        return self._rows.row(i)[self._field]

    def __iter__(self) -> Iterator[str]:
        for j in range(len(self)):
            yield self._rows.row(j)[self._field]

    def __eq__(self, other: object) -> bool:
        """Equal to a tuple or column of the same strings, as the tuples of a built table are."""
        if isinstance(other, _Column | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


def _raise_at_bad_row(path: str | Path, chunk: list[bytes], start: int) -> None:
    """Re-parse a chunk that failed row by row, to name the file and line at fault."""
    for offset, line in enumerate(chunk):
        try:
            row = orjson.loads(line)
            str(row["uid"]), str(row["title"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{start + offset + 1}: bad label row: {exc}") from exc
