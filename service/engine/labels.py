"""The label table: row i is label i in every array, index and response."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

_ROWS_PER_YIELD = 2000


class LabelTable:
    def __init__(self, uids: Sequence[str], titles: Sequence[str]) -> None:
        if len(uids) != len(titles):
            raise ValueError(f"{len(uids)} label uids but {len(titles)} titles")
        self.uids = list(uids)
        self.titles = list(titles)

    def __len__(self) -> int:
        return len(self.uids)

    def save(self, path: str | Path) -> None:
        with Path(path).open("w", encoding="utf-8") as f:
            for uid, title in zip(self.uids, self.titles, strict=True):
                f.write(json.dumps({"uid": uid, "title": title}, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LabelTable:
        # Bundles load on a background thread while the service answers requests: parsing
        # 10^5+ rows in one stretch held the GIL for up to 60 ms at a time (measured with a
        # ticker thread during hot swaps), so the loop hands the GIL over every few thousand rows.
        raw = Path(path).read_bytes()
        uids: list[str] = []
        titles: list[str] = []
        lines = raw.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()
        for lineno, line in enumerate(lines, 1):
            if lineno % _ROWS_PER_YIELD == 0:
                time.sleep(0)
            try:
                row = json.loads(line)
                uids.append(str(row["uid"]))
                titles.append(str(row["title"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: bad label row: {exc}") from exc
        return cls(uids, titles)
