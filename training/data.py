"""Loading Extreme Classification Repository raw-text datasets (the "LF-*" format).

A dataset folder holds `trn`, `tst` (optional) and `lbl`, each as `.json.gz`, `.json` or
`.jsonl`: one JSON object a line. Documents carry uid, title, content, target_ind,
target_rel; line i of lbl (uid, title, content) is label i.

Every problem is a ValueError naming the file and line, so `shortlist train` can print
it plainly instead of a traceback from deep inside.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import numpy as np

from service.engine.jsonlines import iter_rows, json_kind, os_reason, row_uid
from service.engine.schema import TextField

SPLIT_SUFFIXES = (".json.gz", ".json", ".jsonl", ".jsonl.gz")


@dataclass
class LabelSet:
    uids: list[str]
    titles: list[str]
    texts: list[str]

    def __len__(self) -> int:
        return len(self.uids)


@dataclass
class Split:
    uids: list[str]
    texts: list[str]
    targets: list[list[int]]
    # Per target a weight in (0, 1] (None: every target 1): how sure a label is, as imputed from
    # group labels (training/aggregated.py); Module III and the centroids weigh positives by it.
    weights: list[list[float]] | None = None

    def __len__(self) -> int:
        return len(self.uids)

    def subset(self, rows: list[int]) -> Split:
        return Split(
            [self.uids[i] for i in rows], [self.texts[i] for i in rows], [self.targets[i] for i in rows],
            None if self.weights is None else [self.weights[i] for i in rows],
        )


def own_label_ids(doc_uids: Sequence[str], label_uids: Sequence[str]) -> np.ndarray:
    """Per document, the id of the label with the document's uid, -1 when none.

    Where documents are labels too (a package among the packages others depend on), a
    document's own label is never its target; the Extreme Classification Repository ships these
    pairs as filter_labels files for its LF-* datasets and scores predictions without them.
    """
    index = {uid: i for i, uid in enumerate(label_uids)}
    return np.array([index.get(uid, -1) for uid in doc_uids], dtype=np.int64)


def find_split_file(data_dir: str | Path, split: str) -> Path | None:
    """The file holding `split` (trn, tst, lbl) in any accepted encoding, or None; two files of one
    split (tst.json and tst.jsonl) are refused: which one is meant cannot be told, and reading
    either silently would train or measure on the data the user did not pick."""
    # Anything there but a folder: a FIFO or a device is then refused by name when read, not "missing".
    found = [path for suffix in SPLIT_SUFFIXES
             if (path := Path(data_dir) / f"{split}{suffix}").exists() and not path.is_dir()]
    if len(found) > 1:
        names = " and ".join(p.name for p in found)
        raise ValueError(f"{data_dir}: the {split} split is in {len(found)} files, {names}: keep one")
    return found[0] if found else None


def _require_split_file(data_dir: str | Path, split: str) -> Path:
    path = find_split_file(data_dir, split)
    if path is None:
        if Path(data_dir).exists() and not Path(data_dir).is_dir():
            # errno and filename: the CLI names the flag that gave the path (--data).
            raise NotADirectoryError(errno.ENOTDIR, "not a directory (a dataset folder is expected)", str(data_dir))
        if not Path(data_dir).is_dir():
            raise FileNotFoundError(f"{data_dir}: dataset folder does not exist")
        names = ", ".join(f"{split}{s}" for s in SPLIT_SUFFIXES)
        raise FileNotFoundError(f"{data_dir}: no {split} file (looked for {names})")
    return path


def row_targets(row: dict[str, Any], path: Path, lineno: int, num_labels: int | None) -> list[int]:
    """target_ind: label rows (integers in range; duplicates dropped, as a hit must count once in
    P@k), and target_rel, when present, a non-negative number for each: checked, never used (every
    listed label is a positive of weight 1 and a truth of eval, whatever its relevance: README)."""
    if "target_ind" not in row:
        raise ValueError(f"{path}:{lineno}: missing field 'target_ind'")
    target = row["target_ind"]
    if not isinstance(target, list):
        raise ValueError(f"{path}:{lineno}: target_ind must be a list of label rows, got {json_kind(target)}")
    for i, t in enumerate(target):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"{path}:{lineno}: target_ind[{i}] must be an integer label row, got {json_kind(t)}")
        if t < 0 or (num_labels is not None and t >= num_labels):
            raise ValueError(
                f"{path}:{lineno}: target_ind {t} out of range (the label file has {num_labels} labels)"
            )
    rel = row.get("target_rel")
    if rel is not None:
        if not isinstance(rel, list) or len(rel) != len(target):
            raise ValueError(f"{path}:{lineno}: target_rel must be a list as long as target_ind")
        for i, r in enumerate(rel):
            if isinstance(r, bool) or not isinstance(r, int | float) or not 0 <= r < math.inf:
                raise ValueError(f"{path}:{lineno}: target_rel[{i}] must be a finite number >= 0, got {json_kind(r)}")
    return list(dict.fromkeys(target))


def row_text(row: dict[str, Any], text_field: TextField, path: Path, lineno: int) -> str:
    for name in ("title", "content") if text_field == "title+content" else ("title",):
        if name not in row:
            raise ValueError(f"{path}:{lineno}: missing field {name!r}")
        if not isinstance(row[name], str):
            raise ValueError(f"{path}:{lineno}: field {name!r} must be a string")
    if text_field == "title+content":
        return f"{row['title']}\n{row['content']}".strip()
    return row["title"].strip()


def _check_text_field(text_field: str) -> None:
    if text_field not in get_args(TextField):
        raise ValueError(f"text_field must be 'title' or 'title+content', got {text_field!r}")


def load_labels(data_dir: str | Path, text_field: TextField = "title") -> LabelSet:
    """The label table: line i of lbl is label i; an empty label text is an error."""
    _check_text_field(text_field)
    path = _require_split_file(data_dir, "lbl")
    uids: list[str] = []
    titles: list[str] = []
    texts: list[str] = []
    line_of: dict[str, int] = {}
    for lineno, row in iter_rows(path):
        uid = row_uid(row, path, lineno)
        text = row_text(row, text_field, path, lineno)
        if not text:
            raise ValueError(f"{path}:{lineno}: empty label text (label {uid!r})")
        if uid in line_of:
            # A label is found by its uid (exclude, the own-label filter, label changes).
            raise ValueError(f"{path}:{lineno}: uid {uid!r} is also the uid of line {line_of[uid]}: label uids "
                             "must be unique")
        line_of[uid] = lineno
        uids.append(uid)
        titles.append(row["title"].strip())
        texts.append(text)
    if not uids:
        raise ValueError(f"{path}: no labels")
    return LabelSet(uids, titles, texts)


def load_split(
    data_dir: str | Path, split: str, text_field: TextField = "title", num_labels: int | None = None
) -> Split:
    """Documents of `split` (trn or tst) with target label rows checked against num_labels."""
    _check_text_field(text_field)
    path = _require_split_file(data_dir, split)
    uids: list[str] = []
    texts: list[str] = []
    targets: list[list[int]] = []
    for lineno, row in iter_rows(path):
        uid = row_uid(row, path, lineno)
        targets.append(row_targets(row, path, lineno, num_labels))
        texts.append(row_text(row, text_field, path, lineno))
        uids.append(uid)
    if not uids:
        # An empty split would train on nothing, or evaluate to 0.00 as if measured.
        raise ValueError(f"{path}: no documents")
    return Split(uids, texts, targets)


def _sha256(path: Path, content: bool = True) -> str:
    """sha256 of a file's content: a `.gz` file's decompressed bytes, so that compressing the same
    rows again (gzip's header holds a time stamp and a name) names the same data."""
    h = hashlib.sha256()
    try:
        with (gzip.open if content and path.name.endswith(".gz") else open)(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"{path}: cannot read file: {os_reason(exc)}") from None
    return h.hexdigest()


def fingerprint(data_dir: str | Path, counts: dict[str, int] | None = None, content: bool = True) -> dict[str, Any]:
    """sha256 of each dataset file's content plus row counts, so a checkpoint names the data it
    saw. `content=False` hashes the files' bytes, as checkpoints written before 2026-11-27 did."""
    files = {}
    for split in ("trn", "tst", "lbl", "groups"):
        path = find_split_file(data_dir, split)
        if path is not None:
            files[path.name] = _sha256(path, content)
    combined = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return {
        "dataset": str(Path(data_dir).resolve().name),
        "sha256": combined,
        "files": files,
        "counts": dict(counts or {}),
        **({"hashed": "content"} if content else {}),
    }


def same_data(data_dir: str | Path, current: dict[str, Any], stored: dict[str, Any]) -> bool:
    """Whether `stored` (a checkpoint's fingerprint) names the data whose fingerprint is `current`."""
    return not data_differences(data_dir, current, stored)


def data_differences(data_dir: str | Path, current: dict[str, Any], stored: dict[str, Any]) -> list[str]:
    """How the data whose fingerprint is `current` differs from what `stored` (a checkpoint's
    fingerprint) names: each split whose rows differ or that one side lacks, and the row counts.
    Compared split by split on content: the same rows in a folder of another name, or as `.json`
    where they were `.json.gz`, are the same data (a checkpoint fingerprinted by file bytes, before
    2026-11-27, is compared on bytes)."""
    if "hashed" not in stored:
        current = fingerprint(data_dir, current.get("counts"), content=False)
    ours, theirs = _by_split(current["files"]), _by_split(stored["files"])
    out = []
    for split in sorted(set(ours) | set(theirs)):
        if split not in ours:
            out.append(f"{split}: no such file in the data, the checkpoint's had one")
        elif split not in theirs:
            out.append(f"{split}: the checkpoint's data had no such file")
        elif ours[split] != theirs[split]:
            out.append(f"{split}: other rows")
    if current.get("counts") != stored.get("counts"):
        out.append(f"row counts {current.get('counts')} against {stored.get('counts')}")
    return out


def _by_split(files: dict[str, str]) -> dict[str, str]:
    """A fingerprint's file hashes by split ("trn.json.gz" -> "trn")."""
    return {name.split(".", 1)[0]: sha for name, sha in files.items()}
