"""Paths the CLI cannot read or write: exit 2 and one line naming the option, the path and the reason
from the operating system, never a traceback (audit s13 F7)."""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shortlist.cli import main


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], command: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"shortlist {command}: error: "), err
    assert "Traceback" not in err and "Errno" not in err
    return err.strip()


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "l_ok.jsonl"
    path.write_text('{"uid": "zz-new", "title": "network monitor"}\n')
    return path


def test_generate_data_out_is_an_existing_file(capsys, a_file):
    err = _refused(capsys, ["generate-data", "--out", str(a_file), "--labels", "50"], "generate-data")
    assert err.endswith(f"--out {a_file}: exists and is not a directory")


def test_generate_data_out_below_a_file_names_the_file_in_the_way(capsys, a_file):
    err = _refused(capsys, ["generate-data", "--out", f"{a_file}/x/y", "--labels", "50"], "generate-data")
    assert err.endswith(f"--out {a_file}/x/y: {a_file} is not a directory")


@pytest.mark.parametrize(("out", "reason"), [
    ("/proc/forbidden", "no such file or directory"),  # procfs makes no folders
    ("/sys/forbidden", "operation not permitted" if os.geteuid() == 0 else "permission denied"),
])
def test_generate_data_out_where_nothing_may_be_written(capsys, out, reason):
    err = _refused(capsys, ["generate-data", "--out", out, "--labels", "50"], "generate-data")
    assert err.endswith(f"--out {out}: {reason}")


def test_a_folder_made_on_the_way_is_named_with_the_option(capsys):
    err = _refused(capsys, ["generate-data", "--out", "/sys/forbidden/x", "--labels", "50"], "generate-data")
    assert ": error: --out /sys/forbidden/x: /sys/forbidden: " in err


def test_a_full_disk_names_the_file_and_leaves_the_dataset_there_as_it_was(capsys, tmp_path):
    out = tmp_path / "d"
    args = ["generate-data", "--out", str(out), "--labels", "50", "--train-docs", "5", "--test-docs", "2"]
    assert main(args) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # trn.json.gz is written under this name first (then renamed): on /dev/full every write fails with ENOSPC.
    (out / f".trn.json.gz.writing-{os.getpid()}").symlink_to("/dev/full")
    err = _refused(capsys, [*args, "--seed", "1"], "generate-data")
    assert err.endswith(f"--out {out}: {out / 'trn.json.gz'}: no space left on device")
    # Audit s13 G9: the full disk left a truncated trn.json.gz (and a new lbl.json.gz) under the final names.
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_generate_data_small_profile_at_and_past_its_label_limit(capsys, tmp_path):
    """Past the made-up words' supply the small profile drew words for ever (--labels 10^12 ran
    until killed); at its limit it writes the data."""
    from training.synthetic import MAX_SMALL_LABELS

    err = _refused(capsys, ["generate-data", "--out", str(tmp_path / "past"), "--labels", str(MAX_SMALL_LABELS + 1)],
                   "generate-data")
    assert err.endswith(f"--labels {MAX_SMALL_LABELS + 1}: the small profile makes at most {MAX_SMALL_LABELS} labels "
                        "(its made-up words run out); --profile scale makes 10^4..10^6+")
    assert not (tmp_path / "past").exists()
    at = ["generate-data", "--out", str(tmp_path / "at"), "--labels", str(MAX_SMALL_LABELS), "--train-docs", "3",
          "--test-docs", "1"]
    assert main(at) == 0
    with gzip.open(tmp_path / "at" / "lbl.json.gz", "rt") as f:
        titles = [json.loads(line)["title"].split()[0] for line in f]
    assert len(titles) == len(set(titles)) == MAX_SMALL_LABELS  # each label its own name word


