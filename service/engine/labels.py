"""The label table: row i is label i in every array, index and response."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


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
        uids: list[str] = []
        titles: list[str] = []
        with Path(path).open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    row = json.loads(line)
                    uids.append(str(row["uid"]))
                    titles.append(str(row["title"]))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{lineno}: bad label row: {exc}") from exc
        return cls(uids, titles)
