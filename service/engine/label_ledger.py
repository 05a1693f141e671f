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
base's versions on disk (`rebuilt`: their labels read once, not at every change).

Confirmation: a change marks its version unconfirmed (`.unconfirmed.json`, with how much of the
id record it added) before the version is renamed into place, and removes the mark once it is
activated. A mark found by the next change or at start-up, under the activation lock (so the
change that wrote it is not running), names a version that a crash left between its rename and
its activation: nobody was told it exists. The registry then moves it out of the places
bundles are listed from (`quarantine`) and takes its ids back (`undo`), unless the recorded
active version or history names it (it was activated after all). Until then the store never
picks it as "the newest bundle".

Every file is written as active.json is (small_files.write_atomically): old or new, never torn.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from service.engine.labels import LabelTable
from service.engine.schema import LABELS, BundleError, validate_version_name
from service.engine.small_files import read_small_file, write_atomically

log = logging.getLogger("shortlist.ledger")

LEDGER_DIR = "label_ledger"
UNCONFIRMED_FILE = ".unconfirmed.json"
QUARANTINE_DIR = "unconfirmed"
# The mark holds three short fields. The id records are not capped: they grow with the labels
# given out, as the bundles' labels.jsonl do, and a cap would stop every later change.
MAX_MARK_BYTES = 64 * 1024


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

    def given_out_past(self, rows: int) -> list[str]:
        """The uids of ids rows, rows + 1, ... given out on versions other than one of `rows` rows."""
        return list(self.uids[max(rows - self.first_id, 0):])


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
            raw = orjson.loads(read_small_file(path, sys.maxsize))
            uids = raw["uids"]
            if raw["first_id"] != first_id or not all(isinstance(u, str) for u in uids):
                raise ValueError(f"not a record of {first_id} rows and uids")
            return IdRecord(base, first_id, tuple(uids))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("ignoring the label id record %s (made again from the versions on disk): %s", path, exc)
            return None

    def rebuilt(self, base: str, first_id: int, versions: list[Path]) -> IdRecord:
        """The record of `base` made again from the label tables of its versions (bundle directories):
        the rows of each past what the others hold. A version that cannot be read is skipped (logged)."""
        record = IdRecord(base, first_id)
        for path in versions:
            try:
                record = record.merged(LabelTable.load(path / LABELS))
            except (OSError, ValueError) as exc:
                log.warning("label id record of %s: skipping %s: %s", base, path, exc)
        return record

    def write(self, record: IdRecord) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomically(self._record_path(record.base),
                         orjson.dumps({"base": record.base, "first_id": record.first_id, "uids": record.uids}))

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

    def quarantine(self, bundle_dir: Path) -> Path:
        """Move a version nobody confirmed to STATE_DIR/unconfirmed/VERSION.N (kept for inspection;
        safe to delete): no place lists or activates it any more."""
        out = self.state_dir / QUARANTINE_DIR
        out.mkdir(exist_ok=True)
        n = 1
        while (out / f"{bundle_dir.name}.{n}").exists():
            n += 1
        os.rename(bundle_dir, out / f"{bundle_dir.name}.{n}")
        return out / f"{bundle_dir.name}.{n}"

    def _record_path(self, base: str) -> Path:
        return self.dir / f"{validate_version_name(base)}.json"
