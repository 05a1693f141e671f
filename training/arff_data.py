"""`shortlist data import-arff`: a multi-label dataset in ARFF (MULAN's or MEKA's layout) as an
XC raw-text dataset that `train` and `eval` read.

Benchmarks such as MULAN's Bibtex and Delicious come as ARFF files whose feature attributes are
named by their words, one row per document, and one binary attribute per label. A document's
text is the names of its features that are present (value other than 0 or missing), in the
file's attribute order; a label's text is its attribute's name with underscores read as spaces
("TAG_web20" -> "TAG web20"). Which attributes are labels: the ones a MULAN XML file lists
(`--labels-xml`), or MEKA's `-C N` in the relation's name (the first N attributes; -N: the last N).
Neither file holds a split: the documents are split at random, seeded (`--test-fraction`).
ARFF is parsed by liac-arff (dense and sparse rows, quoted names); a file it cannot parse is
named with the line it reports.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from service.engine.jsonlines import bounded_lines, not_utf8, os_reason, require_regular
from service.engine.small_files import RefusedFile, read_small_file
from training.files import StagedFiles

_MEKA_LABELS = re.compile(r"(?:^|\s)-C\s+(-?\d+)(?:\s|$)")
_ABSENT = ("0", 0, 0.0, None, "?")
# MULAN's label file names each label once (~50 bytes): 256 MiB is millions of labels.
MAX_LABELS_XML_BYTES = 256 << 20


def label_attributes(attributes: list[str], relation: str, labels_xml: Path | None) -> list[int]:
    """The indices of the label attributes (ValueError naming what is missing or unknown)."""
    if labels_xml is not None:
        names = _mulan_labels(labels_xml)
        index = {name: i for i, name in enumerate(attributes)}
        unknown = [n for n in names if n not in index]
        if unknown:
            raise ValueError(f"{labels_xml}: {len(unknown)} labels are no attribute of the ARFF file, "
                             f"e.g. {unknown[0]!r}")
        return [index[n] for n in names]
    found = _MEKA_LABELS.search(relation)
    if found is None:
        raise ValueError(f"the relation {relation!r} does not say which attributes are labels (MEKA's "
                         f"'-C N'): give MULAN's label file with --labels-xml")
    n = int(found.group(1))
    if n == 0 or abs(n) >= len(attributes):
        raise ValueError(f"relation {relation!r}: -C {n} leaves no label or no feature of {len(attributes)} attributes")
    return list(range(n)) if n > 0 else list(range(len(attributes) + n, len(attributes)))


def _mulan_labels(path: Path) -> list[str]:
    try:
        # A FIFO would hang the read and /dev/zero fill the memory: a regular file, bounded.
        root = ElementTree.fromstring(read_small_file(path, MAX_LABELS_XML_BYTES, follow_symlinks=True))
    except RefusedFile as exc:
        raise ValueError(f"{path}: not a MULAN label file: {str(exc).removeprefix(f'{path}: ')}") from None
    except (OSError, ElementTree.ParseError) as exc:
        raise ValueError(f"{path}: not a MULAN label file: {exc}") from None
    names = [e.get("name") for e in root.iter() if e.tag.rsplit("}", 1)[-1] == "label"]
    if not names or any(not n for n in names):
        raise ValueError(f"{path}: a MULAN label file lists <label name=...> elements: found {len(names)}, "
                         f"{sum(1 for n in names if not n)} without a name")
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: a label is listed twice")
    return names


def read_arff(path: Path) -> dict[str, Any]:
    """liac-arff's dict of `path` (gzip or plain, dense or sparse rows), each row the
    {attribute index: value} of its present values; ValueError naming the file (and the line
    liac-arff reports) otherwise."""
    import arff  # liac-arff, the training extra

    try:
        require_regular(path, "ARFF file")
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="surrogateescape") as f:
            lines = [_utf8_line(path, n, line) for n, line in bounded_lines(f, path)]
        # liac-arff reads sparse rows into dicts only, dense rows into lists only: the first
        # row after @data says which this file has.
        sparse = _first_row(lines).startswith("{")
        data = arff.load(lines, return_type=arff.LOD if sparse else arff.DENSE_GEN)
        rows = data["data"] if sparse else map(dict, map(enumerate, data["data"]))
        data["data"] = _present_values(rows, lines)
        return data
    except (OSError, EOFError, UnicodeDecodeError, arff.ArffException) as exc:
        raise ValueError(f"{path}: {os_reason(exc) if isinstance(exc, OSError) else exc}") from None


def _utf8_line(path: Path, number: int, line: str) -> str:
    if (why := not_utf8(line)) is not None:  # named by line and column, not a decoder buffer's offset
        raise ValueError(f"{path}:{number}: {why}")
    return line


def _present_values(rows: Iterable[dict[int, Any]], lines: list[str]) -> list[dict[int, Any]]:
    """Each row's {attribute index: value} of its present values. Dense rows are decoded as they
    are read here, where liac-arff no longer counts lines ("at line -1"): a row it refuses is
    given its line in the file."""
    import arff

    present: list[dict[int, Any]] = []
    try:
        for row in rows:
            present.append({a: v for a, v in row.items() if v not in _ABSENT})
    except arff.ArffException as exc:
        if exc.line == -1:
            exc.line = _data_line_numbers(lines)[len(present)]
        raise
    return present


def _data_line_numbers(lines: list[str]) -> list[int]:
    """The line numbers (from 1) of the data rows: after @data, neither blank nor a % comment."""
    numbers, after_data = [], False
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if after_data and text and not text.startswith("%"):
            numbers.append(number)
        after_data = after_data or text.lower().startswith("@data")
    return numbers


def _first_row(lines: list[str]) -> str:
    numbers = _data_line_numbers(lines)
    return lines[numbers[0] - 1].strip() if numbers else ""


def _check_label_values(path: Path, attributes: list[tuple[str, Any]], labels: list[int]) -> None:
    """A label attribute is present unless 0 (or ?): numeric, or nominal {0,1} as MULAN and MEKA
    write it. Other nominal values ({no,yes}) would read "no" as present: every document would
    carry the label, exit 0."""
    for a in labels:
        name, kind = attributes[a]
        if isinstance(kind, list) and sorted(map(str, kind)) != ["0", "1"]:
            raise ValueError(f"{path}: label attribute {name!r} is nominal {{{','.join(map(str, kind))}}}: a label's "
                             "values are 0 and 1 (nominal {0,1} or numeric), absent where 0 or ?")


def convert(arff_data: dict[str, Any], labels: list[int]) -> tuple[list[dict], list[dict]]:
    """(documents, label rows) in the raw-text format; documents in the file's order, uid "d<row>"."""
    names = [name for name, _ in arff_data["attributes"]]
    row_of = {attribute: row for row, attribute in enumerate(labels)}
    label_rows = [{"uid": names[a], "title": names[a].replace("_", " "), "content": ""} for a in labels]
    docs = []
    for i, values in enumerate(arff_data["data"]):
        present = sorted(values)
        words = " ".join(names[a] for a in present if a not in row_of)
        targets = [row_of[a] for a in present if a in row_of]
        docs.append({"uid": f"d{i}", "title": words, "content": words, "target_ind": targets,
                     "target_rel": [1.0] * len(targets)})
    return docs, label_rows


