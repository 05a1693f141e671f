"""Helpers shared by the benchmarks in bench/: timing, memory, dataset subsets, RESULTS.md sections.

Benchmarks are scripts, not tests: they print figures. On a shared 2-core machine absolute
numbers drift, so every script measures its baseline in the same run and reports ratios too.
"""

from __future__ import annotations

import gzip
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / "bench"
OUT_DIR = BENCH_DIR / "out"


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def latency_summary(seconds: Sequence[float]) -> dict[str, float]:
    """p50, p99 and mean of per-call wall times, in milliseconds."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    if ms.size == 0:
        raise ValueError("no latency samples")
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
    }


def time_calls(call: Callable[[str], Any], texts: Sequence[str], warmup: int = 20) -> tuple[list[float], list[Any]]:
    """Wall time of call(text) for each text, one at a time, after `warmup` untimed calls."""
    for text in texts[:warmup]:
        call(text)
    seconds: list[float] = []
    outputs: list[Any] = []
    clock = time.perf_counter
    for text in texts:
        start = clock()
        out = call(text)
        seconds.append(clock() - start)
        outputs.append(out)
    return seconds, outputs


def write_jsonl_gz(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    rows: list[dict[str, Any]] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(rows) >= limit:
                break
            if line.strip():
                rows.append(json.loads(line))
    return rows


def git_revision() -> str:
    """Short commit of the working tree (with '+dirty' when it has uncommitted changes)."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line() -> str:
    """The command that is running, as a user would type it from the repository root."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(REPO_ROOT)
    except ValueError:
        pass
    return " ".join(["python", str(script), *sys.argv[1:]])


def add_bundle_arguments(ap: Any) -> None:
    """--bundle-root, --version and --data, as the HTTP benchmarks take them (an argparse parser)."""
    ap.add_argument("--bundle-root", type=Path, required=True)
    ap.add_argument("--version", default=None)
    ap.add_argument("--data", default=None, help="dataset folder: queries from its tst titles (default: label titles)")


def replace_section(markdown_path: Path, key: str, body: str, title: str = "# Benchmark results") -> None:
    """Put `body` between <!-- key --> markers in a markdown file, keeping every other section."""
    start, end = f"<!-- {key} -->", f"<!-- /{key} -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = markdown_path.read_text(encoding="utf-8") if markdown_path.exists() else f"{title}\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    markdown_path.write_text(text, encoding="utf-8")
