"""Export: ONNX parity, bundle layout and checksums, immutability, atomicity, evaluation through the engine."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from model_export.export import export_checkpoint
from model_export.onnx_export import PARITY_TOLERANCE, as_served, parity_texts
from service.engine import BundleError, Predictor
from service.engine.manifests import newest_version
from service.engine.schema import MANIFEST, REQUIRED_FILES, sha256_file
from shortlist.cli import main as cli_main
from training.checkpoint import MAX_META_BYTES, Checkpoint


def test_onnx_matches_torch_on_1000_texts_including_edge_cases(checkpoints, bundle_root):
    ckpt = Checkpoint.load(checkpoints["v1"])
    texts = parity_texts(ckpt.tokenizer, ckpt.labels.titles, n=1000)
    assert len(texts) == 1000 and "" in texts
    assert any(len(ckpt.tokenizer.encode(t)[0]) == ckpt.tokenizer.max_tokens for t in texts)  # very long
    predictor = Predictor.load(bundle_root / "v1")
    served = np.vstack([predictor.encode(texts[i : i + 100]) for i in range(0, 1000, 100)])
    ids, weights = ckpt.tokenizer.encode_batch(texts)
    # torch with the table's values as the graph stores them (float16 by default)
    encoder = as_served(ckpt.encoder, predictor.bundle.manifest.metrics["encoder_table_dtype"])
    with torch.no_grad():
        ref = encoder(torch.from_numpy(ids), torch.from_numpy(weights)).numpy()
    assert np.abs(served - ref).max() <= PARITY_TOLERANCE
    # the empty and all-unknown texts are valid inputs that map to the zero vector
    assert np.all(served[0] == 0) and np.all(served[texts.index("zzqxj qqqvvk xxyyzz")] == 0)
    norms = np.linalg.norm(served, axis=1)
    assert np.allclose(norms[norms > 0], 1.0, atol=1e-5)


def test_manifest_lists_every_file_with_its_sha256(bundle_root):
    bundle_dir = bundle_root / "v1"
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    on_disk = {p.name for p in bundle_dir.iterdir()} - {MANIFEST}
    assert set(manifest["files"]) == on_disk
    assert set(REQUIRED_FILES) <= on_disk
    for name, digest in manifest["files"].items():
        assert sha256_file(bundle_dir / name) == digest
    for field in ("format_version", "created_at", "dim", "num_labels", "vocab_size", "scoring", "hnsw",
                  "data_fingerprint", "metrics", "canary"):
        assert field in manifest
    assert manifest["scoring"]["calibration"]["classifier"]["kind"] in ("sigmoid", "exp", "identity")
    assert "tree_default_beam" not in manifest  # retired: the tree's beam is in tree.npz
    assert np.load(bundle_dir / "classifiers.npy", mmap_mode="r").shape == (manifest["num_labels"], manifest["dim"])


def test_every_bundle_file_is_as_readable_as_the_manifest(bundle_root):
    """A container reads the bundle volume as another user: no file may be private to the exporter
    (onnx writes its external data file 0600)."""
    bundle_dir = bundle_root / "v1"
    manifest_mode = (bundle_dir / MANIFEST).stat().st_mode & 0o777
    assert manifest_mode & 0o044, "the test needs a umask that lets others read"
    assert {p.name: p.stat().st_mode & 0o777 for p in bundle_dir.iterdir()} == {
        p.name: manifest_mode for p in bundle_dir.iterdir()}


def test_export_refuses_to_overwrite_an_existing_version(checkpoints, bundle_root_copy):
    before = sha256_file(bundle_root_copy / "v1" / MANIFEST)
    with pytest.raises(BundleError, match="already exists"):
        export_checkpoint(checkpoints["v1"], bundle_root_copy, "v1")
    assert sha256_file(bundle_root_copy / "v1" / MANIFEST) == before


def _saved_before_checksums(ckpt: Path) -> None:
    """`ckpt` as a save before checkpoint.json held its files' checksums wrote it (format 2)."""
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    del meta["files"]
    meta["format"] = 2
    (ckpt / "checkpoint.json").write_text(json.dumps(meta))