def import_arff(path: Path, out: Path, labels_xml: Path | None = None, test_fraction: float = 0.3,
                seed: int = 0) -> dict[str, int]:
    """Write trn.json.gz, tst.json.gz and lbl.json.gz under `out` (all or none); their counts."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"--test-fraction must be in (0, 1), got {test_fraction}")
    data = read_arff(path)
    labels = label_attributes([name for name, _ in data["attributes"]], data["relation"], labels_xml)
    _check_label_values(path, data["attributes"], labels)
    docs, label_rows = convert(data, labels)
    if len(docs) < 2:
        raise ValueError(f"{path}: {len(docs)} documents: nothing to split into trn and tst")
    order = np.random.default_rng(seed).permutation(len(docs))
    n_test = min(max(1, round(test_fraction * len(docs))), len(docs) - 1)
    test = set(order[:n_test].tolist())
    out.mkdir(parents=True, exist_ok=True)
    with StagedFiles(out) as files:
        files.write_gz_lines("lbl.json.gz", map(json.dumps, label_rows))
        files.write_gz_lines("trn.json.gz", (json.dumps(d) for i, d in enumerate(docs) if i not in test))
        files.write_gz_lines("tst.json.gz", (json.dumps(d) for i, d in enumerate(docs) if i in test))
    return {"labels": len(label_rows), "trn": len(docs) - n_test, "tst": n_test}


def run_cli(args: argparse.Namespace) -> int:
    counts = import_arff(args.arff, args.out, args.labels_xml, args.test_fraction, args.seed)
    print(f"{args.out}: {counts['trn']} training and {counts['tst']} test documents, {counts['labels']} labels")
    return 0
