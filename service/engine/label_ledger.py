"""What label changes gave out, across every version derived from one base, and which change
is not confirmed yet: the state directory's ledger (STATE_DIR/label_ledger/).

Ids: a change derives from the serving version, and a rollback can serve an older one than the
last change made; the next change would give the ids (rows) and uids its parent does not hold
to other labels. So the ledger keeps, per base, every uid given out past the base's own rows,
in id order (`BASE.json`), and a change derived from a parent with fewer rows first fills the
gap with retired rows holding those uids (LabelEditor.derive's `given_out`): ids stay row
numbers, and neither an id nor a uid ever names two labels. The record is caught up with the
parent's own rows at every change (`IdRecord.merged`), so a record behind never makes a change
give out an id or uid its parent holds; a record lost (or unreadable) is made again from the
base's versions on disk (`rebuilt`: their labels read once, not at every change), and from
the record retention keeps of the versions it removed (`keep_removed`, `.removed-BASE.json`: the
uids they gave out past the base), since a removed version's labels are no longer on disk.

Confirmation: a change marks its version unconfirmed (`.unconfirmed.json`, with how much of the
id record it added) before the version is renamed into place, and removes the mark once it is
activated (right after active.json names it, in the same locked section). A mark found at the
start of the next activation, rollback, change or start-up, under the activation lock (so the
change that wrote it is not running) and before that section changes active.json, names a
version that a crash left between its rename and its activation: nobody was told it exists.
The registry then moves it out of the places bundles are listed from (`quarantine`) and takes
its ids back (`undo`), unless the recorded active version or history names it (it was
activated after all: once recorded active, confirmed for good). Until then the store never
picks it as "the newest bundle".

Every file is written as active.json is (small_files.write_atomically): old or new, never torn.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from service.engine.labels import LabelTable
from service.engine.schema import LABELS, BundleError, validate_version_name
from service.engine.small_files import read_small_file, write_atomically
from service.engine.tokenizer import is_blank

log = logging.getLogger("shortlist.ledger")

LEDGER_DIR = "label_ledger"
UNCONFIRMED_FILE = ".unconfirmed.json"
# LEDGER_DIR/.removed-BASE.json: the uids the base's versions retention removed gave out
# (LabelLedger.keep_removed). Dot-named: no version name, so no BASE.json, starts with a dot.
REMOVED_PREFIX = ".removed-"
QUARANTINE_DIR = "unconfirmed"
# The mark holds three short fields.
MAX_MARK_BYTES = 64 * 1024
# The longest uid a record may hold, and the most SHORTLIST_MAX_UID_CHARS allows (service.api.settings),
# so a uid any configuration accepted is kept and a record holding a longer one is not this service's.
MAX_UID_CHARS = 10_000
# The most bytes of an id record read (or of a removed version's, below). Records grow with the
# uids given out (~300 K uids of 200 characters); one larger is not read whole into memory but
# made again from the versions on disk (logged), as an unreadable one is: slower, never wrong.
MAX_ID_RECORD_BYTES = 64 * 1024 * 1024


def is_recordable_uid(uid: object) -> bool:
    """A uid as POST /admin/labels takes one (at most MAX_UID_CHARS, not blank: tokenizer.is_blank)."""
    return isinstance(uid, str) and 0 < len(uid) <= MAX_UID_CHARS and not is_blank(uid)


@dataclass(frozen=True)
class IdRecord:
    """The uids given out past a base's own rows: id first_id + i is uids[i]."""

    base: str
    first_id: int
    uids: tuple[str, ...] = ()

    @property
    def next_id(self) -> int:
        return self.first_id + len(self.uids)

    def merged(self, table: LabelTable) -> IdRecord:
        """The record caught up with a parent's own rows (past what it records: lost, or a
        parent made elsewhere)."""
        if len(table) <= self.next_id:
            return self
        extra = tuple(table.row(i)[0] for i in range(self.next_id, len(table)))
        return IdRecord(self.base, self.first_id, self.uids + extra)

    def extended(self, other: IdRecord) -> IdRecord:
        """The record caught up with another record of the same base (the uids it holds past this one's)."""
        return IdRecord(self.base, self.first_id, self.uids + other.uids[len(self.uids):])

    def given_out_past(self, rows: int) -> list[str]:
        """The uids of ids rows, rows + 1, ... given out on versions other than one of `rows` rows."""
        return list(self.uids[max(rows - self.first_id, 0):])

    def encoded(self) -> bytes:
        return orjson.dumps({"base": self.base, "first_id": self.first_id, "uids": self.uids})