def test_a_dataset_writer_refuses_a_folder_holding_a_split_in_another_form(capsys, tmp_path):
    """generate-data (import-arff, data aggregate: the same writer) wrote trn.json.gz beside a
    trn.json, exit 0, and `train` then refused the folder (a split in two files)."""
    out = tmp_path / "d"
    out.mkdir()
    (out / "trn.json").write_text("someone's data\n")
    err = _refused(capsys, ["generate-data", "--out", str(out), "--labels", "50", "--train-docs", "5",
                            "--test-docs", "2"], "generate-data")
    assert err.endswith(f"{out / 'trn.json'}: the trn split in another form than the trn.json.gz written here (a "
                        "split in two files is refused when read): remove it or write to another folder")
    assert [p.name for p in out.iterdir()] == ["trn.json"] and (out / "trn.json").read_text() == "someone's data\n"
    (out / "trn.json").unlink()
    assert main(["generate-data", "--out", str(out), "--labels", "50", "--train-docs", "5", "--test-docs", "2"]) == 0
    assert main(["generate-data", "--out", str(out), "--labels", "50", "--train-docs", "5", "--test-docs", "2"]) == 0


@pytest.mark.parametrize("command", [["generate-data", "--labels", "50", "--train-docs", "5", "--test-docs", "2"],
                                     ["data", "aggregate", "--group-size", "2", "--grouping", "random"]])
def test_a_seed_is_checked_at_and_past_its_edges_naming_the_flag(capsys, tmp_path, synthetic_data, command):
    """numpy's "expected non-negative integer" named no flag; every --seed takes training's range."""
    given = ["--data", str(synthetic_data)] if command[0] == "data" else []
    for seed in ("-1", "4294967296", "1.5"):
        with pytest.raises(SystemExit) as exit_:
            main([*command, *given, "--out", str(tmp_path / "out"), "--seed", seed])
        assert exit_.value.code == 2
        assert f"argument --seed: must be an integer in [0, 4294967295], got '{seed}'" in capsys.readouterr().err
    assert main([*command, *given, "--out", str(tmp_path / "top"), "--seed", "4294967295"]) == 0
    assert not (tmp_path / "out").exists()


def test_a_write_that_names_no_file_names_the_commands_output():
    """A write error that names no file (a full disk found by a close, or a library's writer): the
    command's output option is named."""
    from shortlist.cli import os_error_message

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert os_error_message(full, {"--data": "d", "--out": "/o"}) == "--out /o: no space left on device"
    assert os_error_message(full, {"--data": "d"}) == "no space left on device"


def test_data_aggregate_on_a_full_disk_names_the_file_and_leaves_nothing_under_a_final_name(
        capsys, synthetic_data, tmp_path):
    out = tmp_path / "grouped"
    out.mkdir()
    # groups.json.gz is written under this name first (then renamed): on /dev/full every write fails.
    (out / f".groups.json.gz.writing-{os.getpid()}").symlink_to("/dev/full")
    args = ["data", "aggregate", "--data", str(synthetic_data), "--out", str(out), "--group-size", "4"]
    err = _refused(capsys, args, "data")
    assert err.endswith(f": error: --out {out}: {out / 'groups.json.gz'}: no space left on device")
    assert sorted(p.name for p in out.iterdir()) == []  # trn.json.gz, written whole, was not renamed either
    assert main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == ["groups.json.gz", "lbl.json.gz", "trn.json.gz", "tst.json.gz"]


