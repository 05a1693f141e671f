"""`shortlist labels add|remove BUNDLE ...`: the files it reads, checked line by line before a
change is made (every problem a ValueError naming the file, the line and the field, so a wrong
type is refused rather than stringified: a null uid was added as the label "None"), then the
change made offline by the service's own LabelEditor. It sits beside the API because a row is
checked by the API's own model of a new label (the engine never imports the API)."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict
from pathlib import Path

from pydantic import ValidationError

from service.api.active_state import ActiveVersionFile, StateBusy
from service.api.errors import error_message, field_name
from service.api.schemas import RequestModels
from service.api.settings import load_settings, offline_store
from service.engine.bundle import Bundle
from service.engine.jsonlines import iter_rows, iter_text_lines, row_uid
from service.engine.label_changes import ChangeReport, LabelChange, LabelChangeRejected, LabelEditor, NewLabel
from service.engine.label_ledger import IdRecord, LabelLedger
from service.engine.predictor import Predictor
from service.engine.store import BundleStore


def read_label_file(path: Path, models: RequestModels | None = None) -> tuple[list[NewLabel], list[str]]:
    """Labels to add, one JSON object a line: {"uid", "title", "content"?, "prior"?}; each uid
    once (.gz read as gzip), with where each is ("FILE:LINE"). A row is checked as the API checks
    one of POST /admin/labels' labels (`models`: the request models under the service's settings,
    by default those of this environment's SHORTLIST_* variables, a bad one named as `serve` names
    it, never with the admin token): one definition of what a new label may be."""
    model = (models or RequestModels(load_settings())).new_label
    line_of: dict[str, int] = {}
    labels = []
    for lineno, row in iter_rows(path):
        uid = row_uid(row, path, lineno)
        try:
            label = model.model_validate(row)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = field_name(tuple(err["loc"]) or ("row",))
            raise ValueError(f"{path}:{lineno}: {where}: {error_message(err)}") from None
        if uid in line_of:
            raise ValueError(f"{path}:{lineno}: uid {uid!r} is also the uid of line {line_of[uid]}")
        line_of[uid] = lineno
        labels.append(NewLabel(uid, label.title, label.content, label.prior))  # type: ignore[attr-defined]
    if not labels:
        raise ValueError(f"{path}: no labels")
    return labels, [f"{path}:{line}" for line in line_of.values()]


def read_uids_file(path: Path) -> list[tuple[str, str]]:
    """Uids to retire, one a line, each with where it is ("FILE:LINE"); lines of blanks skipped. A
    line is the uid exactly (less its line end): uids may hold spaces, and a stripped line could
    name, and retire, another label (' L6 ' read as 'L6')."""
    return [(line, f"{path}:{n}") for n, line in iter_text_lines(path, "uids file") if line.strip()]


def _change(args: argparse.Namespace) -> tuple[LabelChange, list[str]]:
    """The change the command asks for, and where each of its labels or uids was given."""
    if args.labels_command == "add":
        labels, where = read_label_file(Path(args.labels))
        return LabelChange(add=labels), where
    uids = [(uid, f"uid argument {i + 1}") for i, uid in enumerate(args.uids)]
    uids += read_uids_file(Path(args.uids_file)) if args.uids_file else []
    return LabelChange(retire=[uid for uid, _ in uids]), [where for _, where in uids]


def _located(exc: LabelChangeRejected, where: list[str]) -> ValueError:
    """The refusal with each problem named where its label or uid was given (the file and line),
    not by its place in the change ("add[3].title", as the HTTP API names it)."""
    problems = []
    for name, message in exc.problems:
        if (m := re.fullmatch(r"(?:add|retire)\[(\d+)\](?:\.(\w+))?", name)) is not None:
            name = where[int(m[1])] + (f": {m[2]}" if m[2] else "")
        problems.append(f"{name}: {message}")
    return ValueError("; ".join(problems))


def run_cli(args: argparse.Namespace) -> int:
    """The derived bundle, written and checked offline: checked in its staging directory, so a
    version the service would refuse is never left under its final name (the default --out is the
    parent's own root, the one `serve` reads)."""
    parent_dir = Path(args.bundle)
    out_root = Path(args.out) if args.out else parent_dir.resolve().parent
    change, where = _change(args)
    # A server's state directory (SHORTLIST_STATE_DIR) lists its versions beside the bundle root's:
    # a name it holds (or a removed version of it kept taken) is not given to another bundle here.
    places = offline_store(out_root)
    state_dir = places.derived_root.parent if places.derived_root is not None else None
    parent = Predictor.load(parent_dir).bundle
    try:
        lineage = parent.manifest.lineage
        version = places.check_free(args.version) if args.version is not None else \
            places.derived_version(lineage.base if lineage else parent.version)
        if state_dir is None:
            report = LabelEditor().derive(parent, change, out_root, version, check=True)
        else:
            report = _derive_recorded(parent, change, out_root, version, state_dir)
    except LabelChangeRejected as exc:
        raise _located(exc, where) from None
    finally:
        parent.close()
    print(json.dumps({**asdict(report), "path": str(out_root / version)}))
    return 0


def _derive_recorded(parent: Bundle, change: LabelChange, out_root: Path, version: str,
                     state_dir: Path) -> ChangeReport:
    """The change with the ids a server sharing `state_dir` would give: under its activation lock,
    past every id the base's record has given out (the server's changes, rolled back or not), and
    recorded there, so that neither side gives an id or a uid to two labels. Not marked
    unconfirmed: an offline version is activated by an operator, never assumed."""
    lineage = parent.manifest.lineage
    base = lineage.base if lineage else parent.version
    ledger, store = LabelLedger(state_dir), BundleStore(parent.path.parent, state_dir)
    try:
        with ActiveVersionFile(state_dir).exclusive("shortlist labels add (offline)"):
            record = ledger.current(base, parent.manifest.tree_labels, parent.labels, lambda: store.lineage_of(base))

            def reserve() -> None:
                ledger.write(IdRecord(base, record.first_id, record.uids + tuple(lab.uid for lab in change.add)))

            return LabelEditor().derive(parent, change, out_root, version, record.given_out_past(len(parent.labels)),
                                        before_commit=reserve, check=True)
    except StateBusy:
        raise ValueError(f"the activation lock of {state_dir} (SHORTLIST_STATE_DIR) is held: a server is activating "
                         "a version or changing labels; try again") from None
