"""Progress lines in a log file: long work made of many short loops still reports."""

from __future__ import annotations

import logging
import time

import pytest

from training.progress import Progress


def _run(loops: int, items: int, pause_s: float, every_s: float) -> None:
    for epoch in range(loops):
        for _ in Progress(range(items), f"epoch {epoch + 1}/{loops}", every_s=every_s):
            time.sleep(pause_s)


def test_short_loops_one_after_another_still_write_lines(caplog: pytest.LogCaptureFixture) -> None:
    """20 loops of 0.1 s, each shorter than the 0.3 s between lines: a line at least every 0.3 s
    of the 2 s they take together (each loop's own clock wrote none), naming the loop it is in."""
    with caplog.at_level(logging.INFO, logger="shortlist.training"):
        started = time.monotonic()
        _run(20, 5, 0.02, 0.3)
        took = time.monotonic() - started
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) >= int(took / 0.3) - 1 >= 4, (took, lines)
    assert all(line.startswith("epoch ") and "/20: " in line for line in lines), lines


def test_a_loop_after_a_pause_starts_its_own_clock(caplog: pytest.LogCaptureFixture) -> None:
    """A loop that starts well after the last one (other work between) writes no line at its first
    item: its first comes every_s into it."""
    _run(1, 3, 0.01, 0.2)
    time.sleep(0.5)
    with caplog.at_level(logging.INFO, logger="shortlist.training"):
        started = time.time()
        _run(1, 10, 0.05, 0.3)
    assert caplog.records, "a 0.5 s loop wrote no line"
    assert caplog.records[0].created - started >= 0.29, caplog.records[0].getMessage()