def test_train_refuses_an_out_it_could_not_save_to_before_it_trains(capsys, caplog, tmp_path, synthetic_data,
                                                                     a_file):
    """Checked at the start, not at the save after the training (hours at 10^6 labels)."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep")
    train = ["train", "--data", str(synthetic_data)]
    with caplog.at_level("INFO", logger="shortlist.training"):
        for out, reason in ((a_file, f"{a_file}: exists and is not a checkpoint (no checkpoint.json)"),
                            (notes, f"{notes}: exists and is not a checkpoint (no checkpoint.json)"),
                            (a_file / "ck", f"--out {a_file}/ck: {a_file} is not a directory")):
            err = _refused(capsys, [*train, "--out", str(out)], "train")
            assert reason in err, err
    assert not [r for r in caplog.records if r.getMessage().startswith("data:")]  # no training began
    assert a_file.read_text().startswith("{") and (notes / "todo.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l_ok.jsonl", "notes"]  # no probe left


def _on_tmpfs(folder: Path, options: str, python: str, after: str = "") -> subprocess.CompletedProcess:
    """`python` run with a tmpfs (mount `options`) on `folder`, in a private mount namespace (as
    root), then the shell lines `after`; skipped where that cannot be had."""
    folder.mkdir()
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "-o", options, "tmpfs",
             str(folder)], capture_output=True).returncode != 0:
        pytest.skip("needs unshare -m and mount (root) for a tmpfs")
    script = f"mount -t tmpfs -o {options} tmpfs {folder} || exit 9\n{shlex.quote(sys.executable)} -c " \
             f"{shlex.quote(python)}\n{after}"
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                          text=True, timeout=300)


def test_train_refuses_an_out_on_a_read_only_disk_before_it_trains(tmp_path, synthetic_data):
    ro = tmp_path / "ro"
    argv = ["train", "--data", str(synthetic_data), "--out", f"{ro}/a/ck"]
    r = _on_tmpfs(ro, "ro,size=64k", f"from shortlist.cli import main\nprint('rc=' + str(main({argv!r})))")
    assert r.stdout.strip() == "rc=2", (r.stdout, r.stderr)
    assert r.stderr.strip() == f"shortlist train: error: --out {ro}/a/ck: cannot write in {ro}: read-only file system"


def test_a_full_disk_names_the_output_of_every_command(tmp_path, checkpoints, synthetic_data):
    """A real full disk (a 64 KiB tmpfs in a private mount namespace, as root): export, train
    (its save) and generate-data exit 2 naming the path, and leave nothing under a final name."""
    full = tmp_path / "full"
    commands = [["export", str(checkpoints["v1"]), "--out", f"{full}/root", "--version", "x1", "--parity-texts", "20"],
                ["train", "--data", str(synthetic_data), "--out", f"{full}/ck", "--retune", str(checkpoints["v1"])],
                ["generate-data", "--out", f"{full}/gen", "--labels", "300", "--train-docs", "2000"]]
    run = f"from shortlist.cli import main\nfor argv in {commands!r}:\n    print(f'rc={{main(argv)}}', flush=True)"
    r = _on_tmpfs(full, "size=64k", run, f"ls -A {full}/root {full}/gen; ls -A {full}")
    errors = [line for line in r.stderr.splitlines() if ": error: " in line]
    assert r.stdout.count("rc=2") == 3, (r.stdout, r.stderr)
    assert errors == [
        f"shortlist export: error: --out {full}/root: {full}/root/x1: no space left on device",
        f"shortlist train: error: --out {full}/ck: no space left on device",
        f"shortlist generate-data: error: --out {full}/gen: {full}/gen/trn.json.gz: no space left on device"], r.stderr
    assert r.stdout.split("rc=2\n")[-1].split() == [f"{full}/gen:", f"{full}/root:", "gen", "root"], r.stdout


def test_data_that_is_a_file_is_not_a_directory_not_missing(capsys, a_file, tmp_path):
    err = _refused(capsys, ["train", "--data", str(a_file), "--out", str(tmp_path / "ck")], "train")
    assert err.endswith(f"--data {a_file}: not a directory (a dataset folder is expected)")
    err = _refused(capsys, ["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "ck")], "train")
    assert err.endswith("dataset folder does not exist")


def test_eval_data_that_is_a_file(capsys, bundle_root, a_file):
    err = _refused(capsys, ["eval", str(bundle_root / "v1"), "--data", str(a_file)], "eval")
    assert err.endswith(f"--data {a_file}: not a directory (a dataset folder is expected)")


def test_labels_add_out_is_a_file_or_below_one(capsys, bundle_root, a_file, tmp_path):
    labels = tmp_path / "new.jsonl"
    title = json.loads((bundle_root / "v1" / "labels.jsonl").read_text().splitlines()[0])["title"]
    labels.write_text(json.dumps({"uid": "zz-new", "title": title}) + "\n")  # words the bundle knows
    a_file.write_text(labels.read_text())  # also read as --labels below
    base = ["labels", "add", str(bundle_root / "v1"), "--labels", str(labels), "--version", "x2"]
    err = _refused(capsys, [*base, "--out", str(a_file)], "labels")
    assert err.endswith(f"--out {a_file}: exists and is not a directory")
    err = _refused(capsys, [*base, "--out", f"{a_file}/sub"], "labels")
    assert err.endswith(f"--out {a_file}/sub: {a_file} is not a directory")
    # The same path given twice: both options are named, as either may be the one that failed.
    err = _refused(capsys, [*base[:4], str(a_file), *base[5:], "--out", str(a_file)], "labels")
    assert err.endswith(f"--labels, --out {a_file}: exists and is not a directory")


def test_shard_out_is_a_file(capsys, bundle_root, a_file):
    err = _refused(capsys, ["shard", str(bundle_root / "v1"), "--shards", "2", "--out", str(a_file)], "shard")
    assert err.endswith(f"--out {a_file}: exists and is not a directory")


def test_the_installed_command_exits_2_without_a_traceback(a_file):
    # The console entry point itself (python -m shortlist.cli), not only main().
    r = subprocess.run([sys.executable, "-m", "shortlist.cli", "generate-data", "--out", str(a_file)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"shortlist generate-data: error: --out {a_file}: exists and is not a directory"


@pytest.mark.parametrize(("signum", "code", "said"), [(signal.SIGINT, 130, "interrupted"),
                                                      (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_or_sigterm_is_one_line_and_the_shells_code_and_cleans_up_what_was_written(tmp_path, signum, code,
                                                                                          said):
    """SIGTERM (`timeout`, `docker stop`) ended the process at once, leaving its staged files."""
    # A million labels take ~30 s to generate: the signal comes while a file is being written.
    out = tmp_path / "d"
    proc = subprocess.Popen([sys.executable, "-m", "shortlist.cli", "generate-data", "--out", str(out), "--profile",
                             "scale", "--labels", "1000000"], stderr=subprocess.PIPE, text=True,
                            # A shell's background job starts with SIGINT ignored, which Python keeps.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not list(out.glob(".*.writing-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(out.glob(".*.writing-*")), "no file was being written"
    # Sent again if need be: an exception raised by a signal's handler inside numpy's C code can be
    # lost there (CPython's own KeyboardInterrupt too), and the command then carries on.
    for _ in range(10):
        proc.send_signal(signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=3)
            break
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code and "Traceback" not in stderr, stderr[-2000:]
    assert stderr.strip() == f"shortlist generate-data: {said}"
    assert not [p for p in out.rglob("*") if p.is_file()]


def test_running_out_of_memory_is_said_plainly_not_a_traceback(tmp_path):
    # 10^8 labels in a 1 GiB address space: numpy's allocation fails part-way through a real command.
    import resource

    def one_gib() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    out = tmp_path / "d"
    r = subprocess.run([sys.executable, "-m", "shortlist.cli", "generate-data", "--out", str(out), "--profile",
                        "scale", "--labels", "100000000"], capture_output=True, text=True, timeout=300,
                       preexec_fn=one_gib)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().startswith("shortlist generate-data: error: out of memory: this machine's memory")
    assert not [p for p in out.rglob("*") if p.is_file()]


def test_a_file_option_given_a_folder_says_why_without_errno(capsys, bundle_root, synthetic_data, tmp_path):
    err = _refused(capsys, ["labels", "add", str(bundle_root / "v1"), "--labels", str(tmp_path), "--out",
                            str(tmp_path / "out")], "labels")
    assert err.endswith(f"{tmp_path}: cannot read file: is a directory")
    err = _refused(capsys, ["eval", str(bundle_root / "v1"), "--data", str(synthetic_data), "--filter", str(tmp_path)],
                   "eval")
    assert err.endswith(f"{tmp_path}: cannot read filter file: is a directory")


def test_a_filter_file_line_past_the_line_limit_is_refused_naming_file_and_line(
        capsys, bundle_root, synthetic_data, tmp_path, monkeypatch):
    monkeypatch.setenv("SHORTLIST_MAX_LINE_CHARS", "1024")
    filter_file = tmp_path / "filter.txt"
    filter_file.write_text("0 1\n" + "1" * 2000 + "\n")
    err = _refused(capsys, ["eval", str(bundle_root / "v1"), "--data", str(synthetic_data), "--filter",
                            str(filter_file)], "eval")
    assert err.endswith(f"{filter_file}:2: line longer than 1024 characters (SHORTLIST_MAX_LINE_CHARS)")


def test_labels_add_honours_the_line_limit_the_readme_documents_for_its_label_file(
        capsys, bundle_root, tmp_path, monkeypatch):
    # `labels add` loads every SHORTLIST_* setting: SHORTLIST_MAX_LINE_CHARS stopped it as an
    # unknown setting instead of bounding its label file's lines.
    monkeypatch.setenv("SHORTLIST_MAX_LINE_CHARS", "1024")
    labels = tmp_path / "labels.jsonl"
    labels.write_text('{"uid": "n1", "title": "network monitor"}\n{"uid": "n2", "title": "' + "a" * 1100 + '"}\n')
    err = _refused(capsys, ["labels", "add", str(bundle_root / "v1"), "--labels", str(labels), "--out",
                            str(tmp_path / "out")], "labels")
    assert err.endswith(f"{labels}:2: line longer than 1024 characters (SHORTLIST_MAX_LINE_CHARS)")
    monkeypatch.setenv("SHORTLIST_MAX_LINE_CHARS", "1023")
    err = _refused(capsys, ["labels", "add", str(bundle_root / "v1"), "--labels", str(labels), "--out",
                            str(tmp_path / "out")], "labels")
    assert "SHORTLIST_MAX_LINE_CHARS='1023'" in err and "1024" in err


def test_a_filter_file_that_is_a_fifo_or_a_device_is_refused_without_reading_it(
        capsys, bundle_root, synthetic_data, tmp_path):
    """A FIFO nobody writes hung `eval` for ever; /dev/zero was read until the OOM killer came (24 GB)."""
    fifo = tmp_path / "pairs.fifo"
    os.mkfifo(fifo)
    zero = tmp_path / "zero"
    zero.symlink_to("/dev/zero")
    for path in (fifo, zero):
        err = _refused(capsys, ["eval", str(bundle_root / "v1"), "--data", str(synthetic_data), "--filter",
                                str(path)], "eval")
        assert err.endswith(f"{path}: cannot read filter file: not a regular file")
    data = tmp_path / "data"
    shutil.copytree(synthetic_data, data)
    (data / "tst.json.gz").unlink()
    os.mkfifo(data / "tst.json.gz")  # found by name, refused before it is opened
    err = _refused(capsys, ["eval", str(bundle_root / "v1"), "--data", str(data)], "eval")
    assert err.endswith(f"{data / 'tst.json.gz'}: cannot read file: not a regular file")


def test_a_config_or_labels_xml_that_is_a_fifo_or_a_device_is_refused_without_reading_it(capsys, tmp_path):
    """Both were read whole by name: a FIFO hung the command, /dev/zero filled the memory."""
    fifo = tmp_path / "cfg.fifo"
    os.mkfifo(fifo)
    zero = tmp_path / "zero"
    zero.symlink_to("/dev/zero")
    arff = tmp_path / "x.arff"
    arff.write_text("@relation r\n@attribute a {0,1}\n@attribute b {0,1}\n@data\n1,0\n")
    for path, kind in ((fifo, "a FIFO"), (zero, "a character device"), (tmp_path, "a directory")):
        err = _refused(capsys, ["train", "--data", str(tmp_path), "--out", str(tmp_path / "ck"), "--config",
                                str(path)], "train")
        assert err.endswith(f"{path}: cannot read training config: {kind}, not a regular file"), err
        err = _refused(capsys, ["data", "import-arff", "--arff", str(arff), "--labels-xml", str(path), "--out",
                                str(tmp_path / "out")], "data")
        assert err.endswith(f"{path}: not a MULAN label file: {kind}, not a regular file"), err


def test_a_config_and_a_labels_xml_at_and_past_their_size_limits(capsys, tmp_path, monkeypatch):
    from training import arff_data
    from training.config import MAX_CONFIG_BYTES, read_config_file

    config = tmp_path / "cfg.json"
    config.write_bytes(b'{"seed": 3}' + b" " * (MAX_CONFIG_BYTES - 11))
    assert config.stat().st_size == MAX_CONFIG_BYTES and read_config_file(config) == {"seed": 3}
    config.write_bytes(config.read_bytes() + b" ")
    with pytest.raises(ValueError, match=rf"cfg\.json: cannot read training config: {MAX_CONFIG_BYTES + 1} bytes, "
                                         rf"more than the limit of {MAX_CONFIG_BYTES}"):
        read_config_file(config)
    xml = b'<labels xmlns="http://mulan.sourceforge.net/labels"><label name="b"></label></labels>'
    monkeypatch.setattr(arff_data, "MAX_LABELS_XML_BYTES", len(xml))  # 256 MiB for real: the same check
    (tmp_path / "l.xml").write_bytes(xml)
    assert arff_data._mulan_labels(tmp_path / "l.xml") == ["b"]
    (tmp_path / "l.xml").write_bytes(xml + b" ")
    with pytest.raises(ValueError, match=rf"l\.xml: not a MULAN label file: {len(xml) + 1} bytes, more than the limit"):
        arff_data._mulan_labels(tmp_path / "l.xml")


@pytest.mark.parametrize(("flags", "named"), [
    (["--parity-texts", "0"], "--parity-texts must be >= 1"),
    (["--parity-texts", "-1"], "--parity-texts must be >= 1"),
    (["--ef-search", "0"], "--ef-search must be in [1, 10000]"),
    (["--ef-search", "10001"], "--ef-search must be in [1, 10000]"),
    (["--version", ""], "--version: empty"),
])
def test_export_refuses_a_bad_option_before_any_work_naming_the_flag(capsys, checkpoints, tmp_path, flags, named):
    """Audit 6 F10: --parity-texts 0 turned the ONNX parity check off (exit 0), -1 checked 5 texts,
    --version "" became a timestamp, and --ef-search 0 was refused after the whole export in
    pydantic's words. Each is refused at once (nothing written), naming the flag."""
    out = tmp_path / "root"
    err = _refused(capsys, ["export", str(checkpoints["v1"]), "--out", str(out), *flags], "export")
    assert named in err and "pydantic" not in err, err
    assert "onnx parity" not in err  # refused before the export began
    assert not out.exists() or not any(out.iterdir())


