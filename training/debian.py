"""Real demo data from the machine's apt package lists: Debian packages -> their debtags.

A Debian or Ubuntu machine (and a Debian-based Docker image that kept its apt lists) has
`/var/lib/apt/lists/*_Packages[.lz4|.xz|.gz]`: one control stanza per package with its short
description and, in Debian's main archive, its debtags (`Tag: game::strategy, use::gameplaying`).
`build_debian_tags` turns them into an XC raw-text dataset like the team's `debian-tags`:
document = package (title = short description, content = long description when the lists
carry one, from the stanza or an `*_i18n_Translation-en` list next to it), labels = tags with at
least `min_tag_count` training packages, label title = the tag made readable
("game::strategy" -> "game strategy"). Split: sha1(package name), 70% trn / 30% tst, fixed.

Every problem with a list is a ValueError naming the file (and line), so the CLI prints it
plainly.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import json
import lzma
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from service.engine.jsonlines import not_utf8

APT_LISTS_DIR = Path("/var/lib/apt/lists")
# Lists are read with bytes that are not UTF-8 kept (as lone surrogates), so iter_stanzas can
# name the line and column of one, not the offset of a decoder's buffer.
_UNDECODED = "surrogateescape"
_COMPRESSIONS = ("", ".lz4", ".xz", ".gz")
# Placeholders and bookkeeping tags in debtags, not properties of a package.
DEFAULT_DROP_TAGS = (r"::TODO$", r"^special::")
TEST_FRACTION_TENTHS = 3  # 30% test


@dataclass
class Package:
    name: str
    short: str
    long: str
    tags: list[str]
    description_md5: str


def _lists(root: Path, kind: str) -> list[Path]:
    """Files `*_<kind>` in any supported compression, one per list (plain text preferred)."""
    if not root.is_dir():
        return []
    chosen: dict[str, Path] = {}
    for ext in _COMPRESSIONS:  # the order is the preference: plain text needs no decompressor
        for path in sorted(root.glob(f"*_{kind}{ext}")):
            base = path.name[: len(path.name) - len(ext)] if ext else path.name
            if path.is_file() and base not in chosen:
                chosen[base] = path
    return [chosen[base] for base in sorted(chosen)]


def find_package_lists(root: str | Path = APT_LISTS_DIR) -> list[Path]:
    """The apt package lists under `root` (`*_Packages`, `.lz4`, `.xz`, `.gz`), sorted by name."""
    return _lists(Path(root), "Packages")


def find_translation_lists(root: str | Path = APT_LISTS_DIR) -> list[Path]:
    """The English long-description lists (`*_i18n_Translation-en`) under `root`, if apt fetched them."""
    return _lists(Path(root), "Translation-en")


def _open_lz4(path: Path) -> TextIO:
    try:
        import lz4.frame  # the `train` extra installs it
    except ImportError:
        tool = shutil.which("lz4cat")
        if tool is None:
            raise ValueError(
                f"{path}: cannot read an .lz4 list: install the `lz4` Python package "
                "(pip install lz4) or the lz4 tool (apt-get install lz4)"
            ) from None
        proc = subprocess.run([tool, str(path)], capture_output=True, check=False)
        if proc.returncode != 0:
            msg = proc.stderr.decode(errors="replace").strip()
            raise ValueError(f"{path}: cannot decompress: {msg}") from None
        return io.StringIO(proc.stdout.decode("utf-8", "surrogateescape"))
    return lz4.frame.open(path, "rt", encoding="utf-8", errors=_UNDECODED)


def open_list(path: str | Path) -> TextIO:
    """An apt list as text, decompressed by its suffix (.lz4, .xz, .gz, .bz2, or plain)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: package list does not exist")
    try:
        if path.suffix == ".lz4":
            return _open_lz4(path)
        if path.suffix == ".xz":
            return lzma.open(path, "rt", encoding="utf-8", errors=_UNDECODED)
        if path.suffix == ".gz":
            return gzip.open(path, "rt", encoding="utf-8", errors=_UNDECODED)
        if path.suffix == ".bz2":
            return bz2.open(path, "rt", encoding="utf-8", errors=_UNDECODED)
        return path.open("r", encoding="utf-8", errors=_UNDECODED)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read package list: {exc}") from None


def iter_stanzas(lines: Iterable[str], source: str = "<text>") -> Iterator[dict[str, str]]:
    """Debian control stanzas (RFC 822 style) from `lines`, one dict at a time.

    Continuation lines (starting with a space or tab) are joined to their field with a newline;
    a line of " ." in a description stands for an empty line, as in the Debian policy.
    """
    fields: dict[str, str] = {}
    key: str | None = None
    for lineno, raw in enumerate(lines, 1):
        line = raw.rstrip("\r\n")
        if (why := not_utf8(line)) is not None:
            raise ValueError(f"{source}:{lineno}: {why}")
        if not line.strip():
            if fields:
                yield fields
            fields, key = {}, None
            continue
        if line[0] in " \t":
            if key is None:
                raise ValueError(f"{source}:{lineno}: continuation line without a field before it")
            cont = line[1:]
            fields[key] += "\n" + ("" if cont.strip() == "." else cont)
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or " " in name:
            raise ValueError(f"{source}:{lineno}: malformed line, expected 'Field: value': {line[:60]!r}")
        key = name
        fields[key] = value.strip()
    if fields:
        yield fields


