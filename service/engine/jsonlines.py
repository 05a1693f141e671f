"""JSON-lines files (one JSON object a line, `.gz` read as gzip), read with every problem a
ValueError naming the file and line: the training data's files and the label files of
`shortlist labels add`. Parsed by orjson, as every JSON the service reads (RFC 8259: no NaN,
nesting bounded), and bytes that are not UTF-8 are named by line and column, not by the offset
of a decoder's buffer.

A line is read at most SHORTLIST_MAX_LINE_CHARS characters at a time (64 Mi by default, far past
any real row): a longer one is refused naming the file and line before the rest of it is read,
so a file's memory is bounded by the limit, not by its longest line (a 4.5 MB .gz of 1 GB of
zeros, no newline, took 2.7 GB and 18 s to refuse when lines were read whole)."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import orjson

MAX_LINE_CHARS_ENV = "SHORTLIST_MAX_LINE_CHARS"
DEFAULT_MAX_LINE_CHARS = 64 << 20
# A limit below a short row would refuse every file; above 2^31 a line is no longer bounded in practice.
MAX_LINE_CHARS_RANGE = (1024, 1 << 31)

# Bytes that are not UTF-8, as a file read with errors="surrogateescape" holds them.
_UNDECODED = re.compile("[\udc80-\udcff]")


def not_utf8(line: str) -> str | None:
    """What is not UTF-8 in a line read with errors="surrogateescape" (None: nothing)."""
    found = _UNDECODED.search(line)
    if found is None:
        return None
    return f"not UTF-8: byte 0x{ord(found.group()) - 0xDC00:02x} at column {found.start() + 1}"


def os_reason(exc: BaseException) -> str:
    """Why an OS call failed, without the "[Errno 21] ...: 'PATH'" the message already names
    ("is a directory"); other errors (gzip's "Not a gzipped file") as they are."""
    strerror = getattr(exc, "strerror", None)
    return strerror[:1].lower() + strerror[1:] if strerror else str(exc)


def max_line_chars() -> int:
    """The longest line a data file may hold: SHORTLIST_MAX_LINE_CHARS, else DEFAULT_MAX_LINE_CHARS."""
    # In any case, as the service's settings read every SHORTLIST_* variable (and refuse a bad
    # one): `shortlist_max_line_chars=1023` stopped `serve` but was ignored here.
    raw = next((value for name, value in os.environ.items() if name.upper() == MAX_LINE_CHARS_ENV), None)
    if raw is None or not raw.strip():
        return DEFAULT_MAX_LINE_CHARS
    low, high = MAX_LINE_CHARS_RANGE
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not low <= value <= high:
        raise ValueError(f"{MAX_LINE_CHARS_ENV}={raw[:40]!r}: expected a whole number of characters in [{low}, {high}]")
    return value


def bounded_lines(f: IO[str], path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line without its line end) of a text stream, each at most max_line_chars()."""
    limit = max_line_chars()
    lineno = 0
    while line := _next_line(f, limit, path, lineno):
        lineno += 1
        if len(line) > limit and not (len(line) == limit + 1 and line.endswith("\n")):
            raise ValueError(f"{path}:{lineno}: line longer than {limit} characters ({MAX_LINE_CHARS_ENV})")
        yield lineno, line.rstrip("\r\n")


def _next_line(f: IO[str], limit: int, path: Path, lineno: int) -> str:
    # zlib's error is no OSError: a .gz damaged inside its data (not truncated, which gzip calls an
    # EOFError) escaped every reader's except as a traceback and exit 1.
    try:
        return f.readline(limit + 1)
    except zlib.error as exc:
        raise ValueError(f"{path}: cannot read file: corrupt gzip data after {lineno} readable lines ({exc})") from None


def require_regular(path: Path, what: str) -> None:
    """A data file must be a regular file (or a symlink to one): /dev/zero would be read for
    ever, a FIFO nobody writes would hang the open itself. (A folder is left to open(): "is a
    directory".)"""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise ValueError(f"{path}: cannot read {what}: not a regular file")


def iter_text_lines(path: Path, what: str = "file") -> Iterator[tuple[int, str]]:
    """(line number, line) of a plain UTF-8 text file (a filter file, a uids file); `what` names
    the file in the error when it cannot be read."""
    try:
        require_regular(path, what)
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            for lineno, line in bounded_lines(f, path):
                if (why := not_utf8(line)) is not None:
                    raise ValueError(f"{path}:{lineno}: {why}")
                yield lineno, line
    except OSError as exc:
        raise ValueError(f"{path}: cannot read {what}: {os_reason(exc)}") from None


_ARRAY_HINT = " (a file of rows holds one JSON object a line, JSON Lines, not a JSON array)"


def iter_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every line that is not blank."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        require_regular(path, "file")
        with opener(path, "rt", encoding="utf-8", errors="surrogateescape") as f:
            first = True
            for lineno, line in bounded_lines(f, path):
                if not line.strip():
                    continue
                # A whole JSON array (one line or many) is the commonest wrong layout: said so.
                hint = _ARRAY_HINT if first and line.lstrip().startswith("[") else ""
                first = False
                try:
                    row = orjson.loads(line)
                except json.JSONDecodeError as exc:
                    why = not_utf8(line) or f"not JSON ({exc.msg})"
                    raise ValueError(f"{path}:{lineno}: malformed line, {why}{hint}") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{lineno}: malformed line, expected a JSON object{hint}")
                yield lineno, row
    except (OSError, EOFError) as exc:
        raise ValueError(f"{path}: cannot read file: {os_reason(exc)}") from None


def non_finite_at(value: Any, path: str = "") -> str | None:
    """Where a JSON-like value (dicts, lists, numbers) holds NaN or an infinity: its path
    ("metrics.losses[2]"; "" for the value itself), None where it holds neither."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
    for key, item in items:
        found = non_finite_at(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def strict_dumps(value: Any, what: str, indent: int | None = None) -> str:
    """`value` as JSON, refused (ValueError naming `what` and where) if it holds NaN or an
    infinity: Python's json writes them as bare NaN / Infinity tokens, which RFC 8259 and every
    reader here (orjson) refuse, so a file written that way was called corrupt by its own loader."""
    try:
        return json.dumps(value, indent=indent, allow_nan=False)
    except ValueError:
        where = non_finite_at(value)
        raise ValueError(f"{what}: {where or 'the value'} is not a finite number (JSON holds no NaN or infinity): "
                         "not written") from None


def json_kind(value: Any) -> str:
    """A JSON value's kind for a message: 'null', 'true', 'the number 1.5', 'an object', ..."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int | float):
        shown = repr(value)
        return f"the number {shown if len(shown) <= 24 else shown[:24] + '...'}"
    if isinstance(value, str):
        return "an empty string" if not value.strip() else "a string"
    return "an object" if isinstance(value, dict) else "a list"


def row_uid(row: dict[str, Any], path: Path, lineno: int, name: str = "uid") -> str:
    """The row's uid: a string with something besides whitespace. Anything else is an error, not
    stringified: null would become the uid "None" and 1 the same uid as "1"."""
    if name not in row:
        raise ValueError(f"{path}:{lineno}: missing field {name!r}")
    uid = row[name]
    if not isinstance(uid, str) or not uid.strip():
        raise ValueError(f"{path}:{lineno}: field {name!r} must be a non-empty string, got {json_kind(uid)}")
    return uid