def test_eval_refuses_alpha_with_the_tree_scorer(capsys, bundle_root, synthetic_data):
    """Audit 6 F10: `eval --scorer tree --alpha 0.5` ignored --alpha and reported the tree route's numbers."""
    err = _refused(capsys, ["eval", str(bundle_root / "v1"), "--data", str(synthetic_data), "--scorer", "tree",
                            "--alpha", "0.5"], "eval")
    assert "--alpha" in err and "--scorer tree" in err, err


@pytest.fixture(scope="module")
def bundle_without_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle trained with tree_enabled false, on a small dataset of its own (~4 s)."""
    from model_export.export import export_checkpoint
    from training.config import TrainConfig
    from training.pipeline import train
    from training.synthetic import generate

    work = tmp_path_factory.mktemp("no-tree")
    generate(work / "data", num_labels=40, train_docs=300, test_docs=40, seed=0)
    cfg = TrainConfig.from_dict({"tree_enabled": False, "m1_epochs": 1, "m3_epochs": 1}, TrainConfig.tiny())
    train(work / "data", cfg, seed=1).save(work / "ckpt")
    return export_checkpoint(work / "ckpt", work / "bundles", "v1")


def test_eval_on_the_tree_route_of_a_bundle_without_a_tree_is_refused_before_the_data_is_read(
        capsys, bundle_without_tree, tmp_path):
    """Audit 7 F7: a traceback (the engine's LookupError, exit 1) after the data was read; the HTTP
    route answers 409 no_tree_scorer. A folder with no data in it shows the data was not read."""
    err = _refused(capsys, ["eval", str(bundle_without_tree), "--data", str(tmp_path), "--scorer", "tree"], "eval")
    assert err == ("shortlist eval: error: bundle v1 has no tree scorer (trained with tree_enabled false): "
                   "use --scorer alpha")
