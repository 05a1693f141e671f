"""Grouped ("aggregated label") datasets: labels known per group of documents, not per document.

A grouped dataset folder holds, beside the usual `lbl` (and optionally an ordinary `tst` to
measure on), in any encoding the raw-text format accepts (`.json.gz`, `.json`, `.jsonl`):
  trn:    documents {"uid", "title", "content", "group"}: the group the document belongs to
          (a string or an integer); no per-document labels
  groups: {"uid", "target_ind"}: each group's labels (label rows, as in `target_ind`)
Every document belongs to one group listed in `groups`, and every group has a member.
Problems are ValueErrors naming the file and line, like the raw-text reader's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from service.engine.jsonlines import json_kind, row_uid
from training import data as xc_data


@dataclass
class GroupedSplit:
    uids: list[str]
    texts: list[str]
    group_of: np.ndarray  # int64 [N]: each document's group row
    group_uids: list[str]
    group_targets: list[list[int]]
    groups_file: str = "groups"  # where the groups were read: named by refusals of the data

    def __len__(self) -> int:
        return len(self.uids)

    def members(self) -> sp.csr_matrix:
        """Group x document membership, binary [G, N]."""
        n = len(self.uids)
        return sp.csr_matrix((np.ones(n, np.float32), (self.group_of, np.arange(n))), shape=(len(self.group_uids), n))

    def group_labels(self, num_labels: int) -> sp.csr_matrix:
        """Group x label, binary [G, L]."""
        from training.dataset import target_matrix

        return target_matrix(self.group_targets, num_labels)


def load_grouped(data_dir: str | Path, text_field: xc_data.TextField, num_labels: int) -> GroupedSplit:
    """The training documents of a grouped dataset with their groups' labels, checked."""
    groups_path = xc_data.find_split_file(data_dir, "groups")
    if groups_path is None:
        raise FileNotFoundError(f"{data_dir}: no groups file (groups.json.gz, .json or .jsonl): not grouped data")
    group_uids, group_targets, group_lines = _load_groups(groups_path, num_labels)
    row_of = {uid: row for row, uid in enumerate(group_uids)}
    path = xc_data.find_split_file(data_dir, "trn")
    if path is None:
        raise FileNotFoundError(f"{data_dir}: no trn file")
    uids: list[str] = []
    texts: list[str] = []
    group_of: list[int] = []
    for lineno, row in xc_data.iter_rows(path):
        uid = row_uid(row, path, lineno)
        if "group" not in row:
            raise ValueError(f"{path}:{lineno}: missing field 'group' (grouped data names each document's group)")
        group = _group_uid(row["group"], path, lineno, "group")
        if group not in row_of:
            raise ValueError(f"{path}:{lineno}: group {group!r} is not in {groups_path.name}")
        uids.append(uid)
        texts.append(xc_data.row_text(row, text_field, path, lineno))
        group_of.append(row_of[str(group)])
    counts = np.bincount(np.asarray(group_of, dtype=np.int64), minlength=len(group_uids))
    if not uids:
        raise ValueError(f"{path}: no documents")
    empty = np.flatnonzero(counts == 0)
    if len(empty):
        g = int(empty[0])
        raise ValueError(f"{groups_path}:{group_lines[g]}: group {group_uids[g]!r} has no document in {path.name}")
    return GroupedSplit(uids, texts, np.asarray(group_of, dtype=np.int64), group_uids, group_targets, str(groups_path))


def _group_uid(value: object, path: Path, lineno: int, name: str) -> str:
    """A group's id as the documents and the groups file both name it: a non-empty string or an
    integer (1 and "1" are the same group); anything else is an error, not stringified."""
    if isinstance(value, bool) or not isinstance(value, str | int) or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"{path}:{lineno}: field {name!r} must be a non-empty string or an integer, "
                         f"got {json_kind(value)}")
    return str(value)


def _load_groups(path: Path, num_labels: int) -> tuple[list[str], list[list[int]], list[int]]:
    uids: list[str] = []
    targets: list[list[int]] = []
    lines: list[int] = []
    seen: set[str] = set()
    for lineno, row in xc_data.iter_rows(path):
        if "uid" not in row:
            raise ValueError(f"{path}:{lineno}: missing field 'uid'")
        uid = _group_uid(row["uid"], path, lineno, "uid")
        if uid in seen:
            raise ValueError(f"{path}:{lineno}: group {uid!r} listed twice")
        targets.append(xc_data.row_targets(row, path, lineno, num_labels))
        seen.add(uid)
        uids.append(uid)
        lines.append(lineno)
    if not uids:
        raise ValueError(f"{path}: no groups")
    if not any(targets):  # as ordinary data's "no training document has a label": nothing to impute
        raise ValueError(f"{path}: no group has a label (target_ind is empty in all {len(uids)})")
    return uids, targets, lines
