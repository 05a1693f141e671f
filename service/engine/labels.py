"""The label table: row i is label i in every array, index and response."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import orjson

_ROWS_PER_CHUNK = 1024


class LabelTable:
    def __init__(self, uids: Sequence[str], titles: Sequence[str]) -> None:
        if len(uids) != len(titles):
            raise ValueError(f"{len(uids)} label uids but {len(titles)} titles")
        # Tuples, not lists: the cyclic GC stops tracking a tuple of strings, while it walks a
        # list's every element at each full collection (~3 ms per collection on debian-deps,
        # with the GIL held, about once a second under load).
        self.uids: tuple[str, ...] = tuple(uids)
        self.titles: tuple[str, ...] = tuple(titles)
        self._ids: dict[str, int] | None = None

    def __len__(self) -> int:
        return len(self.uids)

    def ids_of(self, uids: Sequence[str]) -> list[int | None]:
        """The row of each uid, None for a uid not in the table (first occurrence if repeated).

        The uid -> row index is built on first use (~5 ms and a few MB per 40K labels), not at
        load: only requests that name labels by uid need it.
        """
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
        # Bundles load on a background thread while the service answers requests: a row at a
        # time in Python, 10^5 rows kept the GIL busy for ~80 ms (and held it up to 60 ms at a
        # stretch); a thousand rows per orjson.loads call take ~0.5 ms, then hand it over.
        raw = Path(path).read_bytes()
        lines = raw.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()
        uids: list[str] = []
        titles: list[str] = []
        for start in range(0, len(lines), _ROWS_PER_CHUNK):
            if start:
                time.sleep(0)
            chunk = lines[start : start + _ROWS_PER_CHUNK]
            try:
                rows = orjson.loads(b"[" + b",".join(chunk) + b"]")
                uids.extend(str(row["uid"]) for row in rows)
                titles.extend(str(row["title"]) for row in rows)
            except (ValueError, KeyError, TypeError):
                _raise_at_bad_row(path, chunk, start)
                raise
        return cls(uids, titles)


def _raise_at_bad_row(path: str | Path, chunk: list[bytes], start: int) -> None:
    """Re-parse a chunk that failed row by row, to name the file and line at fault."""
    for offset, line in enumerate(chunk):
        try:
            row = json.loads(line)
            str(row["uid"]), str(row["title"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{start + offset + 1}: bad label row: {exc}") from exc
