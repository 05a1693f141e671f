"""XC raw-text loading: accepted encodings, and each bad case reported with file:line."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from training.data import data_differences, fingerprint, load_labels, load_split, same_data
from training.synthetic import generate

LABELS = [{"uid": "a", "title": "alpha", "content": "first"}, {"uid": "b", "title": "beta", "content": "second"}]
DOCS = [
    {"uid": "d1", "title": "alpha doc", "content": "x", "target_ind": [0], "target_rel": [1.0]},
    {"uid": "d2", "title": "beta doc", "content": "y", "target_ind": [1, 0], "target_rel": [1.0, 1.0]},
]


def _write(path: Path, rows: list, raw_lines: dict[int, str] | None = None) -> None:
    lines = [json.dumps(r) for r in rows]
    for i, text in (raw_lines or {}).items():
        lines[i] = text
    data = "\n".join(lines) + "\n"
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(data)
    else:
        path.write_text(data, encoding="utf-8")


def _dataset(tmp_path: Path, labels: list | None = None, docs: list | None = None, suffix: str = ".json.gz",
             raw_doc_lines: dict[int, str] | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    _write(tmp_path / f"lbl{suffix}", labels if labels is not None else LABELS)
    _write(tmp_path / f"trn{suffix}", docs if docs is not None else DOCS, raw_doc_lines)
    return tmp_path


@pytest.mark.parametrize("suffix", [".json.gz", ".json", ".jsonl"])
def test_loads_every_encoding(tmp_path: Path, suffix: str) -> None:
    d = _dataset(tmp_path, suffix=suffix)
    labels = load_labels(d)
    assert labels.uids == ["a", "b"] and labels.texts == ["alpha", "beta"]
    split = load_split(d, "trn", "title", len(labels))
    assert split.texts == ["alpha doc", "beta doc"]
    assert split.targets == [[0], [1, 0]]


def test_title_plus_content(tmp_path: Path) -> None:
    d = _dataset(tmp_path)
    assert load_labels(d, "title+content").texts[0] == "alpha\nfirst"
    assert load_split(d, "trn", "title+content", 2).texts[1] == "beta doc\ny"


def test_missing_field_names_file_line_and_field(tmp_path: Path) -> None:
    docs = [DOCS[0], {k: v for k, v in DOCS[1].items() if k != "target_ind"}]
    d = _dataset(tmp_path, docs=docs)
    with pytest.raises(ValueError, match=r"trn\.json\.gz:2: missing field 'target_ind'"):
        load_split(d, "trn", "title", 2)


def test_target_out_of_range(tmp_path: Path) -> None:
    docs = [DOCS[0], {**DOCS[1], "target_ind": [5], "target_rel": [1.0]}]
    d = _dataset(tmp_path, docs=docs)
    with pytest.raises(ValueError, match=r"trn\.json\.gz:2: target_ind 5 out of range \(the label file has 2"):
        load_split(d, "trn", "title", 2)


def test_negative_or_non_integer_target(tmp_path: Path) -> None:
    d = _dataset(tmp_path, docs=[{**DOCS[0], "target_ind": [-1]}])
    with pytest.raises(ValueError, match=r":1: target_ind -1 out of range"):
        load_split(d, "trn", "title", 2)
    d = _dataset(tmp_path, docs=[{**DOCS[0], "target_ind": ["0"]}])
    with pytest.raises(ValueError, match=r":1: target_ind\[0\] must be an integer label row, got a string"):
        load_split(d, "trn", "title", 2)


def test_empty_label_text(tmp_path: Path) -> None:
    d = _dataset(tmp_path, labels=[LABELS[0], {"uid": "b", "title": "  ", "content": ""}])
    with pytest.raises(ValueError, match=r"lbl\.json\.gz:2: empty label text \(label 'b'\)"):
        load_labels(d)


def test_malformed_line(tmp_path: Path) -> None:
    d = _dataset(tmp_path, raw_doc_lines={1: '{"uid": "d2", "title": '})
    with pytest.raises(ValueError, match=r"trn\.json\.gz:2: malformed line, not JSON"):
        load_split(d, "trn", "title", 2)
    d = _dataset(tmp_path, raw_doc_lines={0: "[1, 2]"})
    with pytest.raises(ValueError, match=r"trn\.json\.gz:1: malformed line, expected a JSON object \(a file of "
                       r"rows holds one JSON object a line, JSON Lines, not a JSON array\)"):
        load_split(d, "trn", "title", 2)
    # A JSON array over many lines: its first line is "[", which is said to be the layout's fault.
    (d / "trn.json.gz").unlink()
    (d / "trn.json").write_text("\n[\n" + ",\n".join(json.dumps(r) for r in DOCS) + "\n]\n")
    with pytest.raises(ValueError, match=r"trn\.json:2: malformed line, not JSON \(.*\) \(a file of rows holds "
                       r"one JSON object a line"):
        load_split(d, "trn", "title", 2)
    # Not at the first row: no hint (a row that is a list is only that).
    (d / "trn.json").write_text(json.dumps(DOCS[0]) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"trn\.json:2: malformed line, expected a JSON object$"):
        load_split(d, "trn", "title", 2)


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_labels(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no lbl file"):
        load_labels(tmp_path)


def test_fingerprint_follows_content(tmp_path: Path) -> None:
    a = _dataset(tmp_path / "a")
    b = _dataset(tmp_path / "b", docs=DOCS[:1])
    fa, fb = fingerprint(a, {"trn": 2}), fingerprint(b)
    assert fa["sha256"] != fb["sha256"]
    assert fa["counts"] == {"trn": 2} and set(fa["files"]) == {"lbl.json.gz", "trn.json.gz"}
    # The same rows compressed again at another time (gzip's header holds a time stamp): the same data.
    c = tmp_path / "c"
    shutil.copytree(a, c)
    raw = gzip.decompress((a / "trn.json.gz").read_bytes())
    (c / "trn.json.gz").write_bytes(gzip.compress(raw, mtime=123456789))
    assert (c / "trn.json.gz").read_bytes() != (a / "trn.json.gz").read_bytes()
    assert fingerprint(c)["sha256"] == fa["sha256"]


def test_the_same_rows_in_another_folder_or_uncompressed_are_the_same_data(tmp_path: Path) -> None:
    """--retune and --refit-tree refused a byte-identical copy in a folder of another name, and the
    same rows as .json, as "not the data" ("fingerprints differ", without saying how)."""
    a = _dataset(tmp_path / "a")
    stored = fingerprint(a, {"trn": 2})
    renamed = tmp_path / "renamed"
    shutil.copytree(a, renamed)
    plain = _dataset(tmp_path / "plain", suffix=".json")
    for same in (renamed, plain):
        assert data_differences(same, fingerprint(same, {"trn": 2}), stored) == []
    other = _dataset(tmp_path / "other", docs=DOCS[:1])
    (other / "tst.json").write_text(json.dumps(DOCS[0]) + "\n")
    assert data_differences(other, fingerprint(other, {"trn": 1}), stored) == [
        "trn: other rows", "tst: the checkpoint's data had no such file", "row counts {'trn': 1} against {'trn': 2}"]
    assert data_differences(a, fingerprint(a, {"trn": 2}), fingerprint(other, {"trn": 2})) == [
        "trn: other rows", "tst: no such file in the data, the checkpoint's had one"]


def test_checkpoint_fingerprinted_by_file_bytes_still_matches(tmp_path: Path) -> None:
    a = _dataset(tmp_path / "a")
    stored = fingerprint(a, {"trn": 2}, content=False)
    assert same_data(a, fingerprint(a, {"trn": 2}), stored)
    assert same_data(a, fingerprint(a, {"trn": 2}), fingerprint(a, {"trn": 2}))
    b = _dataset(tmp_path / "b", docs=DOCS[:1])
    assert not same_data(b, fingerprint(b, {"trn": 2}), stored)
    assert not same_data(b, fingerprint(b, {"trn": 2}), fingerprint(a, {"trn": 2}))


def test_generated_data_is_seeded_and_loadable(tmp_path: Path) -> None:
    generate(tmp_path / "x", num_labels=50, train_docs=200, test_docs=40, seed=3)
    generate(tmp_path / "y", num_labels=50, train_docs=200, test_docs=40, seed=3)
    generate(tmp_path / "z", num_labels=50, train_docs=200, test_docs=40, seed=4)
    labels = load_labels(tmp_path / "x")
    trn = load_split(tmp_path / "x", "trn", "title", len(labels))
    tst = load_split(tmp_path / "x", "tst", "title", len(labels))
    assert len(labels) == 50 and len(trn) == 200 and len(tst) == 40
    assert all(1 <= len(t) <= 4 for t in trn.targets)
    assert load_split(tmp_path / "y", "trn").texts == trn.texts
    assert load_split(tmp_path / "z", "trn").texts != trn.texts
    # power law: the most frequent label is far more common than the median one
    counts = sorted((sum(lab in t for t in trn.targets) for lab in range(50)), reverse=True)
    assert counts[0] >= 5 * max(counts[25], 1)


@pytest.mark.parametrize(("line", "reason"), [
    ('{"uid": "d", "title": "t", "target_ind": ' + "[" * 5000 + "]" * 5000 + "}", "depth limit"),
    ('{"uid": "d", "title": "t", "target_ind": [' + "1" * 5000 + "]}", "number"),
    ('{"uid": "d", "title": "t", "target_ind": [0], "target_rel": [NaN]}', "expected a JSON value"),
    ('{"uid": "d", "title": "a \\ud800", "target_ind": [0]}', "surrogate"),
], ids=["nested 5000 deep", "5000-digit integer", "NaN", "lone surrogate"])
def test_lines_json_parsers_disagree_on_are_refused_with_file_and_line(tmp_path: Path, line: str,
                                                                        reason: str) -> None:
    # Python's json module recursed (a RecursionError traceback), refused a 5,000-digit integer
    # without saying where, and took NaN and lone surrogates (unwritable to a UTF-8 bundle).
    d = _dataset(tmp_path, raw_doc_lines={1: line})
    with pytest.raises(ValueError, match=rf"trn\.json\.gz:2: malformed line, not JSON \(.*{reason}"):
        load_split(d, "trn", "title", 2)


# A value of the wrong JSON type is an error naming the file, line and field, never coerced
# (a null uid was the uid "None"; 12 and "12" were one uid), and an empty split is no figure.
WRONG_TYPES = [
    ("a null uid", {"uid": None}, r":2: field 'uid' must be a non-empty string, got null"),
    ("an object uid", {"uid": {"a": 1}}, r":2: field 'uid' must be a non-empty string, got an object"),
    ("a number uid", {"uid": 12}, r":2: field 'uid' must be a non-empty string, got the number 12"),
    ("a blank uid", {"uid": " "}, r":2: field 'uid' must be a non-empty string, got an empty string"),
    ("a float label row", {"target_ind": [1, 0.0]}, r":2: target_ind\[1\] must be an integer label row, got the "
     r"number 0\.0"),
    ("a bool label row", {"target_ind": [True, 0]}, r":2: target_ind\[0\] must be an integer label row, got true"),
    ("a string relevance", {"target_rel": [1.0, "1"]}, r":2: target_rel\[1\] must be a finite number >= 0, got a "
     r"string"),
    ("a negative relevance", {"target_rel": [-1, 1]}, r":2: target_rel\[0\] must be a finite number >= 0"),
    ("a bool relevance", {"target_rel": [1, False]}, r":2: target_rel\[1\] must be a finite number >= 0, got false"),
]


@pytest.mark.parametrize(("what", "change", "message"), WRONG_TYPES, ids=[w[0] for w in WRONG_TYPES])
def test_a_document_field_of_the_wrong_json_type_is_refused_naming_it(tmp_path: Path, what, change, message) -> None:
    d = _dataset(tmp_path, docs=[DOCS[0], {**DOCS[1], **change}])
    with pytest.raises(ValueError, match=r"trn\.json\.gz" + message):
        load_split(d, "trn", "title", 2)


@pytest.mark.parametrize(("what", "labels", "message"), [
    ("a null uid", [LABELS[0], {**LABELS[1], "uid": None}], r"lbl\.json\.gz:2: field 'uid' must be a non-empty string"),
    ("a number uid", [{**LABELS[0], "uid": 7}, LABELS[1]], r"lbl\.json\.gz:1: field 'uid' must be a non-empty string, "
     r"got the number 7"),
    ("a duplicate uid", [LABELS[0], {**LABELS[1], "uid": "a"}], r"lbl\.json\.gz:2: uid 'a' is also the uid of line 1"),
])
def test_a_label_file_uid_that_is_not_a_unique_string_is_refused(tmp_path: Path, what, labels, message) -> None:
    with pytest.raises(ValueError, match=message):
        load_labels(_dataset(tmp_path, labels=labels))


def test_one_training_document_is_refused_naming_the_file(tmp_path: Path) -> None:
    from training.config import TrainConfig
    from training.dataset import TrainingSet

    d = _dataset(tmp_path, docs=DOCS[:1])
    message = f"{d / 'trn.json.gz'}: need at least 2 training documents, found 1"
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainingSet.load(d, TrainConfig.tiny(), "title", np.random.default_rng(0))


def test_an_empty_split_is_refused_not_measured(tmp_path: Path) -> None:
    d = _dataset(tmp_path)
    (d / "trn.json.gz").unlink()
    (d / "trn.jsonl").write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"trn\.jsonl: no documents"):
        load_split(d, "trn", "title", 2)


@pytest.mark.parametrize("suffix", [".json.gz", ".jsonl"])
def test_bytes_that_are_not_utf8_are_named_by_line_and_column(tmp_path: Path, suffix: str) -> None:
    d = _dataset(tmp_path, suffix=suffix)
    raw = b"".join(json.dumps(r).encode() + b"\n" for r in DOCS[:1]) + b'{"uid": "d\xff2", "title": "x"}\n'
    path = d / f"trn{suffix}"
    path.write_bytes(gzip.compress(raw) if suffix.endswith(".gz") else raw)
    with pytest.raises(ValueError, match=rf"trn{suffix.replace('.', '[.]')}:2: malformed line, not UTF-8: byte 0xff "
                       r"at column 11"):
        load_split(d, "trn", "title", 2)


def _damaged_inside(path: Path) -> None:
    """Bytes flipped inside a .gz file's compressed data (not its end): zlib's own error on reading,
    where a truncated file is gzip's EOFError and a wrong checksum its BadGzipFile (an OSError)."""
    original = path.read_bytes()
    for start in range(20, len(original) // 2, 97):  # the first damage zlib itself detects
        raw = bytearray(original)
        for i in range(start, start + 40):
            raw[i] ^= 0x5A
        try:
            zlib.decompress(bytes(raw), wbits=31)
        except zlib.error as exc:
            if "incorrect data check" not in str(exc):  # a checksum error is gzip's OSError, not zlib's
                path.write_bytes(bytes(raw))
                return
    raise AssertionError("no damage zlib detects")


def test_a_gzip_file_damaged_inside_its_data_is_refused_naming_it(tmp_path: Path, capsys) -> None:
    from shortlist.cli import main

    rows = [{**DOCS[i % 2], "uid": f"d{i}", "title": f"doc {i} {i * 7919}"} for i in range(3000)]
    d = _dataset(tmp_path / "data", docs=rows)
    _damaged_inside(d / "trn.json.gz")
    with pytest.raises(ValueError, match=r"trn\.json\.gz: cannot read file: corrupt gzip data after \d+ readable"):
        load_split(d, "trn", "title", 2)
    with pytest.raises(ValueError, match=r"trn\.json\.gz: cannot read file: "):
        fingerprint(d)
    assert main(["data", "aggregate", "--data", str(d), "--out", str(tmp_path / "grouped"), "--group-size", "2",
                 "--grouping", "random"]) == 2
    assert "corrupt gzip data" in capsys.readouterr().err


LABEL_FILES = [
    ("a null uid", b'{"uid": null, "title": "kama"}\n', r":1: field 'uid' must be a non-empty string, got null"),
    ("a number uid", b'{"uid": 5, "title": "kama"}\n', r":1: field 'uid' must be a non-empty string, got the number 5"),
    ("a uid twice", b'{"uid": "n1", "title": "kama"}\n{"uid": "n1", "title": "zani"}\n',
     r":2: uid 'n1' is also the uid of line 1"),
    # checked by the API's model of a new label (the one definition): its words
    ("a number title", b'{"uid": "n1", "title": 7}\n', r":1: title: Input should be a valid string"),
    ("bytes not UTF-8", b'{"uid": "n1", "title": "kama"}\n{"uid": "n2", "title": "\xff"}\n',
     r":2: malformed line, not UTF-8: byte 0xff at column 25"),
    ("no labels", b"\n", r": no labels"),
]


@pytest.mark.parametrize(("what", "content", "message"), LABEL_FILES, ids=[c[0] for c in LABEL_FILES])
def test_labels_add_refuses_a_bad_labels_file_naming_file_line_and_field(bundle_root, tmp_path, capsys, what, content,
                                                                         message) -> None:
    from shortlist.cli import main

    labels = tmp_path / "new.jsonl"
    labels.write_bytes(content)
    assert main(["labels", "add", str(bundle_root / "v1"), "--labels", str(labels), "--out", str(tmp_path)]) == 2
    assert re.search(re.escape(str(labels)) + message, capsys.readouterr().err)
    assert not any(p.is_dir() for p in tmp_path.iterdir())  # no bundle written


def test_eval_of_an_empty_split_fails_instead_of_reporting_zeros(bundle_root, synthetic_data, tmp_path, capsys) -> None:
    from shortlist.cli import main

    data = tmp_path / "data"
    shutil.copytree(synthetic_data, data)
    (data / "tst.json.gz").unlink()
    (data / "tst.jsonl").write_text("\n")
    assert main(["eval", str(bundle_root / "v1"), "--data", str(data)]) == 2
    assert "tst.jsonl: no documents" in capsys.readouterr().err
    assert main(["eval", str(bundle_root / "v1"), "--data", str(synthetic_data), "--limit", "0"]) == 2
    assert "limit must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(("first", "second"), [(".json.gz", ".jsonl"), (".json", ".jsonl"), (".json.gz", ".jsonl.gz")])
def test_a_split_in_two_files_is_refused_naming_both(tmp_path: Path, first: str, second: str) -> None:
    # Which of the two is meant cannot be told: reading either silently trains or measures on
    # data the user may not have picked.
    d = _dataset(tmp_path, suffix=first)
    _write(d / f"trn{second}", DOCS[:1])
    with pytest.raises(ValueError, match=rf": the trn split is in 2 files, trn{re.escape(first)} and "
                                         rf"trn{re.escape(second)}: keep one"):
        load_split(d, "trn", "title", 2)
    with pytest.raises(ValueError, match="the trn split is in 2 files"):
        fingerprint(d)
    _write(d / f"lbl{second}", LABELS)
    with pytest.raises(ValueError, match=rf"the lbl split is in 2 files, lbl{re.escape(first)} and lbl"):
        load_labels(d)
    (d / f"lbl{second}").unlink()
    (d / f"trn{second}").unlink()
    assert len(load_split(d, "trn", "title", 2)) == 2  # one file again: read


def test_a_repeated_label_row_counts_once_in_the_target_matrix(tmp_path: Path) -> None:
    # The real datasets (debian-deps, debian-tags, every trn and tst) hold no document with a
    # repeated label row, but a repeat is dropped rather than refused: it says nothing new, and
    # kept it would weigh 2 in training's target matrix and be a second truth in P@k.
    from training.dataset import target_matrix

    docs = [DOCS[0], {**DOCS[1], "target_ind": [1, 1, 0, 1], "target_rel": [1.0, 0.5, 1.0, 1.0]}]
    split = load_split(_dataset(tmp_path, docs=docs), "trn", "title", 2)
    assert split.targets == [[0], [1, 0]]
    assert target_matrix(split.targets, 2).toarray().tolist() == [[1.0, 0.0], [1.0, 1.0]]


def test_eval_counts_a_repeated_truth_once(bundle_root, synthetic_data, tmp_path, capsys) -> None:
    from shortlist.cli import main

    data = tmp_path / "data"
    shutil.copytree(synthetic_data, data)
    with gzip.open(synthetic_data / "tst.json.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    _write(data / "tst.json.gz", [{**r, "target_ind": r["target_ind"] * 2, "target_rel": r["target_rel"] * 2}
                                  for r in rows])
    results = []
    for folder in (synthetic_data, data):
        assert main(["eval", str(bundle_root / "v1"), "--data", str(folder), "--limit", "100", "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    for name in ("P@1", "P@5", "nDCG@5", "PSP@5", "recall@shortlist"):
        assert results[0][name] == results[1][name], name


def test_eval_without_a_trn_file_measures_all_but_psp(bundle_root, synthetic_data, tmp_path, capsys) -> None:
    from shortlist.cli import main

    data = tmp_path / "data"
    data.mkdir()
    for name in ("tst.json.gz", "lbl.json.gz"):
        shutil.copy(synthetic_data / name, data / name)
    results = []
    for folder in (synthetic_data, data):
        assert main(["eval", str(bundle_root / "v1"), "--data", str(folder), "--limit", "100", "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    with_trn, without = results
    assert without["P@1"] == with_trn["P@1"] and without["nDCG@5"] == with_trn["nDCG@5"]
    assert "PSP@1" in with_trn and not any(name.startswith("PS") for name in without)
    assert "no trn file" in without["psp_not_measured"] and "psp_not_measured" not in with_trn
    assert main(["eval", str(bundle_root / "v1"), "--data", str(data), "--limit", "10"]) == 0
    assert "PSP@k not measured: no trn file in" in capsys.readouterr().out


def _line_of(chars: int, uid: str = "d2") -> str:
    """A document's JSON line of exactly `chars` characters (its content padded)."""
    stem = json.dumps({"uid": uid, "title": "beta doc", "content": "", "target_ind": [1], "target_rel": [1.0]})
    return stem.replace('"content": ""', '"content": "' + "y" * (chars - len(stem)) + '"')


@pytest.mark.parametrize("suffix", [".json.gz", ".jsonl"])
def test_a_line_at_the_limit_is_read_and_one_past_it_is_refused_naming_file_line_and_setting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str) -> None:
    monkeypatch.setenv("SHORTLIST_MAX_LINE_CHARS", "1024")
    at_limit = _dataset(tmp_path / "at", suffix=suffix, raw_doc_lines={1: _line_of(1024)})
    assert len(_line_of(1024)) == 1024
    split = load_split(at_limit, "trn", "title+content", 2)
    assert split.uids == ["d1", "d2"] and split.texts[1].endswith("y" * 900)
    past = _dataset(tmp_path / "past", suffix=suffix, raw_doc_lines={1: _line_of(1025)})
    with pytest.raises(ValueError, match=rf"trn{re.escape(suffix)}:2: line longer than 1024 characters "
                                         r"\(SHORTLIST_MAX_LINE_CHARS\)"):
        load_split(past, "trn", "title", 2)


def test_a_compressed_file_of_one_endless_line_is_refused_before_it_is_read_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gzip bomb (here 64 MiB of zeros, no newline, in a 64 KiB file) is refused at the limit:
    its line is never held whole (at the default limit, 1 GB of zeros was 2.7 GB of memory)."""
    monkeypatch.setenv("SHORTLIST_MAX_LINE_CHARS", "4096")
    d = _dataset(tmp_path)
    with gzip.open(d / "trn.json.gz", "wb", compresslevel=1) as f:
        for _ in range(64):
            f.write(bytes(1 << 20))
    with pytest.raises(ValueError, match=r"trn\.json\.gz:1: line longer than 4096 characters"):
        load_split(d, "trn", "title", 2)


@pytest.mark.parametrize("value", ["1023", "2147483649", "64MiB", "-5"])
@pytest.mark.parametrize("variable", ["SHORTLIST_MAX_LINE_CHARS", "shortlist_max_line_chars"])
def test_the_line_limit_out_of_its_range_is_an_error_naming_the_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, variable: str) -> None:
    # In any case, as `serve` and `labels add` read it (every SHORTLIST_* setting).
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=r"SHORTLIST_MAX_LINE_CHARS=.*expected a whole number of characters "
                                         r"in \[1024, 2147483648\]"):
        load_labels(_dataset(tmp_path))
