"""Manifests on disk: reading one as every bundle file is read, and listing the bundles of a
directory (what GET /admin/bundles, label changes, activation and start-up's "newest" see)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import orjson
from pydantic import ValidationError

from service.engine.schema import MANIFEST, MAX_MANIFEST_BYTES, READABLE_FORMATS, VERSION_RE, BundleError, Manifest
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
    A directory whose manifest is refused is skipped, the reason logged once (_say_unlisted;
    activating it names it)."""
    found: list[Manifest] = []
    root = Path(root)
    if not root.is_dir():
        return found
    root_real = root.resolve()
    refused: dict[str, str] = {}
    seen: dict[str, tuple[_ManifestIdentity, Manifest | str]] = {}
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_dir() or not VERSION_RE.fullmatch(entry.name):
                continue
            child = root / entry.name
            if entry.is_symlink() and child.resolve().parent != root_real:
                continue
            read = _read_listed(root_real, child, max_manifest_bytes, seen)
            if isinstance(read, str):
                refused[entry.name] = read
            elif read.version == entry.name:
                found.append(read)
    with _listed_lock:
        _listed[root_real] = seen
    _say_unlisted(root_real, refused)
    return sorted(found, key=lambda m: (m.created, m.version))


# Root -> {directory name: (its manifest file's identity, the manifest or why it was refused)}, as
# the last listing read them. Every GET /admin/bundles page, label change and activation lists the
# root: parsing every manifest each time took 0.61 s at 1,000 versions (audit s25 F5). A manifest
# is parsed again whenever its identity changes: a file rewritten in place changes its ctime (which
# no call can set back), one renamed or linked in its inode or ctime. Only listings use it: a
# version's load reads its manifest afresh and checks every file against it. Bounded by the
# directories there are (each listing keeps only those it saw).
_ManifestIdentity = tuple[int, ...]
_listed: dict[Path, dict[str, tuple[_ManifestIdentity, Manifest | str]]] = {}
_listed_lock = threading.Lock()


def _read_listed(root: Path, child: Path, max_bytes: int,
                 seen: dict[str, tuple[_ManifestIdentity, Manifest | str]]) -> Manifest | str:
    """`child`'s manifest (or why it is refused), parsed only if its file changed since the last
    listing of `root`; recorded in `seen`."""
    try:
        folder, file = os.stat(child), os.stat(os.path.join(child, MANIFEST))
    except OSError:
        identity = None  # read_manifest says why (missing, unreadable)
    else:
        identity = (max_bytes, folder.st_ino, folder.st_ctime_ns, file.st_dev, file.st_ino, file.st_size,
                    file.st_mtime_ns, file.st_ctime_ns)
        with _listed_lock:
            last = _listed.get(root, {}).get(child.name)
        if last is not None and last[0] == identity:
            seen[child.name] = last
            return last[1]
    try:
        read: Manifest | str = read_manifest(child, max_bytes)
    except BundleError as exc:
        read = str(exc)
    if identity is not None:
        seen[child.name] = (identity, read)
    return read


# Root -> {directory name: why it is not listed} as last logged. Every listing (each GET /admin/bundles,
# label change, activation) finds every refused directory again: a warning each time wrote a line per
# refused directory per listing (50 such directories, 10 listings: 500 lines; audit s25 F3). Bounded by the
# directories there are: a directory gone or listed again is dropped.
_unlisted: dict[Path, dict[str, str]] = {}
_unlisted_lock = threading.Lock()


def _say_unlisted(root: Path, refused: dict[str, str]) -> None:
    """Log each directory of `root` that is not listed once, and again only when its reason changes."""
    with _unlisted_lock:
        said = _unlisted.get(root, {})
        new = {name: why for name, why in refused.items() if said.get(name) != why}
        if refused:
            _unlisted[root] = refused
        else:
            _unlisted.pop(root, None)
    for name, why in sorted(new.items()):
        log.warning("bundle %s not listed: %s", name, why)


def newest_version(root: str | Path, max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> str:
    bundles = list_bundles(root, max_manifest_bytes)
    if not bundles:
        raise BundleError(f"no bundle under {Path(root).resolve()}")
    return bundles[-1].version
