"""Bundles on disk: reading manifests, listing and resolving versions, and writing a bundle
through a staging directory renamed into place (so a crash never leaves a half bundle under
its final name).

Bundles live in two places (`BundleStore`): the bundle root (trained and exported; it may be
read-only, as a container mounts it) and, with a state directory, STATE_DIR/bundles (bundles
derived from another by label changes, service.engine.label_changes). A version names one
bundle in one place: a name found in both is refused, never guessed.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import ValidationError

from service.engine.label_ledger import LabelLedger
from service.engine.schema import (
    FORMAT_VERSION,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    READABLE_FORMATS,
    REQUIRED_FILES,
    VERSION_RE,
    BundleError,
    Manifest,
    sha256_file,
    validate_version_name,
)
from service.engine.small_files import RefusedFile, bundle_file, read_small_file

log = logging.getLogger("shortlist.store")


def read_manifest(bundle_dir: str | Path, max_bytes: int = MAX_MANIFEST_BYTES) -> Manifest:
    """The manifest of the bundle at `bundle_dir`, read as every bundle file is checked (a regular
    file of the bundle: no FIFO, device or symlink out of it) and only up to `max_bytes` (default
    MAX_MANIFEST_BYTES; the service's SHORTLIST_MAX_MANIFEST_BYTES); BundleError naming it otherwise."""
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST
    try:
        raw = orjson.loads(read_small_file(bundle_file(bundle_dir, MANIFEST), max_bytes))
    except FileNotFoundError as exc:
        raise BundleError(f"{path}: missing manifest") from exc
    except RefusedFile as exc:
        raise BundleError(str(exc)) from exc  # names the file and why
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path}: unreadable manifest: {exc}") from exc
    if isinstance(raw, dict) and raw.get("format_version") not in READABLE_FORMATS:
        readable = ", ".join(map(str, READABLE_FORMATS))
        raise BundleError(f"{path}: bundle format {raw.get('format_version')!r}, this engine reads {readable}")
    try:
        return Manifest.model_validate(raw, strict=True)  # values never coerced, as in every bundle file
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'manifest'}: {e['msg']}" for e in exc.errors())
        raise BundleError(f"{path}: invalid manifest: {problems}") from exc


def list_bundles(root: str | Path, max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> list[Manifest]:
    """Manifests of every bundle that could be activated: a directory directly under root (not a
    symlink leading outside it, as activation refuses), named as its manifest's version; oldest first.
    A directory whose manifest is refused is skipped, the reason logged (activating it names it)."""
    found: list[Manifest] = []
    root = Path(root)
    if not root.is_dir():
        return found
    root_real = root.resolve()
    for child in root.iterdir():
        if child.name.startswith(".") or not child.is_dir() or not VERSION_RE.fullmatch(child.name):
            continue
        if child.resolve().parent != root_real:
            continue
        try:
            manifest = read_manifest(child, max_manifest_bytes)
        except BundleError as exc:
            log.warning("bundle %s not listed: %s", child.name, exc)
            continue
        if manifest.version == child.name:
            found.append(manifest)
    return sorted(found, key=lambda m: (m.created, m.version))


def newest_version(root: str | Path, max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> str:
    bundles = list_bundles(root, max_manifest_bytes)
    if not bundles:
        raise BundleError(f"no bundle under {Path(root).resolve()}")
    return bundles[-1].version


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


def staging_dir(root: Path, version: str) -> Path:
    """A fresh hidden directory under root to write bundle `version` into."""
    validate_version_name(version)
    root.mkdir(parents=True, exist_ok=True)
    if (root / version).exists():
        raise BundleError(f"bundle {root / version} already exists; bundles are immutable, pick another version")
    staging = root / f".staging-{version}-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    return staging


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

    @property
    def version(self) -> str:
        return self.manifest.version


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
                              unconfirmed=place == "state" and pending is not None and pending.version == m.version)
                 for place, path in self.places() for m in list_bundles(path, self.max_manifest_bytes)]
        return sorted(found, key=lambda b: (b.manifest.created, b.version))

    def newest_version(self) -> str:
        """The newest bundle of any place, never an unconfirmed one."""
        bundles = [b for b in self.list() if not b.unconfirmed]
        if not bundles:
            where = " or ".join(str(path.resolve()) for _, path in self.places())
            raise BundleError(f"no bundle under {where}")
        return bundles[-1].version

    def exists(self, version: str) -> bool:
        return any((path / version).exists() for _, path in self.places())

    def resolve(self, version: str) -> Path:
        """The directory of `version`, from whichever place holds it; BundleError when none
        does ("no bundle ...") or both do."""
        validate_version_name(version)
        held = [(place, path) for place, path in self.places() if (path / version).exists()]
        if len(held) > 1:
            where = " and ".join(f"{path.resolve() / version} ({place})" for place, path in held)
            raise BundleError(f"bundle {version!r} exists twice: {where}; remove or rename one")
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
