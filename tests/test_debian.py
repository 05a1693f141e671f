"""The Debian demo data: apt lists found and parsed in every compression, the dataset built from
them loads as XC raw text, splits by package name, drops rare tags, and bad lists get clear errors.

Every list here is written by the test; nothing reads /var/lib/apt.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import lzma
from pathlib import Path

import pytest

from shortlist.demo import DEBIAN_EXAMPLE, build_demo, example_query
from training.data import load_labels, load_split
from training.debian import (
    build_debian_tags,
    find_package_lists,
    iter_stanzas,
    read_packages,
    tag_title,
)

HAS_LZ4 = importlib.util.find_spec("lz4") is not None
COMPRESSIONS = ["", ".gz", ".xz", pytest.param(".lz4", marks=pytest.mark.skipif(not HAS_LZ4, reason="no lz4"))]
NUM_PACKAGES = 120


def in_test(name: str) -> bool:
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % 10 < 3


def _stanza(i: int) -> str:
    name = f"pkg{i:03d}"
    tags = ["role::program"]
    if i % 2 == 0:
        tags.append("game::strategy")
    if i % 3 == 0:
        tags.append("use::gameplaying")
    if i == 7:
        tags.append("rare::tag")  # one package only: below any min_tag_count > 1
    if i % 5 == 0:
        tags.append("special::not-yet-tagged")
    # Long tag lists wrap onto continuation lines in real Packages files.
    tag_field = "Tag: " + ",\n ".join(", ".join(tags[j:j + 2]) for j in range(0, len(tags), 2))
    return (
        f"Package: {name}\nVersion: 1.0-{i}\nArchitecture: amd64\n"
        f"Description: game number {i} for testing\n"
        f" A longer text about package {i}.\n .\n Second paragraph.\n"
        f"Description-md5: {hashlib.md5(name.encode()).hexdigest()}\n"
        f"{tag_field}\nSection: games\n"
    )


def _packages_text(count: int = NUM_PACKAGES) -> str:
    untagged = "Package: notags\nVersion: 1\nDescription: a package without debtags\n"
    return "\n".join([_stanza(i) for i in range(count)] + [untagged])


def _write_list(folder: Path, text: str, compression: str, name: str = "example.org_debian_main_Packages") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}{compression}"
    data = text.encode("utf-8", "surrogateescape")  # a lone \udcXX is the byte XX, not UTF-8
    if compression == ".gz":
        data = gzip.compress(data)
    elif compression == ".xz":
        data = lzma.compress(data)
    elif compression == ".lz4":
        import lz4.frame

        data = lz4.frame.compress(data)
    path.write_bytes(data)
    return path


def _read_gz(path: Path) -> str:
    return gzip.decompress(path.read_bytes()).decode("utf-8")


def test_find_package_lists_takes_every_compression_once_and_ignores_other_files(tmp_path: Path) -> None:
    for name, ext in [("a_Packages", ""), ("a_Packages", ".gz"), ("b_Packages", ".lz4"), ("c_Packages", ".xz"),
                      ("d_Packages", ".gz"), ("x_InRelease", ""), ("y_Translation-en", ".gz")]:
        (tmp_path / f"{name}{ext}").write_bytes(b"")
    found = [p.name for p in find_package_lists(tmp_path)]
    assert found == ["a_Packages", "b_Packages.lz4", "c_Packages.xz", "d_Packages.gz"]
    assert find_package_lists(tmp_path / "missing") == []


def test_stanzas_join_continuation_lines_and_tags_span_them(tmp_path: Path) -> None:
    stanzas = list(iter_stanzas(_stanza(6).splitlines(keepends=True)))
    assert len(stanzas) == 1
    assert "\n" in stanzas[0]["Tag"]  # the field really was written over several lines
    pkg = read_packages([_write_list(tmp_path, _stanza(6), "")])["pkg006"]
    assert pkg.tags == ["role::program", "game::strategy", "use::gameplaying"]
    assert pkg.short == "game number 6 for testing"
    assert pkg.long == "A longer text about package 6.\n\nSecond paragraph."


def test_tag_titles_are_readable() -> None:
    assert tag_title("game::strategy") == "game strategy"
    assert tag_title("devel::lang:c++") == "devel lang c++"
    assert tag_title("implemented-in::python") == "implemented in python"


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_dataset_from_each_compression_loads_as_xc_raw_text(tmp_path: Path, compression: str) -> None:
    lst = _write_list(tmp_path / "lists", _packages_text(), compression)
    out = build_debian_tags(tmp_path / "data", lists=[lst], min_tag_count=3)
    labels = load_labels(out)
    trn = load_split(out, "trn", num_labels=len(labels))
    tst = load_split(out, "tst", "title+content", num_labels=len(labels))
    # special:: is bookkeeping and rare::tag has one package: neither is a label.
    assert labels.uids == ["game::strategy", "role::program", "use::gameplaying"]
    assert labels.titles == ["game strategy", "role program", "use gameplaying"]
    assert len(trn) + len(tst) == NUM_PACKAGES  # the untagged package is no document
    row = {uid: t for uid, t in zip(trn.uids + tst.uids, trn.targets + tst.targets, strict=True)}
    assert sorted(labels.uids[i] for i in row["pkg006"]) == ["game::strategy", "role::program", "use::gameplaying"]
    assert [labels.uids[i] for i in row["pkg007"]] == ["role::program"]
    assert all("Second paragraph." in text for text in tst.texts)  # content = long description


def test_split_is_by_package_name_and_deterministic(tmp_path: Path) -> None:
    lst = _write_list(tmp_path / "lists", _packages_text(), ".gz")
    first = build_debian_tags(tmp_path / "one", lists=[lst], min_tag_count=3)
    # The same packages in another order in another list give the same files.
    shuffled = "\n".join(_stanza(i) for i in reversed(range(NUM_PACKAGES)))
    second = build_debian_tags(tmp_path / "two", lists=[_write_list(tmp_path / "other", shuffled, "")],
                               min_tag_count=3)
    for name in ("trn.json.gz", "tst.json.gz", "lbl.json.gz"):
        assert _read_gz(first / name) == _read_gz(second / name)
        assert (first / name).read_bytes() == (second / name).read_bytes()
    trn, tst = load_split(first, "trn"), load_split(first, "tst")
    assert not any(in_test(u) for u in trn.uids)
    assert all(in_test(u) for u in tst.uids)
    assert 0.15 < len(tst) / NUM_PACKAGES < 0.45
    reseeded = build_debian_tags(tmp_path / "seeded", lists=[lst], min_tag_count=3, seed=1)
    assert load_split(reseeded, "tst").uids != tst.uids


def test_min_tag_count_counts_training_packages(tmp_path: Path) -> None:
    names = [f"p{i}" for i in range(200)]
    test_names = [n for n in names if in_test(n)][:4]
    train_names = [n for n in names if not in_test(n)][:7]
    stanzas = [f"Package: {n}\nDescription: tool {n}\nTag: common::tag, test::only\n" for n in test_names]
    stanzas += [f"Package: {n}\nDescription: tool {n}\nTag: common::tag\n" for n in train_names[:6]]
    stanzas.append(f"Package: {train_names[6]}\nDescription: odd one\nTag: common::tag, rare::tag\n")
    lst = _write_list(tmp_path, "\n".join(stanzas), "")
    # test::only has 4 packages, all held out: never a label, however low the threshold.
    assert load_labels(build_debian_tags(tmp_path / "one", lists=[lst], min_tag_count=1)).uids == [
        "common::tag", "rare::tag"]
    assert load_labels(build_debian_tags(tmp_path / "two", lists=[lst], min_tag_count=2)).uids == ["common::tag"]
    with pytest.raises(ValueError, match="no debtag is carried by 8 or more training packages"):
        build_debian_tags(tmp_path / "eight", lists=[lst], min_tag_count=8)


def test_translation_lists_supply_long_descriptions(tmp_path: Path) -> None:
    short_only = "Package: tool\nDescription: a fast network tool\nDescription-md5: abc\nTag: network::client\n"
    lst = _write_list(tmp_path, short_only, ".xz")
    tr = _write_list(tmp_path, "Package: tool\nDescription-md5: abc\nDescription-en: a fast network tool\n"
                     " It talks to many hosts at once.\n", ".gz", name="example.org_i18n_Translation-en")
    assert read_packages([lst], [tr])["tool"].long == "It talks to many hosts at once."


@pytest.mark.parametrize(
    ("text", "compression", "message"),
    [
        ("Package: a\nthis line has no colon\n", "", ":2: malformed line"),
        (" Tag: orphan continuation\n", "", ":1: continuation line without a field"),
        ("Package: a\nDescription: x\n", "", "no debtag is carried by"),
        (None, ".xz", "cannot read package list"),
        (None, ".gz", "cannot read package list"),
        pytest.param(None, ".lz4", "cannot read package list",
                     marks=pytest.mark.skipif(not HAS_LZ4, reason="no lz4")),
    ],
)
def test_bad_lists_get_errors_naming_the_file(tmp_path: Path, text: str | None, compression: str,
                                              message: str) -> None:
    if text is None:  # a corrupt compressed file
        path = tmp_path / f"bad_Packages{compression}"
        path.write_bytes(b"this is not compressed data at all")
    else:
        path = _write_list(tmp_path, text, compression, name="bad_Packages")
    with pytest.raises(ValueError, match=message) as err:
        build_debian_tags(tmp_path / "out", lists=[path], min_tag_count=1)
    assert "bad_Packages" in str(err.value)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_bytes_that_are_not_utf8_are_named_by_line_and_column(tmp_path: Path, compression: str) -> None:
    # A decoder names the offset of its buffer ("position 8191"), which no editor shows.
    path = _write_list(tmp_path, _packages_text(3) + "Package: z\nDescription: caf\udce9\n", compression,
                       name="bad_Packages")
    line = (_packages_text(3) + "Package: z\n").count("\n") + 1
    with pytest.raises(ValueError, match=rf"bad_Packages[.a-z0-9]*:{line}: not UTF-8: byte 0xe9 at column 17"):
        build_debian_tags(tmp_path / "out", lists=[path], min_tag_count=1)


def test_missing_list_and_bad_min_count_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nope_Packages: package list does not exist"):
        build_debian_tags(tmp_path / "out", lists=[tmp_path / "nope_Packages"])
    with pytest.raises(ValueError, match="min_tag_count must be >= 1"):
        build_debian_tags(tmp_path / "out", lists=[], min_tag_count=0)
    with pytest.raises(ValueError, match="no apt package lists"):
        build_debian_tags(tmp_path / "out", lists=[])


def test_demo_refuses_to_mix_datasets_and_gives_a_fitting_example(tmp_path: Path, synthetic_data: Path) -> None:
    (tmp_path / "demo.json").write_text('{"dataset": "debian"}')
    with pytest.raises(ValueError, match="built from debian data"):
        build_demo(tmp_path, "synthetic")
    with pytest.raises(ValueError, match="--dataset must be one of"):
        build_demo(tmp_path / "other", "ubuntu")
    assert example_query("synthetic", synthetic_data) == load_labels(synthetic_data).titles[0]
    assert example_query("debian", tmp_path) == DEBIAN_EXAMPLE


def test_demo_names_a_bad_port_before_building_anything(tmp_path: Path, capsys) -> None:
    from shortlist.cli import main

    workdir = tmp_path / "demo"
    assert main(["demo", "--workdir", str(workdir), "--port", "99999"]) == 2
    err = capsys.readouterr().err
    assert "--port 99999" in err and "Traceback" not in err, err
    assert not workdir.exists()  # nothing built


def test_demo_names_a_taken_port_before_building_anything(tmp_path: Path, capsys) -> None:
    import socket

    from shortlist.cli import main

    workdir = tmp_path / "demo"
    with socket.create_server(("127.0.0.1", 0)) as taker:
        port = taker.getsockname()[1]
        assert main(["demo", "--workdir", str(workdir), "--port", str(port)]) == 3
    err = capsys.readouterr().err
    assert err.strip() == f"shortlist demo: error: cannot listen on 127.0.0.1:{port}: address already in use", err
    assert not workdir.exists()  # nothing built: the port is checked before minutes of training
