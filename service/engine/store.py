"""Bundles on disk: reading manifests, listing and resolving versions, and writing a bundle
through a staging directory renamed into place (so a crash never leaves a half bundle under
its final name).

Bundles live in two places (`BundleStore`): the bundle root (trained and exported; it may be
read-only, as a container mounts it) and, with a state directory, STATE_DIR/bundles (bundles
derived from another by label changes, service.engine.label_changes). A version names one
bundle: writers give no name either place holds (BundleStore.check_free). A name found in both
anyway (an export or a copy given a taken name) is the state directory's: a label change is
given only a name no place holds, so the state's came first and is the one the active record,
its rollback history and its retired labels refer to. The bundle root's is listed as shadowed,
never served, and said in the log.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
import threading
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from service.engine.label_ledger import (
    MAX_ID_RECORD_BYTES,
    IdRecord,
    LabelLedger,
    decoded_record,
    removed_version_record,
)
from service.engine.manifests import list_bundles
from service.engine.removed_names import RemovedNames, derived_version, numbered
from service.engine.schema import (
    FORMAT_VERSION,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    REQUIRED_FILES,
    BundleError,
    Manifest,
    sha256_file,
    validate_version_name,
)
from service.engine.small_files import read_small_file

log = logging.getLogger("shortlist.store")


def resolve_bundle_dir(root: str | Path, version: str) -> Path:
    """ROOT/VERSION, refusing names or symlinks that lead outside the root."""
    validate_version_name(version)
    root_real = Path(root).resolve()
    candidate = (root_real / version).resolve()
    if candidate.parent != root_real:
        raise BundleError(f"bundle {version!r} resolves outside the bundle root {root_real}")
    if not candidate.is_dir():
        raise BundleError(f"no bundle {version!r} under {root_real}")
    return candidate


STAGING_PREFIX = ".staging-"
# A derived version being removed (BundleStore.prune_derived): renamed out of listings, then deleted.
REMOVING_PREFIX = ".removing-"
# Staging directory -> the descriptor whose flock says its writer (this process) is alive.
_held: dict[Path, int] = {}
_held_lock = threading.Lock()


def staging_dir(root: Path, version: str) -> Path:
    """A fresh hidden directory under root to write bundle `version` into, flock'ed by this
    process while it writes: sweep_staging (run here first) removes only directories no live
    writer holds, whatever pid their name has (pids repeat: a container's server is pid 1 at
    every run). The lock goes with finalize_bundle's rename, or once the directory is gone (a
    failed write removes its staging directory)."""
    validate_version_name(version)
    root.mkdir(parents=True, exist_ok=True)
    if (root / version).exists():
        raise BundleError(f"bundle {root / version} already exists; bundles are immutable, pick another version")
    _release_gone()
    sweep_staging(root)
    for _ in range(3):  # a sweep elsewhere may take a directory between its mkdir and its lock
        staging = root / f"{STAGING_PREFIX}{version}-{os.getpid()}-{secrets.token_hex(4)}"
        staging.mkdir()
        if _hold(staging):
            return staging
    raise OSError(errno.EBUSY, "staging directories were removed by a sweep as they were made", str(root))


def _hold(staging: Path) -> bool:
    """Lock `staging` for this process; False when it is gone or another holds it (a sweep
    removing it). Where flock is not supported the directory is written unlocked (and no sweep
    can lock it either: it is never removed)."""
    try:
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held = os.path.samestat(os.stat(staging), os.fstat(fd))  # not swept before the lock
    except (BlockingIOError, FileNotFoundError):  # a sweep holds it, or removed it
        held = False
    except OSError as exc:
        log.warning("cannot lock %s (%s): it is written unlocked", staging, exc)
        os.close(fd)
        return True
    if not held:
        os.close(fd)
        return False
    with _held_lock:
        _held[staging] = fd
    return True


def _release(staging: Path) -> None:
    with _held_lock:
        fd = _held.pop(staging, None)
    if fd is not None:
        os.close(fd)


def _release_gone() -> None:
    """Let go of the staging directories of failed writes (removed by their writer)."""
    with _held_lock:
        gone = [path for path in _held if not os.path.lexists(path)]
    for path in gone:
        _release(path)


def sweep_staging(root: Path) -> list[Path]:
    """Remove what writers that died left directly under root: staging directories no live
    writer holds (a write killed half-way) and versions half removed (prune_derived killed).
    Nothing is done where root cannot be written (a read-only bundle root). Returns what was
    removed."""
    if not os.access(root, os.W_OK):
        return []
    removed = []
    try:
        children = [c for c in root.iterdir() if c.name.startswith((STAGING_PREFIX, REMOVING_PREFIX))]
    except OSError:
        return []
    for child in children:
        half_removed = child.name.startswith(REMOVING_PREFIX)
        fd = None if half_removed else _take_stale(child)
        if fd is None and not half_removed:
            continue  # a live writer's (or not a directory)
        try:
            shutil.rmtree(child, ignore_errors=True)
        finally:
            if fd is not None:
                os.close(fd)  # held until removed: a writer that opened it meanwhile sees it gone
        if not os.path.lexists(child):
            removed.append(child)
    if removed:
        log.info("removed %d directories left by writers that died under %s: %s", len(removed), root,
                 ", ".join(c.name for c in removed))
    return removed


def _take_stale(staging: Path) -> int | None:
    """A descriptor holding `staging`'s lock, None when a live writer holds it, it is no
    directory (a symlink is never followed) or it cannot be locked."""
    try:
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def write_manifest(staging: Path, fields: dict[str, Any], known: dict[str, str] | None = None) -> Manifest:
    """Checksum every file in `staging` and write its manifest.json from `fields`. `known`: the
    checksums of files already hashed (a manifest written a moment ago) or shared by hard link
    with a bundle whose checksums were verified; loading the bundle verifies them all again."""
    known = known or {}
    files = {p.name: known.get(p.name) or sha256_file(p) for p in sorted(staging.iterdir())
             if p.is_file() and p.name != MANIFEST}
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
        raise BundleError(f"{staging}: cannot write manifest, missing {', '.join(missing)}")
    manifest = Manifest.model_validate(
        {"format_version": FORMAT_VERSION, "created_at": utc_now(), **fields, "files": files}
    )
    (staging / MANIFEST).write_text(manifest.model_dump_json(indent=2), encoding="utf-8")
    return manifest


def finalize_bundle(staging: Path, root: Path, version: str) -> Path:
    """Rename a staged bundle (manifest written) to ROOT/VERSION: the commit point."""
    final = Path(root) / validate_version_name(version)
    if final.exists():
        raise BundleError(f"bundle {final} already exists; bundles are immutable, pick another version")
    for p in staging.iterdir():
        _fsync(p)
    os.rename(staging, final)
    _release(staging)
    _fsync(final.parent)
    return final


def share_file(src: Path, dst: Path) -> str:
    """dst as the same file as src (a hard link: no copy, and src can never change through it,
    since bundle files are only ever replaced, never written in place), or a copy where the
    filesystem cannot link (another device, no link support). Returns "link" or "copy"."""
    try:
        os.link(src, dst)
        return "link"
    except OSError:
        shutil.copyfile(src, dst)
        return "copy"


DERIVED_DIR = "bundles"
Place = Literal["root", "state"]


@dataclass(frozen=True)
class StoredBundle:
    manifest: Manifest
    path: Path
    place: Place
    # A label change's version renamed into place but not yet activated (label_ledger): never
    # "the newest bundle"; set aside at the next change or start-up unless it was activated.
    unconfirmed: bool = False
    # A bundle root's bundle whose version the state directory also holds: never served (module doc).
    shadowed: bool = False

    @property
    def version(self) -> str:
        return self.manifest.version


def in_chain_order(bundles: Collection[StoredBundle]) -> list[StoredBundle]:
    """Oldest first by manifest creation time, except that a label change's version never sorts
    before its base or an earlier change of its chain: STEM.labels-N are named in the order they
    were made (derived_version), whatever the clock said when each was written (audit s25 F4: a
    change made with the clock a year ahead outranked every later one as "newest")."""
    def chain(b: StoredBundle) -> tuple[str, int]:
        lineage = b.manifest.lineage
        step = numbered(b.version) if lineage is not None else None
        return (lineage.base, step[1]) if lineage is not None and step is not None else (b.version, 0)

    effective: dict[int, tuple[datetime, str, int]] = {}
    latest: dict[str, datetime] = {}
    for b in sorted(bundles, key=chain):
        base, step = chain(b)
        latest[base] = max(latest.get(base, b.manifest.created), b.manifest.created)
        effective[id(b)] = (latest[base], base, step)
    return sorted(bundles, key=lambda b: (*effective[id(b)], b.version))


class BundleStore:
    """The places bundles are read from: `root` (exported bundles) and, when a state directory
    is given, STATE_DIR/bundles (derived ones, written there by label changes)."""

    def __init__(self, root: str | Path, state_dir: str | Path | None = None,
                 max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> None:
        self.root = Path(root)
        self.max_manifest_bytes = max_manifest_bytes
        self.derived_root = Path(state_dir) / DERIVED_DIR if state_dir is not None else None

    def places(self) -> list[tuple[Place, Path]]:
        found: list[tuple[Place, Path]] = [("root", self.root)]
        if self.derived_root is not None:
            found.append(("state", self.derived_root))
        return found

    def list(self) -> list[StoredBundle]:
        """Every activatable bundle of every place, oldest first."""
        pending = LabelLedger(self.derived_root.parent).unconfirmed() if self.derived_root is not None else None
        found = [StoredBundle(m, path / m.version, place,
                              unconfirmed=place == "state" and pending is not None and pending.version == m.version,
                              shadowed=place == "root" and self._in_state(m.version))
                 for place, path in self.places() for m in list_bundles(path, self.max_manifest_bytes)]
        return in_chain_order(found)

    def _in_state(self, version: str) -> bool:
        return self.derived_root is not None and (self.derived_root / version).is_dir()

    def shadow_message(self, version: str) -> str:
        """What is said of a version both places hold (module doc)."""
        assert self.derived_root is not None
        return (f"bundle {version!r} exists in both places: {self.derived_root.resolve() / version} (state directory, "
                f"a label change's version, the one its record and history name) is the one served; "
                f"{self.root.resolve() / version} (bundle root) is shadowed, never served: rename or remove it")

    def newest_version(self) -> str:
        """The newest bundle of any place, never an unconfirmed or a shadowed one."""
        bundles = [b for b in self.list() if not b.unconfirmed and not b.shadowed]
        if not bundles:
            where = " or ".join(str(path.resolve()) for _, path in self.places())
            raise BundleError(f"no bundle under {where}")
        return bundles[-1].version

    def sweep_staging(self) -> list[Path]:
        """sweep_staging of every place."""
        return [path for _, root in self.places() for path in sweep_staging(root)]

    @property
    def removed_names(self) -> RemovedNames | None:
        """The record of the derived versions' names retention removed (None without a state directory)."""
        return RemovedNames(self.derived_root) if self.derived_root is not None else None

    def derived_version(self, base: str) -> str:
        """The name of the next version derived from `base`: one no place holds nor was ever
        given (removed_names.derived_version). OSError when the record of removed names cannot be read."""
        names = self.removed_names
        return derived_version(base, self.exists, names.highest() if names is not None else {})

    def prune_derived(self, keep: int, protected: Collection[str]) -> list[str]:
        """Remove the oldest derived versions (STATE_DIR/bundles) beyond the newest `keep`, never
        one in `protected`. What each gave out is recorded first, and the records stay bounded
        (one per base, not one per version): its uids in its base's record of removed versions
        (LabelLedger.keep_removed), so an id record lost later is made again with them, and its
        name in RemovedNames, so a version name is never given to other contents (`exists`).
        Then it is renamed out of sight (no listing sees half of one) and deleted: a crash
        between leaves it whole and its name recorded (the next removal takes it), or a
        `.removing-` directory the sweep removes. Versions whose names cannot be recorded are
        not removed; one that cannot be removed is logged and left. Returns the versions removed."""
        if self.derived_root is None:
            return []
        self._fold_markers()
        derived = list_bundles(self.derived_root, self.max_manifest_bytes)  # oldest first
        doomed = [m for m in derived[: max(len(derived) - keep, 0)] if m.version not in protected]
        if not doomed:
            return []
        try:
            self._record_removed(doomed)
        except OSError as exc:
            log.warning("cannot remove derived versions %s: %s", ", ".join(m.version for m in doomed), exc)
            return []
        removed = [m.version for m in doomed if self._remove(m.version)]
        if removed:
            log.info("removed derived versions beyond the newest %d: %s", keep, ", ".join(removed))
        return removed

    def _record_removed(self, doomed: list[Manifest]) -> None:
        """Record the uids (per base, once) and the names of versions about to be removed."""
        assert self.derived_root is not None and self.removed_names is not None
        per_base: dict[str, IdRecord] = {}
        for manifest in doomed:
            record = self._removed_record(self.derived_root / manifest.version, manifest)
            if record is not None:
                kept = per_base.get(record.base)
                per_base[record.base] = record if kept is None else kept.extended(record)
        ledger = LabelLedger(self.derived_root.parent)
        for record in per_base.values():
            ledger.keep_removed(record)
        self.removed_names.add(m.version for m in doomed)

    def _remove(self, version: str) -> bool:
        """Rename `version` out of sight, then delete it; a name RemovedNames cannot record (not
        BASE.labels-N: a bundle written here under a chosen name) keeps an empty file of its name."""
        assert self.derived_root is not None
        hidden = self.derived_root / f"{REMOVING_PREFIX}{version}-{secrets.token_hex(4)}"
        try:
            os.rename(self.derived_root / version, hidden)
            if numbered(version) is None:
                open(self.derived_root / version, "xb").close()
        except OSError as exc:
            log.warning("cannot remove derived version %s: %s", version, exc)
            return False
        shutil.rmtree(hidden, ignore_errors=True)
        return True

    @staticmethod
    def _removed_record(bundle_dir: Path, manifest: Manifest) -> IdRecord | None:
        """removed_version_record of a version about to be removed; None (logged) when its labels
        cannot be read: its name is still recorded, and the record in label_ledger still holds its uids."""
        lineage = manifest.lineage
        try:
            if lineage is None:
                raise ValueError("no lineage: not a label change's version")
            return removed_version_record(bundle_dir, lineage.base, manifest.tree_labels)
        except (OSError, ValueError) as exc:
            log.warning("removing derived version %s: its uids are not kept beside its name: %s", manifest.version, exc)
            return None

    def _fold_markers(self) -> None:
        """Fold the marker files older releases left in place of the versions they removed (one per
        name, for ever) into the records prune_derived keeps, then remove them. Until then, and
        should that fail (logged), they are honoured as they were (`exists`, `lineage_of`)."""
        markers = [path for path in self.removed_derived() if numbered(path.name) is not None]
        if not markers or self.derived_root is None or self.removed_names is None:
            return
        ledger = LabelLedger(self.derived_root.parent)
        try:
            for path in markers:
                record = _marker_record(path)
                if record is not None:
                    ledger.keep_removed(record)
            self.removed_names.add(path.name for path in markers)
            for path in markers:
                path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot fold the files of removed versions in %s into its records: %s", self.derived_root, exc)
            return
        log.info("folded the files of %d removed versions in %s into %s", len(markers), self.derived_root,
                 self.removed_names.path.name)

    def lineage_of(self, base: str) -> list[Path]:
        """The versions derived from `base` in every place, and the records of removed derived
        versions' uids (label_ledger.LabelLedger.rebuilt reads what each gave out): its base's
        (LabelLedger.keep_removed) and the marker files older releases left."""
        derived = [b.path for b in self.list() if b.manifest.lineage is not None and b.manifest.lineage.base == base]
        kept = [] if self.derived_root is None else [LabelLedger(self.derived_root.parent).removed_path(base)]
        return derived + self.removed_derived() + [path for path in kept if path.exists()]

    def removed_derived(self) -> list[Path]:
        """The files left in place of removed derived versions: the marker of a name RemovedNames
        cannot record, and those older releases left for every name (until _fold_markers)."""
        if self.derived_root is None or not self.derived_root.is_dir():
            return []
        return [path for path in self.derived_root.iterdir() if path.is_file() and not path.name.startswith(".")]

    def exists(self, version: str) -> bool:
        """Whether the name is taken in any place (by a bundle, or by a removed derived version: a
        file of its name, or RemovedNames). OSError when the record of removed names cannot be read."""
        return self._taken_in(version) is not None or self._removed(version)

    def _removed(self, version: str) -> bool:
        return self.removed_names is not None and self.removed_names.holds(version)

    def _taken_in(self, version: str) -> tuple[Place, Path] | None:
        return next(((place, path) for place, path in self.places() if (path / version).exists()), None)

    def check_free(self, version: str) -> str:
        """`version`, valid and taken in no place (`exists`); BundleError naming where it is taken.
        A writer giving a bundle a name another place holds would make one name two bundles."""
        validate_version_name(version)
        if self._removed(version):
            raise BundleError(f"bundle version {version!r} was given to a version since removed from the state "
                              "directory (SHORTLIST_STATE_DIR); a version names one bundle: pick another version")
        taken = self._taken_in(version)
        if taken is not None:
            what = "the bundle root" if taken[0] == "root" else "the state directory (SHORTLIST_STATE_DIR)"
            raise BundleError(f"bundle {taken[1] / version} already exists, in {what}; bundles are immutable "
                              "and a version names one bundle: pick another version")
        return version

    def resolve(self, version: str) -> Path:
        """The directory of `version`, from whichever place holds it (both: the state
        directory's, the root's shadowed, logged); BundleError when none does ("no bundle ...")."""
        validate_version_name(version)
        # Directories only: a file of the version's name is a removed version's (prune_derived).
        held = [(place, path) for place, path in self.places() if (path / version).is_dir()]
        if len(held) > 1:
            log.warning("%s", self.shadow_message(version))
            held = [(place, path) for place, path in held if place == "state"]
        if not held:
            where = " or ".join(str(path.resolve()) for _, path in self.places())
            raise BundleError(f"no bundle {version!r} under {where}")
        return resolve_bundle_dir(held[0][1], version)


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _marker_record(path: Path) -> IdRecord | None:
    """The uids a marker file of a removed version holds (older releases wrote them there); None
    when it holds none (empty: older still) or cannot be read (logged)."""
    try:
        data = read_small_file(path, MAX_ID_RECORD_BYTES)
        return decoded_record(data) if data else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("the file of removed version %s holds no uid record: %s", path.name, exc)
        return None