def test_inconsistent_checkpoint_is_refused_before_writing(checkpoints, tmp_path):
    broken = tmp_path / "ckpt"
    shutil.copytree(checkpoints["v1"], broken)
    _saved_before_checksums(broken)  # its shapes are what is left to check
    w = np.load(broken / "classifiers.npy")
    np.save(broken / "classifiers.npy", w[:-1])  # one label short
    root = tmp_path / "bundles"
    with pytest.raises(ValueError, match=r"classifiers\.npy: shape \(299, \d+\), expected \(300,"):
        export_checkpoint(broken, root, "broken")
    assert not (root / "broken").exists()


def test_a_checkpoint_whose_files_changed_after_its_save_is_refused_naming_the_file(checkpoints, tmp_path, capsys):
    """Audit s13 G1: a checkpoint of files from two runs exported to a torch traceback."""
    mixed = tmp_path / "ckpt"
    shutil.copytree(checkpoints["v1"], mixed)
    meta = json.loads((mixed / "checkpoint.json").read_text())
    assert set(meta["files"]) == {p.name for p in mixed.iterdir()} - {"checkpoint.json"}
    assert meta["files"]["encoder.pt"] == sha256_file(mixed / "encoder.pt")
    shutil.copy(checkpoints["v2"] / "encoder.pt", mixed / "encoder.pt")  # same shapes, another run
    root = tmp_path / "bundles"
    assert cli_main(["export", str(mixed), "--out", str(root), "--version", "mixed"]) == 2
    assert capsys.readouterr().err == (
        f"shortlist export: error: {mixed / 'encoder.pt'}: sha256 differs from checkpoint.json's: the file changed "
        "after the checkpoint was saved (edited, or written by another run)\n")
    assert not root.exists()  # refused before anything is written
    shutil.copy(checkpoints["v1"] / "encoder.pt", mixed / "encoder.pt")
    (mixed / "tree.npz").unlink()
    with pytest.raises(ValueError, match=r"tree\.npz: missing \(checkpoint\.json lists it\)"):
        Checkpoint.load(mixed)
    shutil.copy(checkpoints["v1"] / "tree.npz", mixed / "tree.npz")
    (mixed / "stray.bin").write_bytes(b"left by another run")
    with pytest.raises(ValueError, match=r"stray\.bin: not listed in checkpoint\.json"):
        Checkpoint.load(mixed)
    (mixed / "stray.bin").unlink()
    assert Checkpoint.load(mixed).seed == 1  # as saved again: it loads


def test_checksums_cannot_be_switched_off_by_deleting_them(checkpoints, tmp_path, capsys):
    """Audit s14 L4: with "files" deleted (or null) a checkpoint loaded unverified, one holding
    another run's encoder.pt exported with exit 0. A save writes format 3, whose loads require it."""
    mixed = tmp_path / "ckpt"
    shutil.copytree(checkpoints["v1"], mixed)
    shutil.copy(checkpoints["v2"] / "encoder.pt", mixed / "encoder.pt")  # same shapes, another run
    meta = json.loads((mixed / "checkpoint.json").read_text())
    assert meta["format"] == 3
    root = tmp_path / "bundles"
    for files, message in (("deleted", "missing 'files' (required in format 3)"),
                           (None, "'files' must be an object, got null")):
        if files == "deleted":
            meta.pop("files")
        else:
            meta["files"] = files
        (mixed / "checkpoint.json").write_text(json.dumps(meta))
        assert cli_main(["export", str(mixed), "--out", str(root), "--version", "mixed"]) == 2
        assert capsys.readouterr().err == f"shortlist export: error: {mixed / 'checkpoint.json'}: {message}\n"
    assert not root.exists()