def decoded_record(data: bytes) -> IdRecord:
    """The id record `data` holds; ValueError when it is not one, or holds what a change could not
    have given out as a uid (is_recordable_uid)."""
    raw = orjson.loads(data)
    base, first_id, uids = raw["base"], raw["first_id"], raw["uids"]
    if not isinstance(base, str) or not isinstance(first_id, int) or first_id < 0:
        raise ValueError("not a record of a base and the first id it gives out")
    bad = next((i for i, u in enumerate(uids) if not is_recordable_uid(u)), None)
    if bad is not None:
        raise ValueError(f"uids[{bad}] is not a uid (a non-blank string of at most {MAX_UID_CHARS} characters)")
    return IdRecord(base, first_id, tuple(uids))


def removed_version_record(bundle_dir: Path, base: str, first_id: int) -> IdRecord:
    """What retention keeps of a version it removes (service.engine.store.prune_derived): the uids
    it holds past its base's rows, so a record made again (`rebuilt`) still holds them."""
    table = LabelTable.load(bundle_dir / LABELS)
    return IdRecord(base, first_id, tuple(table.row(i)[0] for i in range(first_id, len(table))))


@dataclass(frozen=True)
class Unconfirmed:
    """A change's version not yet activated; `keep`: its base's record's length before it."""

    version: str
    base: str
    first_id: int
    keep: int


