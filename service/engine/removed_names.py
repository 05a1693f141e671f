"""The names of label changes' versions and which of them retention removed (audit 7 F7).

A label change's version is named BASE.labels-N (`derived_version`); a version name is never given
to other contents, so a removed version's name stays taken. Retention removes a version after
every activation (store.BundleStore.prune_derived): a marker file per removed name grew by one
entry per change for ever (~170 k a day at the permitted change rate), each listed at start-up and
by GET /admin/bundles. Instead one small record, STATE_DIR/bundles/.removed-names.json (written as
every state record is: small_files.write_atomically), holds per name stem the highest N removed:
every STEM.labels-k with k <= N counts as taken, and a new name starts past it. Its size grows with
the stems (one per base), not with the changes.

A name of another form (a bundle written into STATE_DIR/bundles under a chosen name) still gets
a marker file of its own, as do the names removed before this record existed: both are honoured
as taken (store.BundleStore.exists), and the latter are folded into the record by the next removal.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import orjson

from service.engine.small_files import read_small_file, write_atomically

DERIVED_SUFFIX = ".labels-"
NAMES_FILE = ".removed-names.json"
# One entry (a stem of <= 64 characters and a number) per base a chain of changes started from:
# 1 MiB is ~15 k bases. A larger file is not this service's record.
MAX_NAMES_BYTES = 1024 * 1024
MAX_VERSION_CHARS = 64


def derived_version(base: str, taken: Callable[[str], bool], highest: Mapping[str, int] | None = None) -> str:
    """BASE.labels-N, the first N >= 1 not taken (BASE shortened to keep 64 characters), past the
    highest N removed of its stem (`highest`, RemovedNames.highest): those are taken, and are
    skipped without asking `taken` once each."""
    highest = highest or {}
    n = 1
    while True:
        suffix = f"{DERIVED_SUFFIX}{n}"
        stem = base[: MAX_VERSION_CHARS - len(suffix)]
        if n <= highest.get(stem, 0):
            n = highest[stem] + 1
            continue
        if not taken(stem + suffix):
            return stem + suffix
        n += 1


def numbered(name: str) -> tuple[str, int] | None:
    """(STEM, N) of a name STEM.labels-N, None for a name of another form."""
    stem, sep, n = name.rpartition(DERIVED_SUFFIX)
    if not sep or not stem or not (n.isascii() and n.isdigit()):
        return None
    return stem, int(n)


class RemovedNames:
    """The record of the names retention removed in `derived_root` (STATE_DIR/bundles)."""

    def __init__(self, derived_root: Path) -> None:
        self.path = derived_root / NAMES_FILE

    def highest(self) -> dict[str, int]:
        """Stem -> the highest N removed; {} when nothing was. OSError (EIO, naming the file) when
        the record is there but cannot be read: which names were given out is then unknown, and a
        writer must not guess (a name given twice names two bundles)."""
        try:
            raw = orjson.loads(read_small_file(self.path, MAX_NAMES_BYTES))
            highest = raw["highest"]
            if not isinstance(highest, dict) or not all(
                    isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in highest.items()):
                raise ValueError("not a record of name stems and numbers")
            return highest
        except (FileNotFoundError, NotADirectoryError):  # no record there (no directory to hold one)
            return {}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise OSError(errno.EIO, f"the record of removed version names cannot be read ({exc}); which "
                          "names were given out is unknown: restore or fix it", str(self.path)) from None

    def holds(self, name: str) -> bool:
        """Whether `name` was given to a version retention removed (as far as the record says)."""
        parts = numbered(name)
        return parts is not None and parts[1] <= self.highest().get(parts[0], -1)

    def add(self, names: Iterable[str]) -> None:
        """Record `names` (numbered ones; others are passed over) as removed; OSError when the
        record cannot be read or written, nothing changed."""
        highest = self.highest()
        before = dict(highest)
        for stem, n in filter(None, map(numbered, names)):
            highest[stem] = max(highest.get(stem, 0), n)
        if highest != before:
            write_atomically(self.path, orjson.dumps({"highest": highest}))
