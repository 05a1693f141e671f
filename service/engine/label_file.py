"""`shortlist labels add|remove BUNDLE ...`: the files it reads, checked line by line before a
change is made (every problem a ValueError naming the file, the line and the field, so a wrong
type is refused rather than stringified: a null uid was added as the label "None"), then the
change made offline by the service's own LabelEditor."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from service.engine import schema
from service.engine.jsonlines import iter_rows, iter_text_lines, json_kind, row_uid
from service.engine.label_changes import LabelChange, LabelEditor, NewLabel, derived_version
from service.engine.predictor import Predictor


def read_label_file(path: Path) -> list[NewLabel]:
    """Labels to add, one JSON object a line: {"uid", "title", "content"?, "prior"?}; each uid
    once (.gz read as gzip)."""
    line_of: dict[str, int] = {}
    labels = []
    for lineno, row in iter_rows(path):
        uid = row_uid(row, path, lineno)
        _check_fields(row, path, lineno)
        if uid in line_of:
            raise ValueError(f"{path}:{lineno}: uid {uid!r} is also the uid of line {line_of[uid]}")
        line_of[uid] = lineno
        prior = row.get("prior")
        labels.append(NewLabel(uid, row["title"], row.get("content"), None if prior is None else float(prior)))
    if not labels:
        raise ValueError(f"{path}: no labels")
    return labels


def _check_fields(row: dict[str, Any], path: Path, lineno: int) -> None:
    if "title" not in row:
        raise ValueError(f"{path}:{lineno}: missing field 'title'")
    for name in ("title", "content"):
        value = row.get(name)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{path}:{lineno}: field {name!r} must be a string, got {json_kind(value)}")
    if row["title"] is None:
        raise ValueError(f"{path}:{lineno}: field 'title' must be a string, got null")
    prior = row.get("prior")
    if prior is not None and (isinstance(prior, bool) or not isinstance(prior, int | float) or not 0 <= prior <= 1):
        raise ValueError(f"{path}:{lineno}: prior must be a number in [0, 1], got {json_kind(prior)}")


def read_uids_file(path: Path) -> list[str]:
    """Uids to retire, one a line (blank lines skipped)."""
    return [line.strip() for _, line in iter_text_lines(path, "uids file") if line.strip()]


def run_cli(args: argparse.Namespace) -> int:
    """The derived bundle, written and checked offline."""
    parent_dir = Path(args.bundle)
    out_root = Path(args.out) if args.out else parent_dir.resolve().parent
    if args.labels_command == "add":
        change = LabelChange(add=read_label_file(Path(args.labels)))
    else:
        change = LabelChange(retire=list(args.uids) + (read_uids_file(Path(args.uids_file)) if args.uids_file else []))
    parent = Predictor.load(parent_dir).bundle
    try:
        lineage = parent.manifest.lineage
        version = args.version or derived_version(lineage.base if lineage else parent.version,
                                                  lambda v: (out_root / v).exists())
        report = LabelEditor().derive(parent, change, out_root, schema.validate_version_name(version))
    finally:
        parent.close()
    Predictor.load(out_root / version).bundle.close()  # what was written passes the checks the service runs
    print(json.dumps({**asdict(report), "path": str(out_root / version)}))
    return 0
