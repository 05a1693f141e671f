"""The files `shortlist labels add` and `remove --uids-file` read, checked line by line before a
change is made: every problem a ValueError naming the file, the line and the field, so a wrong
type is refused rather than stringified (a null uid was added as the label "None")."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from service.engine import label_changes
from service.engine.jsonlines import iter_rows, iter_text_lines, json_kind, row_uid


def check_label_file(path: Path) -> None:
    """Labels to add, one JSON object a line: {"uid", "title", "content"?, "prior"?}; each uid once."""
    line_of: dict[str, int] = {}
    for lineno, row in iter_rows(path):
        uid = row_uid(row, path, lineno)
        _check_fields(row, path, lineno)
        if uid in line_of:
            raise ValueError(f"{path}:{lineno}: uid {uid!r} is also the uid of line {line_of[uid]}")
        line_of[uid] = lineno
    if not line_of:
        raise ValueError(f"{path}: no labels")


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


def check_uids_file(path: Path) -> None:
    """Uids to retire, one a line (blank lines skipped)."""
    for _ in iter_text_lines(path, "uids file"):
        pass


def run_cli(args: argparse.Namespace) -> int:
    """`shortlist labels add|remove`: the files checked, then the change (label_changes.run_cli)."""
    if args.labels_command == "add":
        check_label_file(Path(args.labels))
    elif args.uids_file:
        check_uids_file(Path(args.uids_file))
    return label_changes.run_cli(args)