def _stanzas_of(path: Path) -> Iterator[dict[str, str]]:
    try:
        with open_list(path) as f:
            yield from iter_stanzas(f, str(path))
    except (OSError, EOFError, UnicodeDecodeError, lzma.LZMAError, RuntimeError) as exc:
        # Truncated or corrupt compressed data surfaces as one of these from the decompressors.
        raise ValueError(f"{path}: cannot read package list: {exc}") from None


def parse_tags(value: str) -> list[str]:
    """`Tag:` field -> tags, continuation lines included, order kept, duplicates dropped."""
    tags = (t.strip() for t in value.replace("\n", " ").split(","))
    return list(dict.fromkeys(t for t in tags if t))


def _split_description(text: str) -> tuple[str, str]:
    short, _, rest = text.partition("\n")
    return short.strip(), "\n".join(line.strip() for line in rest.split("\n")).strip()


def read_packages(lists: Sequence[str | Path], translations: Sequence[str | Path] = ()) -> dict[str, Package]:
    """Packages by name from `lists` (the first list naming a package wins, tags are merged)."""
    long_by_md5: dict[str, str] = {}
    for path in translations:
        for stanza in _stanzas_of(Path(path)):
            md5, text = stanza.get("Description-md5"), stanza.get("Description-en")
            if md5 and text:
                long_by_md5.setdefault(md5, _split_description(text)[1])
    packages: dict[str, Package] = {}
    for path in lists:
        for stanza in _stanzas_of(Path(path)):
            name = stanza.get("Package")
            if not name:
                continue  # not a package stanza (a list may carry other kinds)
            tags = parse_tags(stanza.get("Tag", ""))
            if name in packages:
                # The same package in several lists (architectures, suites): same tags normally.
                known = packages[name]
                known.tags.extend(t for t in tags if t not in known.tags)
                continue
            short, long = _split_description(stanza.get("Description", ""))
            md5 = stanza.get("Description-md5", "")
            packages[name] = Package(name, short, long or long_by_md5.get(md5, ""), tags, md5)
    return packages


def tag_title(tag: str) -> str:
    """A readable text for a debtag: 'game::strategy' -> 'game strategy', 'devel::lang:c' -> 'devel lang c'."""
    return re.sub(r"\s+", " ", re.sub(r"[:_\-]+", " ", tag)).strip()


def split_of(name: str, seed: int = 0) -> str:
    """'tst' for 30% of package names, else 'trn'; seed 0 is the team's sha1(name) split."""
    key = name if seed == 0 else f"{seed}:{name}"
    return "tst" if int(hashlib.sha1(key.encode()).hexdigest(), 16) % 10 < TEST_FRACTION_TENTHS else "trn"


def _write_rows(path: Path, rows: Iterable[dict]) -> None:
    # mtime=0: the same lists give byte-identical files, so the training fingerprint is stable.
    with path.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, \
            io.TextIOWrapper(gz, encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def build_debian_tags(
    out_dir: str | Path,
    lists: Sequence[str | Path] | None = None,
    min_tag_count: int = 20,
    seed: int = 0,
    drop_tags: Sequence[str] = DEFAULT_DROP_TAGS,
    translations: Sequence[str | Path] | None = None,
) -> Path:
    """Write trn/tst/lbl `.json.gz` (XC raw-text format) from apt package lists; returns out_dir.

    lists: Packages files (default: `find_package_lists()`); translations: Translation-en files
    (default: those next to the first list). min_tag_count: a tag becomes a label when at least
    this many training packages carry it. drop_tags: regular expressions of tags to ignore.
    seed: salts the name hash of the split (0 = the plain sha1(name) split).
    """
    if min_tag_count < 1:
        raise ValueError(f"min_tag_count must be >= 1, got {min_tag_count}")
    lists = find_package_lists() if lists is None else list(lists)
    if not lists:
        raise ValueError(f"no apt package lists (looked for *_Packages[.lz4|.xz|.gz] in {APT_LISTS_DIR})")
    if translations is None:
        translations = find_translation_lists(Path(lists[0]).parent)
    dropped = [re.compile(p) for p in drop_tags]
    packages = read_packages(lists, translations)

    docs: dict[str, list[Package]] = {"trn": [], "tst": []}
    for name in sorted(packages):
        pkg = packages[name]
        pkg.tags = [t for t in pkg.tags if not any(p.search(t) for p in dropped)]
        if pkg.tags and pkg.short:
            docs[split_of(name, seed)].append(pkg)
    counts = Counter(t for pkg in docs["trn"] for t in pkg.tags)
    labels = sorted(t for t, c in counts.items() if c >= min_tag_count)
    if not labels:
        sources = ", ".join(str(p) for p in lists)
        raise ValueError(
            f"{sources}: no debtag is carried by {min_tag_count} or more training packages "
            f"({len(docs['trn'])} tagged training packages; lists without Tag fields have none)"
        )
    index = {t: i for i, t in enumerate(labels)}

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_rows(out / "lbl.json.gz", ({"uid": t, "title": tag_title(t), "content": ""} for t in labels))
    for split, pkgs in docs.items():
        rows = []
        for pkg in pkgs:
            target = [index[t] for t in pkg.tags if t in index]
            if target:  # a package left with no label teaches and tests nothing
                rows.append({"uid": pkg.name, "title": pkg.short, "content": pkg.long,
                             "target_ind": target, "target_rel": [1.0] * len(target)})
        _write_rows(out / f"{split}.json.gz", rows)
    return out