def _meta_written(ckpt: Path, text: str | bytes) -> Path:
    path = ckpt / "checkpoint.json"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def test_a_checkpoint_json_that_is_not_one_exits_2_naming_it_without_a_traceback(checkpoints, tmp_path, capsys):
    """Audit s14 L4: nested 200,000 deep it was a RecursionError traceback, a list an AttributeError
    one, bad JSON and bytes that are not UTF-8 did not name the file."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints["v1"], ckpt)
    good = json.loads((ckpt / "checkpoint.json").read_text())
    path = ckpt / "checkpoint.json"
    cases = [("[" * 200_000 + "]" * 200_000, "not JSON: depth limit exceeded: line 1 column 1026 (char 1025)"),
             ("[1, 2]", "must be a JSON object, got a list"),
             ('{"format": 3, \n', "not JSON: unexpected end of data: line 2 column 1 (char 15)"),
             (b'{"format": 3,\n "text_field": "\xff"}', None),
             (json.dumps({**good, "format": True}), "checkpoint format True, this shortlist reads 1, 2, 3"),
             (json.dumps({**good, "dim": "32"}), "'dim' must be an integer >= 1, got a string"),
             (json.dumps({**good, "num_labels": 0}), "'num_labels' must be an integer >= 1, got the number 0"),
             (json.dumps({**good, "scoring": []}), "'scoring' must be an object, got a list"),
             (json.dumps({**good, "config": None}), "'config' must be an object, got null"),
             (json.dumps({k: v for k, v in good.items() if k != "vocab_size"}),
              "missing 'vocab_size' (required in format 3)"),
             (json.dumps({**good, "hnsw": {**good["hnsw"], "M": "24"}}),
              "invalid 'hnsw': hnsw.M: Input should be a valid integer")]
    for text, message in cases:
        _meta_written(ckpt, text)
        assert cli_main(["export", str(ckpt), "--out", str(tmp_path / "bundles")]) == 2
        err = capsys.readouterr().err
        if message is None:  # not UTF-8: named by line and column
            message = "not UTF-8: byte 0xff at column 17"
            assert err == f"shortlist export: error: {path}:2: {message}\n"
        else:
            assert err == f"shortlist export: error: {path}: {message}\n"
    path.unlink()
    os.mkfifo(path)  # would block a plain open() until a writer comes
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: a FIFO, not a regular file"):
        Checkpoint.load(ckpt)
    path.unlink()
    path.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: a symlink, not followed"):
        Checkpoint.load(ckpt)
    assert not (tmp_path / "bundles").exists()


def test_checkpoint_json_is_read_up_to_its_size_limit(checkpoints, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints["v1"], ckpt)
    text = (ckpt / "checkpoint.json").read_text()
    _meta_written(ckpt, text + " " * (MAX_META_BYTES - len(text)))  # at the limit (trailing blanks are JSON)
    assert Checkpoint.load(ckpt).seed == 1
    path = _meta_written(ckpt, text + " " * (MAX_META_BYTES + 1 - len(text)))
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: {MAX_META_BYTES + 1} bytes, more than the limit "
                                         f"of {MAX_META_BYTES}"):
        Checkpoint.load(ckpt)
    assert Checkpoint.load(ckpt, max_meta_bytes=MAX_META_BYTES + 1).seed == 1


def test_a_checkpoint_from_before_checksums_loads_and_a_file_of_other_sizes_exits_2(checkpoints, tmp_path, capsys,
                                                                                   caplog):
    old = tmp_path / "ckpt"
    shutil.copytree(checkpoints["v1"], old)
    _saved_before_checksums(old)
    with caplog.at_level(logging.INFO, logger="shortlist.training"):
        assert Checkpoint.load(old).seed == 1
    assert f"{old}: saved before checkpoints recorded checksums: its files are not verified" in caplog.text
    # What the in-place save of old left after a kill: a new run's encoder of another vocabulary.
    state = torch.load(old / "encoder.pt", weights_only=True)
    vocab, dim = state["embedding"].shape
    torch.save({**state, "embedding": state["embedding"][:-7]}, old / "encoder.pt")
    assert cli_main(["export", str(old), "--out", str(tmp_path / "bundles")]) == 2
    assert capsys.readouterr().err == (
        f"shortlist export: error: {old / 'encoder.pt'}: embedding has shape ({vocab - 7}, {dim}), checkpoint.json "
        f"says ({vocab}, {dim}) (vocab_size {vocab}, dim {dim}): not this checkpoint's\n")
    (old / "encoder.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"encoder\.pt: cannot read the encoder: "):
        Checkpoint.load(old)


def test_killed_export_never_leaves_a_bundle_under_its_final_name(checkpoints, tmp_path):
    root = tmp_path / "bundles"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shortlist.cli", "export", str(checkpoints["v1"]), "--out", str(root),
         "--version", "vkill"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(root.glob(".staging-vkill-*")) and proc.poll() is None:
        time.sleep(0.005)
    assert proc.poll() is None, "export finished before it could be interrupted"
    proc.kill()
    proc.wait(timeout=30)
    assert not (root / "vkill").exists()
    with pytest.raises(BundleError, match="no bundle"):
        newest_version(root)  # the leftover staging directory is never mistaken for a bundle
    assert any(root.glob(".staging-vkill-*"))
    export_checkpoint(checkpoints["v1"], root, "vkill")
    assert Predictor.load(root / "vkill").version == "vkill"
    assert sorted(p.name for p in root.iterdir()) == ["vkill"]  # the dead export's staging swept before the write


def test_export_rejects_bad_version_names(checkpoints, tmp_path):
    for bad in ("../escape", "a/b", ".hidden", "x" * 65, "v 1"):
        with pytest.raises(BundleError, match="invalid bundle version"):
            export_checkpoint(checkpoints["v1"], tmp_path, bad)


def test_cli_eval_json_reports_metrics_far_above_chance(bundle_root, synthetic_data):
    out = subprocess.run(
        [sys.executable, "-m", "shortlist.cli", "eval", str(bundle_root / "v1"), "--data", str(synthetic_data),
         "--json"],
        capture_output=True, text=True, check=True, timeout=120,
    )
    result = json.loads(out.stdout)
    for key in ("P@1", "P@3", "P@5", "nDCG@5", "PSP@1", "PSP@3", "PSP@5", "recall@shortlist", "queries_per_s"):
        assert key in result
    assert result["documents"] == 300
    # 300 labels: chance P@1 is well under 1%; a trained model is far above it.
    assert result["P@1"] > 30.0
    assert 0 < result["recall@shortlist"] <= 100.0


def test_eval_reports_a_clear_error_for_a_missing_split(bundle_root, synthetic_data, tmp_path):
    shutil.copy(synthetic_data / "lbl.json.gz", tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "shortlist.cli", "eval", str(bundle_root / "v1"), "--data", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "tst" in out.stderr


def test_served_ranking_tracks_exact_scoring(bundle_root, synthetic_data):
    """The ANN shortlist costs little: top-1 agrees with brute force on nearly every test text."""
    from training.data import load_split

    predictor = Predictor.load(bundle_root / "v1")
    texts = load_split(synthetic_data, "tst").texts[:200]
    ann_ids, ann_scores = predictor.predict_ids(texts, k=5)
    exact_ids, exact_scores = predictor.predict_exact_ids(texts, k=5)
    assert np.mean(ann_ids[:, 0] == exact_ids[:, 0]) >= 0.9
    same = ann_ids[:, 0] == exact_ids[:, 0]
    assert np.allclose(ann_scores[same, 0], exact_scores[same, 0], atol=1e-5)


def test_what_training_tuned_is_what_the_bundle_serves(checkpoints, bundle_root, synthetic_data):
    """The scoring was tuned on the indices the bundle ships, through the engine's candidate code:
    the bundle answers the validation documents with the metrics training recorded."""
    from service.engine.metrics import ranking_metrics
    from training.config import TrainConfig
    from training.dataset import TrainingSet

    ckpt = Checkpoint.load(checkpoints["v1"])
    for name in ("hnsw_w.bin", "hnsw_mu.bin"):
        assert sha256_file(checkpoints["v1"] / name) == sha256_file(bundle_root / "v1" / name)
    data = TrainingSet.load(synthetic_data, TrainConfig.tiny(), "title", np.random.default_rng(ckpt.seed))
    predictor = Predictor.load(bundle_root / "v1")
    own = data.own_labels()
    ids, _ = predictor.predict_ids(data.val.texts, k=5, exclude=[[o] if o >= 0 else [] for o in own])
    served = ranking_metrics(ids, data.truths(data.val), (1, 5))
    for name in ("P@1", "P@5", "PSP@5"):
        assert served[name] == pytest.approx(ckpt.metrics["validation"][name], abs=1e-3)


def test_a_checkpoint_from_before_the_indices_were_trained_still_exports(checkpoints, tmp_path):
    old = tmp_path / "ckpt"
    shutil.copytree(checkpoints["v1"], old)
    meta = json.loads((old / "checkpoint.json").read_text())
    del meta["hnsw"], meta["files"]
    meta["format"] = 1
    (old / "checkpoint.json").write_text(json.dumps(meta))
    for name in ("hnsw_w.bin", "hnsw_mu.bin"):
        (old / name).unlink()
    bundle = export_checkpoint(old, tmp_path / "bundles", "old")
    assert json.loads((bundle / MANIFEST).read_text())["hnsw"]["M"] == 24
    assert Predictor.load(bundle).predict_ids(["anything"], k=3)[0].shape == (1, 3)


def _own_label_data(synthetic_data, tmp_path, predictor):
    """A copy of the data whose even test documents carry the uid of their best label."""
    from training.data import load_split

    data = tmp_path / "own"
    data.mkdir()
    for name in ("trn.json.gz", "lbl.json.gz"):
        shutil.copy(synthetic_data / name, data / name)
    docs = load_split(synthetic_data, "tst")
    texts = docs.texts[:40]
    top = predictor.predict_ids(texts, k=1)[0][:, 0]
    own = [int(top[i]) if i % 2 == 0 else -1 for i in range(len(texts))]
    with (data / "tst.jsonl").open("w") as f:
        for i, text in enumerate(texts):
            uid = predictor.bundle.labels.uids[own[i]] if own[i] >= 0 else f"doc{i}"
            f.write(json.dumps({"uid": uid, "title": text, "content": "", "target_ind": docs.targets[i]}) + "\n")
    return data, texts, [d for d in docs.targets[:40]], own


def test_eval_leaves_own_labels_or_a_filter_files_pairs_out_for_both_scorers(bundle_root, synthetic_data, tmp_path):
    from model_export.evaluate import evaluate_bundle
    from service.engine.metrics import ranking_metrics

    predictor = Predictor.load(bundle_root / "v1")
    data, texts, truths, own = _own_label_data(synthetic_data, tmp_path, predictor)
    pairs = tmp_path / "filter.txt"
    pairs.write_text("".join(f"{i} {o}\n" for i, o in enumerate(own) if o >= 0))
    exclude = [[o] if o >= 0 else [] for o in own]
    kept = [[t for t in truth if t != o] for truth, o in zip(truths, own, strict=True)]
    for scorer, predict in (("alpha", predictor.predict_ids), ("tree", predictor.predict_tree_ids)):
        plain = evaluate_bundle(bundle_root / "v1", data, scorer=scorer, predictor=predictor)
        by_uid = evaluate_bundle(bundle_root / "v1", data, scorer=scorer, protocol="own", predictor=predictor)
        by_file = evaluate_bundle(bundle_root / "v1", data, scorer=scorer, protocol=str(pairs), predictor=predictor)
        assert (plain["protocol"], by_uid["protocol"], by_file["protocol"]) == ("plain", "own", str(pairs))
        assert plain["filtered_pairs"] == 0 and by_uid["filtered_pairs"] == by_file["filtered_pairs"] == 20
        expected = ranking_metrics(predict(texts, k=5, exclude=exclude)[0], kept, (1, 3, 5))
        for name in ("P@1", "P@5"):
            assert by_uid[name] == by_file[name] == pytest.approx(expected[name])
        assert by_uid["P@1"] != plain["P@1"]
    out = subprocess.run([sys.executable, "-m", "shortlist.cli", "eval", str(bundle_root / "v1"), "--data", str(data),
                          "--filter", "own", "--json"], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout)["protocol"] == "own"
    pairs.write_text("0 1\n3 x\n")
    out = subprocess.run([sys.executable, "-m", "shortlist.cli", "eval", str(bundle_root / "v1"), "--data", str(data),
                          "--filter", str(pairs)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "filter.txt:2: expected two non-negative integers" in out.stderr


def _eval_cli(capsys: pytest.CaptureFixture[str], bundle: object, data: object, *extra: str) -> tuple[int, str, str]:
    from shortlist.cli import main

    code = main(["eval", str(bundle), "--data", str(data), "--json", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_eval_limit_keeps_the_filter_files_pairs_of_the_documents_it_evaluates(bundle_root, synthetic_data, tmp_path,
                                                                               capsys):
    # A filter file names rows of the whole split: pairs past --limit are of documents not evaluated.
    limit, pairs = 50, tmp_path / "f.txt"
    pairs.write_text(f"0 1\n{limit - 1} 2\n{limit} 1\n{limit - 1} 2\n")  # the last pair repeated: counted once
    code, out, err = _eval_cli(capsys, bundle_root / "v1", synthetic_data, "--limit", str(limit), "--filter",
                               str(pairs))
    assert code == 0, err
    result = json.loads(out)
    assert result["documents"] == limit and result["filtered_pairs"] == 2


def test_eval_filter_rows_are_checked_at_and_past_the_split_and_the_bundle(bundle_root, synthetic_data, tmp_path,
                                                                           capsys):
    from training.data import load_split

    docs = len(load_split(synthetic_data, "tst"))
    labels = Predictor.load(bundle_root / "v1").num_labels
    pairs = tmp_path / "f.txt"
    pairs.write_text(f"{docs - 1} {labels - 1}\n")  # the last row of each: accepted
    code, out, err = _eval_cli(capsys, bundle_root / "v1", synthetic_data, "--filter", str(pairs))
    assert code == 0 and json.loads(out)["filtered_pairs"] == 1, err
    for line, message, limit in [
        (f"0 {labels}", f"f.txt:2: label row {labels} out of range (the bundle has {labels} labels)", []),
        (f"0 {labels}", f"f.txt:2: label row {labels} out of range (the bundle has {labels} labels)", ["--limit", "5"]),
        (f"{docs} 0", f"f.txt:2: test row {docs} out of range (the split has {docs} documents)", []),
        (f"{docs} 0", f"f.txt:2: test row {docs} out of range (the split has {docs} documents)", ["--limit", "5"]),
    ]:
        pairs.write_text(f"0 1\n{line}\n")
        code, _, err = _eval_cli(capsys, bundle_root / "v1", synthetic_data, "--filter", str(pairs), *limit)
        assert code == 2 and err.strip().endswith(message), (line, limit, err)
        assert "None" not in err and "exclude[" not in err


def _relabelled(synthetic_data: Path, out: Path, order: list[int] | None = None, drop_tail: int = 0,
                no_targets: bool = False) -> Path:
    """A copy of the data with its label rows in `order` (targets remapped: the same dataset), the
    last `drop_tail` labels removed (and the targets naming them), or every test target removed."""
    import gzip

    out.mkdir()
    labels = [json.loads(line) for line in gzip.open(synthetic_data / "lbl.json.gz", "rt")]
    order = order or list(range(len(labels) - drop_tail))
    new_row = {old: new for new, old in enumerate(order)}
    for split in ("trn", "tst"):
        with gzip.open(synthetic_data / f"{split}.json.gz", "rt") as f, (out / f"{split}.jsonl").open("w") as g:
            for line in f:
                doc = json.loads(line)
                keep = [] if no_targets and split == "tst" else [t for t in doc["target_ind"] if t in new_row]
                doc["target_ind"], doc["target_rel"] = [new_row[t] for t in keep], [1.0] * len(keep)
                g.write(json.dumps(doc) + "\n")
    with (out / "lbl.jsonl").open("w") as g:
        g.writelines(json.dumps(labels[old]) + "\n" for old in order)
    return out


def test_eval_refuses_data_whose_label_rows_are_not_the_bundles(bundle_root, synthetic_data, tmp_path, capsys):
    """A data set with its label rows in another order is the same data, but its target rows name
    other rows of the bundle: it was scored silently (P@1 82.0 -> 2.0 on debian-tags)."""
    labels = 300
    swapped = _relabelled(synthetic_data, tmp_path / "swapped", order=[1, 0, *range(2, labels)])
    code, out, err = _eval_cli(capsys, bundle_root / "v1", swapped)
    assert code == 2 and out == ""
    assert f"{swapped / 'lbl.jsonl'}: label row 0 (uid " in err
    assert "is the bundle's row 1: the data's labels are not the bundle v1's, row for row" in err
    # The bundle's first rows (a bundle with labels added since has more): accepted and measured.
    prefix = _relabelled(synthetic_data, tmp_path / "prefix", drop_tail=1)
    code, out, err = _eval_cli(capsys, bundle_root / "v1", prefix)
    assert code == 0 and json.loads(out)["P@1"] > 30.0, err
    # A label file cut short whose documents still name its missing rows (rows of the bundle):
    # refused as training refuses it, not scored against labels the data does not have.
    cut = tmp_path / "cut"
    shutil.copytree(prefix, cut)
    docs = [json.loads(line) for line in (cut / "tst.jsonl").read_text().splitlines()]
    docs[3]["target_ind"], docs[3]["target_rel"] = [labels - 1], [1.0]
    (cut / "tst.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    code, out, err = _eval_cli(capsys, bundle_root / "v1", cut)
    assert code == 2 and f"tst.jsonl:4: target_ind {labels - 1} out of range (the label file has {labels - 1} " in err


def test_eval_refuses_a_split_in_which_no_document_has_a_label(bundle_root, synthetic_data, tmp_path, capsys):
    data = _relabelled(synthetic_data, tmp_path / "unlabelled", no_targets=True)
    code, out, err = _eval_cli(capsys, bundle_root / "v1", data)
    assert code == 2 and err.strip().endswith(f"{data / 'tst.jsonl'}: no document has a label: every metric would be 0")
    code, out, _ = _eval_cli(capsys, bundle_root / "v1", synthetic_data)
    assert code == 0 and json.loads(out)["documents_without_labels"] == 0


def test_eval_of_trn_with_a_limit_takes_propensities_from_the_whole_trn_split(bundle_root, synthetic_data, tmp_path):
    """PSP@k's propensities come from trn: `--split trn --limit 50` took them from the 50 documents
    evaluated (debian-tags PSP@1 67.47 where the same documents as tst scored 56.73)."""
    import gzip

    from model_export.evaluate import evaluate_bundle

    data = tmp_path / "first50"
    data.mkdir()
    for name in ("trn.json.gz", "lbl.json.gz"):
        shutil.copy(synthetic_data / name, data / name)
    with gzip.open(synthetic_data / "trn.json.gz", "rt") as f:
        (data / "tst.jsonl").write_text("".join(line for _, line in zip(range(50), f, strict=False)))
    limited = evaluate_bundle(bundle_root / "v1", synthetic_data, split="trn", limit=50)
    as_tst = evaluate_bundle(bundle_root / "v1", data, split="tst")
    assert limited["documents"] == as_tst["documents"] == 50
    for metric in ("P@1", "PSP@1", "PSP@3", "PSP@5"):
        assert limited[metric] == pytest.approx(as_tst[metric]), metric


def test_eval_counts_the_documents_the_api_would_refuse_as_too_long(bundle_root, synthetic_data, monkeypatch):
    """eval scores every text; POST /v1/predict refuses those past MAX_TEXT_CHARS (422): the count
    says how much of the figure no client could have been served."""
    from model_export.evaluate import evaluate_bundle
    from training.data import load_split

    texts = load_split(synthetic_data, "tst").texts
    assert evaluate_bundle(bundle_root / "v1", synthetic_data)["documents_past_max_text_chars"] == sum(
        len(t) > 2000 for t in texts)
    for edge in ("1", "16777216"):  # the setting's bounds are accepted
        monkeypatch.setenv("SHORTLIST_MAX_TEXT_CHARS", edge)
        assert evaluate_bundle(bundle_root / "v1", synthetic_data, limit=5)["max_text_chars"] == int(edge)
    monkeypatch.setenv("SHORTLIST_MAX_TEXT_CHARS", "40")
    monkeypatch.setenv("SHORTLIST_PORT", "99999")  # a setting eval does not use: no reason to refuse
    result = evaluate_bundle(bundle_root / "v1", synthetic_data)
    assert result["max_text_chars"] == 40
    assert result["documents_past_max_text_chars"] == sum(len(t) > 40 for t in texts) > 0


def _with_tst_texts(synthetic_data: Path, folder: Path, edit: dict[int, str]) -> Path:
    """A copy of the data whose tst documents at the rows of `edit` have those titles."""
    import gzip

    shutil.copytree(synthetic_data, folder)
    rows = [json.loads(line) for line in gzip.open(folder / "tst.json.gz", "rt")]
    for row, title in edit.items():
        rows[row]["title"] = title
    with gzip.open(folder / "tst.json.gz", "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return folder


def test_eval_counts_every_text_the_api_refuses_by_reason(bundle_root, synthetic_data, tmp_path, monkeypatch,
                                                          capsys):
    """Audit 7 F8: empty, blank and past-MAX_NORMALIZED_CHARS texts (422 over HTTP) were scored
    without a word (170 of 300, `documents_past_max_text_chars: 0`). Each is counted by the API's
    own validator, by reason, and still scored (the figure stays comparable)."""
    from model_export.evaluate import evaluate_bundle
    from service.api.schemas import RequestModels
    from service.api.settings import load_settings

    ligatures = "\ufdfa" * 300  # 300 characters, 5,400 after NFKC: past the default 4,000 only in that form
    edit = {0: "", 1: "", 2: "   ", 3: "\u200b\u00a0", 4: "a" + ligatures, 5: "b" + ligatures, 6: "c" * 2001}
    data = _with_tst_texts(synthetic_data, tmp_path / "data", edit)
    result = evaluate_bundle(bundle_root / "v1", data)
    assert {k: result[k] for k in ("documents_blank_text", "documents_past_max_text_chars",
                                   "documents_past_max_normalized_chars", "documents_refused_by_api",
                                   "max_normalized_chars", "documents")} == {
        "documents_blank_text": 4, "documents_past_max_text_chars": 1, "documents_past_max_normalized_chars": 2,
        "documents_refused_by_api": 7, "max_normalized_chars": 4000, "documents": 300}
    # The same texts as POST /v1/predict's body: refused exactly these.
    predict = RequestModels(load_settings()).predict
    refused = [row for row, title in edit.items() if not _validates(predict, title)]
    assert refused == list(edit)
    monkeypatch.setenv("SHORTLIST_MAX_NORMALIZED_CHARS", "6000")  # honoured as SHORTLIST_MAX_TEXT_CHARS is
    assert evaluate_bundle(bundle_root / "v1", data, limit=10)["documents_past_max_normalized_chars"] == 0
    monkeypatch.setenv("SHORTLIST_MAX_NORMALIZED_CHARS", "1999")  # below MAX_TEXT_CHARS: serve refuses it
    with pytest.raises(ValueError, match="SHORTLIST_MAX_NORMALIZED_CHARS=1999 is below SHORTLIST_MAX_TEXT_CHARS"):
        evaluate_bundle(bundle_root / "v1", data, limit=10)
    monkeypatch.delenv("SHORTLIST_MAX_NORMALIZED_CHARS")
    assert cli_main(["eval", str(bundle_root / "v1"), "--data", str(data)]) == 0
    assert ("7 documents have a text the API refuses (422): 4 empty or blank, 1 longer than MAX_TEXT_CHARS "
            "(2000), 2 longer than MAX_NORMALIZED_CHARS (4000) after NFKC; scored here all the same"
            ) in capsys.readouterr().out


def _validates(model: type, text: str) -> bool:
    from pydantic import ValidationError

    try:
        model.model_validate({"text": text})
    except ValidationError:
        return False
    return True


def test_eval_says_when_its_filter_left_nothing_out(bundle_root, synthetic_data, capsys):
    """Audit 7 I6: `--filter own` on data where no document is a label scored as plain, said only
    by `filtered_pairs: 0` in --json."""
    assert cli_main(["eval", str(bundle_root / "v1"), "--data", str(synthetic_data), "--filter", "own",
                     "--limit", "20"]) == 0
    assert "protocol own left nothing out (no document uid is a label uid): scored as plain" in capsys.readouterr().out


@pytest.mark.parametrize(("value", "why"), [
    ("2k", "valid integer"), ("0", "greater than or equal to 1"), ("16777217", "less than or equal to 16777216"),
])
def test_eval_refuses_a_max_text_chars_serve_would_refuse_naming_it(bundle_root, synthetic_data, value, why):
    """The count is of the limit the service would run with: a value `shortlist serve` refuses
    is refused here too (exit 2 naming the variable), not read as the default."""
    env = {**os.environ, "SHORTLIST_MAX_TEXT_CHARS": value}
    out = subprocess.run([sys.executable, "-m", "shortlist.cli", "eval", str(bundle_root / "v1"), "--data",
                          str(synthetic_data)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr
    assert f"SHORTLIST_MAX_TEXT_CHARS={value!r}" in out.stderr and why in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
