"""`shortlist data import-arff`: MULAN's and MEKA's ARFF layouts as XC raw-text datasets that
`train` and `eval` read; bad files named with the reason (and line), exit 2."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from training.arff_data import import_arff
from training.data import load_labels, load_split

# Sparse rows; a quoted name with a space; labels last (MULAN: named by the XML file).
MULAN_ARFF = """@relation tiny_mulan

@attribute network {0,1}
@attribute 'traffic monitor' {0,1}
@attribute kernel numeric
@attribute TAG_net {0,1}
@attribute TAG_sys_admin {0,1}

@data
{0 1,1 1,3 1}
{2 0.5,3 0,4 1}
{0 1,2 2,3 1,4 1}
{1 1}
"""
MULAN_XML = """<?xml version="1.0" encoding="utf-8"?>
<labels xmlns="http://mulan.sourceforge.net/labels">
<label name="TAG_net"></label>
<label name="TAG_sys_admin"></label>
</labels>
"""
# Dense rows, labels first, as MEKA's relation name says (-C 2).
MEKA_ARFF = """@relation 'tiny: -C 2'
@attribute sport {0,1}
@attribute music {0,1}
@attribute goal numeric
@attribute guitar numeric
@data
1,0,3,0
0,1,0,1
1,1,?,2
"""


def _rows(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8", "surrogateescape"))  # "\udce9": the byte 0xe9, not UTF-8
    return path


def test_mulan_layout_becomes_documents_of_their_present_words_and_labels_of_their_names(tmp_path):
    arff = _write(tmp_path, "tiny.arff", MULAN_ARFF)
    counts = import_arff(arff, tmp_path / "out", _write(tmp_path, "tiny.xml", MULAN_XML), test_fraction=0.25)
    assert counts == {"labels": 2, "trn": 3, "tst": 1}
    labels = _rows(tmp_path / "out" / "lbl.json.gz")
    assert [(r["uid"], r["title"]) for r in labels] == [("TAG_net", "TAG net"), ("TAG_sys_admin", "TAG sys admin")]
    docs = {r["uid"]: r for r in _rows(tmp_path / "out" / "trn.json.gz") + _rows(tmp_path / "out" / "tst.json.gz")}
    assert (docs["d0"]["title"], docs["d0"]["target_ind"]) == ("network traffic monitor", [0])
    assert (docs["d1"]["title"], docs["d1"]["target_ind"]) == ("kernel", [1])  # a 0 value is absent
    assert (docs["d2"]["title"], docs["d2"]["target_ind"]) == ("network kernel", [0, 1])
    assert docs["d3"]["target_ind"] == [] and docs["d3"]["target_rel"] == []
    # What train and eval read: the format's own loaders take it.
    assert load_labels(tmp_path / "out").uids == ["TAG_net", "TAG_sys_admin"]
    assert len(load_split(tmp_path / "out", "trn", num_labels=2)) == 3


def test_meka_layout_labels_come_from_the_relation_first_or_last(tmp_path):
    import_arff(_write(tmp_path, "first.arff", MEKA_ARFF), tmp_path / "first", test_fraction=0.5)
    docs = {r["uid"]: r for r in _rows(tmp_path / "first" / "trn.json.gz") + _rows(tmp_path / "first" / "tst.json.gz")}
    assert [(docs[f"d{i}"]["title"], docs[f"d{i}"]["target_ind"]) for i in range(3)] == [
        ("goal", [0]), ("guitar", [1]), ("guitar", [0, 1])]  # "?" is missing: absent
    last = MEKA_ARFF.replace("-C 2", "-C -2")
    import_arff(_write(tmp_path, "last.arff", last), tmp_path / "last", test_fraction=0.5)
    assert [r["uid"] for r in _rows(tmp_path / "last" / "lbl.json.gz")] == ["goal", "guitar"]


def test_the_split_is_seeded_and_a_gzip_file_reads_as_the_plain_one(tmp_path):
    many = MULAN_ARFF + "".join("{0 1,3 1}\n" for _ in range(40))
    gz = tmp_path / "many.arff.gz"
    gz.write_bytes(gzip.compress(many.encode()))
    xml = _write(tmp_path, "tiny.xml", MULAN_XML)
    splits = []
    for name, path, seed in (("a", _write(tmp_path, "many.arff", many), 3), ("b", gz, 3), ("c", gz, 4)):
        import_arff(path, tmp_path / name, xml, test_fraction=0.3, seed=seed)
        splits.append([r["uid"] for r in _rows(tmp_path / name / "tst.json.gz")])
    assert splits[0] == splits[1] != splits[2] and len(splits[0]) == round(0.3 * 44)
    # Near the edges every split keeps at least one document.
    for fraction, test_docs in ((0.001, 1), (0.999, 43)):
        assert import_arff(gz, tmp_path / f"f{fraction}", xml, test_fraction=fraction)["tst"] == test_docs


@pytest.mark.parametrize(("arff", "xml", "extra", "message"), [
    (MEKA_ARFF.replace(": -C 2", ""), None, [], "give MULAN's label file with --labels-xml"),
    (MEKA_ARFF.replace("-C 2", "-C 4"), None, [], "-C 4 leaves no label or no feature"),
    # Dense rows were named "at line -1", bytes not UTF-8 by a decoder buffer's position.
    (MEKA_ARFF.replace("0,1,0,1", "0,1,0"), None, [], "Bad @DATA instance format in line 8: 0,1,0"),
    (MEKA_ARFF.replace("0,1,0,1", "0,1,x,1"), None, [], "Invalid numerical value, at line 8"),
    (MEKA_ARFF.replace("guitar", "guit\udce9r"), None, [], "x.arff:5: not UTF-8: byte 0xe9 at column 16"),
    # "no" is not 0: read as present, every document carried the label (exit 0).
    (MEKA_ARFF.replace("sport {0,1}", "sport {no,yes}").replace("\n1,", "\nyes,").replace("\n0,", "\nno,"), None,
     [], "label attribute 'sport' is nominal {no,yes}: a label's values are 0 and 1"),
    (MULAN_ARFF, MULAN_XML.replace("TAG_net", "TAG_other"), [], "1 labels are no attribute of the ARFF file"),
    (MULAN_ARFF, "<labels><label/></labels>", [], "1 without a name"),
    (MULAN_ARFF, "<labels>", [], "not a MULAN label file"),
    (MULAN_ARFF.replace("{2 0.5,3 0,4 1}", "{2 0.5,4 1"), MULAN_XML, [], "line 11"),
    (MULAN_ARFF, MULAN_XML, ["--test-fraction", "1"], "--test-fraction must be in (0, 1)"),
    (MULAN_ARFF, MULAN_XML, ["--test-fraction", "0"], "--test-fraction must be in (0, 1)"),
])
def test_bad_input_exits_2_naming_what_is_wrong(tmp_path, arff, xml, extra, message):
    command = [sys.executable, "-m", "shortlist.cli", "data", "import-arff",
               "--arff", str(_write(tmp_path, "x.arff", arff)), "--out", str(tmp_path / "out"), *extra]
    if xml is not None:
        command += ["--labels-xml", str(_write(tmp_path, "x.xml", xml))]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "out" / "trn.json.gz").exists()