class LabelLedger:
    def __init__(self, state_dir: str | Path) -> None:
        self.state_dir = Path(state_dir)
        self.dir = self.state_dir / LEDGER_DIR

    def record(self, base: str, first_id: int) -> IdRecord | None:
        """The base's id record; None when there is none or it cannot be read (logged)."""
        path = self._record_path(base)
        try:
            record = decoded_record(read_small_file(path, MAX_ID_RECORD_BYTES))
            if (record.base, record.first_id) != (base, first_id):
                raise ValueError(f"not a record of base {base!r} starting at id {first_id}")
            return record
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("ignoring the label id record %s (made again from the versions on disk): %s", path, exc)
            return None

    def rebuilt(self, base: str, first_id: int, versions: list[Path]) -> IdRecord:
        """The record of `base` made again from the label tables of its versions (bundle directories)
        and the records retention kept of removed ones (files: keep_removed's, and the marker files
        older releases left in their place; those of another base are passed over): the rows of
        each past what the others hold. A version that cannot be read is skipped (logged)."""
        record = IdRecord(base, first_id)
        for path in versions:
            try:
                if path.is_dir():
                    record = record.merged(LabelTable.load(path / LABELS))
                elif path.stat().st_size > 0:  # retention before removed versions kept their uids: empty
                    removed = decoded_record(read_small_file(path, MAX_ID_RECORD_BYTES))
                    if (removed.base, removed.first_id) == (base, first_id):
                        record = record.extended(removed)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("label id record of %s: skipping %s: %s", base, path, exc)
        return record

    def current(self, base: str, first_id: int, parent: LabelTable, versions: Callable[[], list[Path]]) -> IdRecord:
        """What the base has given out, as a change derived from `parent` (its label table) sees it:
        the record (made again from `versions()`, the base's versions and removed versions' files,
        when lost) merged with the parent's rows."""
        return (self.record(base, first_id) or self.rebuilt(base, first_id, versions())).merged(parent)

    def removed_path(self, base: str) -> Path:
        """The record of the uids the base's removed versions gave out (keep_removed)."""
        return self.dir / f"{REMOVED_PREFIX}{validate_version_name(base)}.json"

    def keep_removed(self, removed: IdRecord) -> None:
        """Add what a version retention removes gave out to its base's one record of them (a
        copy beside BASE.json, so a lost record is made again with them: `rebuilt` reads it as it
        reads a version): the versions of a base share their ids, so the longest holds them all.
        One that cannot be read is replaced (logged): BASE.json still holds what it held.
        OSError when it cannot be written."""
        path = self.removed_path(removed.base)
        try:
            kept = decoded_record(read_small_file(path, MAX_ID_RECORD_BYTES))
            if (kept.base, kept.first_id) == (removed.base, removed.first_id):
                removed = kept.extended(removed)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("replacing the record of removed versions' uids %s: %s", path, exc)
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomically(path, removed.encoded())

    def write(self, record: IdRecord) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomically(self._record_path(record.base), record.encoded())

    def mark(self, pending: Unconfirmed) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomically(self.dir / UNCONFIRMED_FILE, orjson.dumps(asdict(pending)))

    def unconfirmed(self) -> Unconfirmed | None:
        """The marked version, None when there is none (or the mark is unreadable: logged)."""
        path = self.dir / UNCONFIRMED_FILE
        try:
            raw = orjson.loads(read_small_file(path, MAX_MARK_BYTES))
            pending = Unconfirmed(str(raw["version"]), str(raw["base"]), int(raw["first_id"]), int(raw["keep"]))
            validate_version_name(pending.version)
            validate_version_name(pending.base)
            return pending
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, BundleError) as exc:
            log.error("ignoring the unconfirmed-change mark %s: %s", path, exc)
            return None

    def confirm(self) -> None:
        """Remove the mark: its version was activated (or set aside)."""
        (self.dir / UNCONFIRMED_FILE).unlink(missing_ok=True)

    def undo(self, pending: Unconfirmed) -> None:
        """Take back the ids and uids the unconfirmed change gave out (nothing was given out after
        them: the next change settles the mark first)."""
        record = self.record(pending.base, pending.first_id)
        if record is not None and len(record.uids) > pending.keep:
            self.write(IdRecord(record.base, record.first_id, record.uids[: pending.keep]))

    def quarantine(self, bundle_dir: Path, keep: int | None = None) -> Path:
        """Move a version nobody confirmed to STATE_DIR/unconfirmed/VERSION.N (kept for inspection;
        safe to delete): no place lists or activates it any more. With `keep`, only the newest
        `keep` set aside stay, this one always (a bundle each: repeated refusals must not fill the disk)."""
        out = self.state_dir / QUARANTINE_DIR
        out.mkdir(exist_ok=True)
        n = 1 + max((int(p.suffix[1:]) for p in out.glob(f"{bundle_dir.name}.*") if p.suffix[1:].isdigit()),
                    default=0)  # past the highest: N orders a version's set-aside copies
        os.rename(bundle_dir, out / f"{bundle_dir.name}.{n}")
        if keep is not None:
            self._drop_oldest_set_aside(out, keep, newest=out / f"{bundle_dir.name}.{n}")
        return out / f"{bundle_dir.name}.{n}"

    @staticmethod
    def _drop_oldest_set_aside(out: Path, keep: int, newest: Path) -> None:
        try:
            held = sorted((p for p in out.iterdir() if p != newest), key=lambda p: p.lstat().st_mtime)
        except OSError as exc:
            log.warning("cannot list %s to keep the newest %d set aside: %s", out, keep, exc)
            return
        doomed = held[: max(len(held) + 1 - keep, 0)]
        for path in doomed:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if doomed:
            log.info("removed %d versions set aside in %s beyond the newest %d: %s", len(doomed), out, keep,
                     ", ".join(p.name for p in doomed))

    def _record_path(self, base: str) -> Path:
        return self.dir / f"{validate_version_name(base)}.json"
