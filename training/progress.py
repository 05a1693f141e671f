"""Progress of long loops: a bar on a terminal, a plain log line every few seconds elsewhere
(a log file or CI gets readable lines, not thousands of carriage-return frames)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("shortlist.training")
LOG_EVERY_S = 10.0


class _LineClock:
    """When a progress line was last written and a loop last advanced, shared by every Progress:
    loops that follow each other closely (an epoch's batches, 100 epochs of 8 s each) get a line
    every few seconds between them, where a clock of each loop's own wrote none (the token
    table's 100 short epochs ran 5 minutes without a line)."""

    last = active = float("-inf")


_lines = _LineClock()


class Progress:
    """Iterate `items` showing progress under `desc`; `postfix(**values)` adds figures (a loss)."""

    def __init__(self, items: Iterable[T], desc: str, total: int | None = None, enabled: bool = True,
                 every_s: float = LOG_EVERY_S) -> None:
        self.items = items
        self.desc = desc
        self.total = total if total is not None else _length(items)
        self.enabled = enabled
        self.every_s = every_s
        self._bar: Any = None  # tqdm's bar, on a terminal
        self._values: dict[str, Any] = {}

    def __iter__(self) -> Iterator[T]:
        if not self.enabled:
            yield from self.items
            return
        tqdm = _tqdm() if sys.stderr.isatty() else None
        if tqdm is not None:
            self._bar = tqdm(self.items, desc=self.desc, total=self.total, leave=False, mininterval=1.0)
            yield from self._bar
            return
        start = time.monotonic()
        if not 0 <= start - _lines.active <= self.every_s:  # not right after another loop: a fresh clock
            _lines.last = start
        done = 0
        for item in self.items:
            yield item
            done += 1
            now = _lines.active = time.monotonic()
            if now - _lines.last >= self.every_s:
                _lines.last = now
                log.info("%s: %s (%.0fs)%s", self.desc, self._count(done), now - start, self._figures())

    def postfix(self, **values: Any) -> None:
        self._values = values
        if self._bar is not None:
            self._bar.set_postfix(values)

    def _count(self, done: int) -> str:
        return f"{done}/{self.total} ({100.0 * done / self.total:.0f}%)" if self.total else str(done)

    def _figures(self) -> str:
        return "".join(f", {k}={v}" for k, v in self._values.items())


def _tqdm() -> Any:
    """tqdm's bar class, or None: it comes with the training extra, and `shortlist eval` runs
    without it (log lines then, on a terminal too)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def _length(items: Iterable[Any]) -> int | None:
    try:
        return len(items)  # type: ignore[arg-type]
    except TypeError:
        return None
