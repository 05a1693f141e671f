"""The trained model: what `shortlist train` writes and `shortlist export` turns into a bundle.

Layout of CKPT_DIR (each part saved by the object that fitted it):
  checkpoint.json        format, dims, the scoring (service.engine.schema.Scoring) and the
                         indices' HNSW parameters, hyper-parameters, data fingerprint, metrics
  tokenizer.json         service.engine.tokenizer.Tokenizer
  labels.jsonl           service.engine.labels.LabelTable (row i = label i)
  encoder.pt             state_dict of training.encoder.SiameseEncoder
  classifiers.npy, classifier_bias.npy   training.classifiers.OneVsAll
  centroids.npy          training.centroids.Centroids
  hnsw_w.bin, hnsw_mu.bin   the bundle's indices (service.engine.index), the scoring tuned on them,
                         with hnsw_w_projection.npy, hnsw_mu_projection.npy when hnsw.projection_dim > 0
  token_shortlist.npz    optional: training.token_shortlist (the table and its chosen form)
  tree.npz               optional: training.tree_train.AdversarialTree
  validation.jsonl       optional: held-out {"text", "target_ind"[, "target_weight"]} rows for a
                         bundle's quality gate (service.engine.validation_rows)
checkpoint.json's "files" holds the sha256 of every other file; a load refuses a file missing,
changed or not listed (a folder of files from several runs, or edited), naming it. From format 3
on "files" is required (a checkpoint.json without it is refused, never loaded unverified);
format-2 checkpoints saved before the checksums (2026-11-27) load unverified, which the log says.
Format 1 (before the indices were built in training) is read too; export builds its indices.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import torch
from pydantic import ValidationError

from service.engine.index import VectorIndex
from service.engine.jsonlines import iter_rows, json_kind, os_reason, strict_dumps
from service.engine.labels import LabelTable
from service.engine.lexical import TokenShortlist
from service.engine.schema import HNSW_MU, HNSW_W, HnswParams, Scoring, sha256_file
from service.engine.small_files import read_small_file
from service.engine.tokenizer import Tokenizer
from training.centroids import CENTROIDS_FILE, Centroids
from training.classifiers import BIAS_FILE, WEIGHTS_FILE, OneVsAll
from training.encoder import SiameseEncoder
from training.files import naming
from training.token_shortlist import load_table, save_table
from training.tree_train import AdversarialTree

# 3: "files" (the checksums) required; 2: the indices built in training, "files" optional
# (saved before the checksums, or with them); 1: no indices.
CHECKPOINT_FORMAT = 3
READABLE_FORMATS = (1, 2, 3)
# checkpoint.json's size limit (a save writes ~10 KB): read whole, so a file of gigabytes (or
# /dev/zero behind the name) is refused before it is read.
MAX_META_BYTES = 16 << 20
# checkpoint.json's fields a load uses: their JSON kind and the first format that requires them
# (None: optional in every format).
_META_FIELDS: dict[str, tuple[type, int | None]] = {
    "dim": (int, 1), "num_labels": (int, 1), "vocab_size": (int, 1), "scoring": (dict, 1), "hnsw": (dict, 2),
    "files": (dict, 3), "text_field": (str, None), "config": (dict, None), "fingerprint": (dict, None),
    "metrics": (dict, None)}
META, TOKENIZER, LABELS, ENCODER, VALIDATION = (
    "checkpoint.json", "tokenizer.json", "labels.jsonl", "encoder.pt", "validation.jsonl")
# Format 1's bundle index parameters, which its export used.
_FORMAT1_HNSW = HnswParams(M=24, ef_construction=200, ef_search=50)
log = logging.getLogger("shortlist.training")


@dataclass
class Checkpoint:
    tokenizer: Tokenizer
    labels: LabelTable
    encoder: SiameseEncoder
    classifiers: OneVsAll
    centroids: Centroids
    scoring: Scoring
    hnsw: HnswParams
    indices: tuple[VectorIndex, VectorIndex] | None  # over [w, b] and mu; None: export builds them
    token_table: TokenShortlist | None = None
    tree: AdversarialTree | None = None
    text_field: str = "title"
    config: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    validation: list[dict[str, Any]] = field(default_factory=list)

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0))

    def save(self, out_dir: str | Path) -> Path:
        """Write the checkpoint to `out_dir` as a whole: into a staging folder beside it, then
        renamed into place. A save killed or failing half-way leaves a checkpoint already there as
        it was (written in place, it was lost, its checkpoint.json left beside new files). An
        existing `out_dir` must be a checkpoint or empty: it is replaced, never written into. A
        symlink `out_dir` is kept: the checkpoint it leads to is the one replaced (staged beside
        it, on its disk), as writing through the link would."""
        given, out = Path(out_dir), save_target(out_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.parent / f".{out.name}.saving-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            with naming(out):  # an error naming no file (a full disk) names the checkpoint
                self._write(staging)
            _replace_dir(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return given

    def _write(self, out: Path) -> None:
        out.mkdir()
        self.tokenizer.save(out / TOKENIZER)
        self.labels.save(out / LABELS)
        # Serialised in memory (V x D floats, ~200 MB at most), then written: torch's zip writer
        # turns a short write on a full disk into a RuntimeError, this write an OSError.
        encoded = io.BytesIO()
        torch.save(self.encoder.state_dict(), encoded)
        (out / ENCODER).write_bytes(encoded.getbuffer())
        self.classifiers.save(out)
        self.centroids.save(out)
        if self.indices is not None:
            self.indices[0].save(out / HNSW_W)  # with its projection file, if it has one
            self.indices[1].save(out / HNSW_MU)
        if self.token_table is not None:
            save_table(self.token_table, out)
        if self.tree is not None:
            self.tree.save(out)
        if self.validation:
            with (out / VALIDATION).open("w", encoding="utf-8") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in self.validation)
        meta = {"format": CHECKPOINT_FORMAT, "dim": self.encoder.dim, "num_labels": len(self.labels),
                "vocab_size": self.tokenizer.vocab_size, "scoring": self.scoring.model_dump(),
                "hnsw": self.hnsw.model_dump(), "text_field": self.text_field, "config": self.config,
                "fingerprint": self.fingerprint, "metrics": self.metrics,
                "files": {p.name: sha256_file(p) for p in sorted(out.iterdir())}}
        (out / META).write_text(strict_dumps(meta, META, indent=2), encoding="utf-8")

    @classmethod
    def load(cls, ckpt_dir: str | Path, max_meta_bytes: int = MAX_META_BYTES) -> Checkpoint:
        """The checkpoint at `ckpt_dir`, its files verified against checkpoint.json (checksums,
        shapes): ValueError naming the file that does not belong, never a half-read model."""
        ckpt = Path(ckpt_dir)
        meta = _read_meta(ckpt, max_meta_bytes)
        _verify_files(ckpt, meta.get("files"))
        scoring = _validated(ckpt, Scoring, meta, "scoring")
        hnsw = _validated(ckpt, HnswParams, meta, "hnsw") if "hnsw" in meta else _FORMAT1_HNSW
        indices = None
        if (ckpt / HNSW_W).is_file():
            indices = tuple(VectorIndex.load(ckpt / file, dim, meta["num_labels"], hnsw.ef_search, hnsw.projection_dim)
                            for file, dim in ((HNSW_W, meta["dim"] + 1), (HNSW_MU, meta["dim"])))
        validation = []
        if (ckpt / VALIDATION).is_file():
            validation = [row for _, row in iter_rows(ckpt / VALIDATION)]
        out = cls(
            tokenizer=Tokenizer.load(ckpt / TOKENIZER), labels=LabelTable.load(ckpt / LABELS),
            encoder=_load_encoder(ckpt / ENCODER, meta["vocab_size"], meta["dim"]),
            classifiers=OneVsAll.load(ckpt), centroids=Centroids.load(ckpt), scoring=scoring, hnsw=hnsw,
            indices=indices, token_table=load_table(ckpt, scoring.lexical_form), tree=AdversarialTree.load(ckpt),
            text_field=meta.get("text_field", meta.get("config", {}).get("text_field", "title")),
            config=meta.get("config", {}), fingerprint=meta.get("fingerprint", {}), metrics=meta.get("metrics", {}),
            validation=validation,
        )
        out._check_shapes(ckpt, meta)
        return out

    def _check_shapes(self, ckpt: Path, meta: dict[str, Any]) -> None:
        """The files agree with checkpoint.json's sizes (what a checkpoint without checksums can show)."""
        L, D = meta["num_labels"], meta["dim"]
        if self.tokenizer.vocab_size != meta["vocab_size"]:
            raise ValueError(f"{ckpt / TOKENIZER}: {self.tokenizer.vocab_size} tokens, {META} says "
                             f"{meta['vocab_size']}: not the tokenizer of this checkpoint")
        if len(self.labels) != L:
            raise ValueError(f"{ckpt / LABELS}: {len(self.labels)} labels, {META} says {L}")
        found = {WEIGHTS_FILE: self.classifiers.weights_, BIAS_FILE: self.classifiers.bias_,
                 CENTROIDS_FILE: self.centroids.vectors_}
        expected = {WEIGHTS_FILE: (L, D), BIAS_FILE: (L,), CENTROIDS_FILE: (L, D)}
        for name, shape in expected.items():
            if found[name].shape != shape:
                raise ValueError(f"{ckpt / name}: shape {found[name].shape}, expected {shape} ({L} labels, dim {D})")


def _read_meta(ckpt: Path, max_bytes: int) -> dict[str, Any]:
    """checkpoint.json of `ckpt`: at most `max_bytes`, JSON (orjson: nesting bounded without
    recursion) of a readable format, holding the fields the load uses, of their kinds; ValueError
    naming the file (and the line) otherwise."""
    path = ckpt / META
    try:
        data = read_small_file(path, max_bytes)  # a FIFO, a device or a symlink is refused, naming it
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"{ckpt}: not a checkpoint directory (no {META})") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {os_reason(exc)}") from None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ValueError(f"{path}:{line}: not UTF-8: byte 0x{data[exc.start]:02x} at column {column}") from None
    try:
        meta = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None  # orjson's message ends with the line and column
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: must be a JSON object, got {json_kind(meta)}")
    fmt = meta.get("format")
    if type(fmt) is not int or fmt not in READABLE_FORMATS:  # type(): true is not format 1
        raise ValueError(f"{path}: checkpoint format {fmt!r}, this shortlist reads "
                         f"{', '.join(map(str, READABLE_FORMATS))}")
    for name, (kind, required_from) in _META_FIELDS.items():
        if name not in meta:
            if required_from is not None and fmt >= required_from:
                raise ValueError(f"{path}: missing {name!r} (required in format {fmt})")
            continue
        value = meta[name]
        if name == "files" and value is None and fmt < required_from:
            continue  # format 2's "saved before checksums"
        if kind is int and (type(value) is not int or value < 1):
            raise ValueError(f"{path}: {name!r} must be an integer >= 1, got {json_kind(value)}")
        if kind is not int and not isinstance(value, kind):
            raise ValueError(f"{path}: {name!r} must be {'an object' if kind is dict else 'a string'}, got "
                             f"{json_kind(value)}")
    return meta


def _validated(ckpt: Path, model: type[Any], meta: dict[str, Any], name: str) -> Any:
    """checkpoint.json's `name` object as `model` (pydantic); ValueError naming the file otherwise."""
    try:
        return model.model_validate(meta[name], strict=True)  # never coerced, as a bundle's manifest
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, (name, *e['loc'])))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{ckpt / META}: invalid {name!r}: {problems}") from None


def _verify_files(ckpt: Path, files: Any) -> None:
    """Every file of `ckpt` but checkpoint.json is listed in `files` (name -> sha256, None: a
    format-2 save before checksums; _read_meta requires it from format 3) and has its checksum.
    Hashing reads every file once (debian-deps, 257 MB: 1.4 s)."""
    if files is None:
        log.info("%s: saved before checkpoints recorded checksums: its files are not verified", ckpt)
        return
    if not isinstance(files, dict) or not all(isinstance(v, str) and Path(k).name == k for k, v in files.items()):
        raise ValueError(f"{ckpt / META}: 'files' must map file names to sha256 checksums")
    t0, total = time.perf_counter(), 0
    for name, digest in files.items():
        path = ckpt / name
        if not path.is_file():
            raise ValueError(f"{path}: missing ({META} lists it): the checkpoint is incomplete")
        if sha256_file(path) != digest:
            raise ValueError(f"{path}: sha256 differs from {META}'s: the file changed after the checkpoint was "
                             "saved (edited, or written by another run)")
        total += path.stat().st_size
    strays = sorted(p.name for p in ckpt.iterdir() if p.name != META and p.name not in files)
    if strays:
        raise ValueError(f"{ckpt / strays[0]}: not listed in {META}: not written by the save that wrote it "
                         f"(remove it{' and ' + str(len(strays) - 1) + ' more' if len(strays) > 1 else ''})")
    log.info("%s: %d files verified (%.0f MB) in %.1fs", ckpt, len(files), total / 1e6, time.perf_counter() - t0)


def _load_encoder(path: Path, vocab_size: int, dim: int) -> SiameseEncoder:
    """The encoder of `path`, its tensors' shapes checked against checkpoint.json's sizes first
    (torch's own mismatch is a RuntimeError listing every parameter)."""
    encoder = SiameseEncoder(vocab_size, dim)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise ValueError(f"{path}: cannot read the encoder: {str(exc).splitlines()[0]}") from None
    expected = encoder.state_dict()
    if not isinstance(state, dict) or set(state) != set(expected):
        raise ValueError(f"{path}: not an encoder state (expected the tensors {', '.join(expected)})")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(f"{path}: {name} has shape {tuple(state[name].shape)}, {META} says "
                             f"{tuple(tensor.shape)} (vocab_size {vocab_size}, dim {dim}): not this checkpoint's")
    encoder.load_state_dict(state)
    return encoder.eval()


def save_target(out_dir: str | Path) -> Path:
    """The folder Checkpoint.save(out_dir) replaces (a symlink followed); ValueError for one it
    must not replace (a file, a folder that is not a checkpoint, a symlink loop)."""
    given = Path(out_dir)
    out = Path(os.path.realpath(given)) if given.is_symlink() else given
    via = f" ({given} leads to it)" if out != given else ""
    if out.is_symlink():  # realpath stops at a loop
        raise ValueError(f"{given}: a symlink that leads to no folder (a loop); give another --out")
    if out.exists() and not (out / META).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not a checkpoint (no {META}){via}; give another --out")
    return out


def check_save_target(out_dir: str | Path) -> None:
    """What save(out_dir) would refuse or fail to write, found before the hours of training it
    would have come after: save_target's refusals, a file in the way of its folders, and a folder
    nothing can be written in (read-only, no permission), tried by making and removing a folder in
    the nearest one that exists (nothing is left: folders on the way are made only by save)."""
    out = save_target(out_dir)
    nearest = next(p for p in (out.parent.absolute(), *out.parent.absolute().parents) if os.path.lexists(p))
    if not nearest.is_dir():
        raise ValueError(f"--out {out_dir}: {nearest} is not a directory")
    try:
        tempfile.TemporaryDirectory(dir=nearest, prefix=f".{out.name}.probe-").cleanup()
    except OSError as exc:
        raise ValueError(f"--out {out_dir}: cannot write in {nearest}: {os_reason(exc)}") from None


def _replace_dir(new: Path, out: Path) -> None:
    """`new` renamed to `out`; an `out` already there is moved aside first and deleted after (a
    kill between the two renames leaves both whole: `out`'s old one as .NAME.old-PID beside it)."""
    if not out.exists():
        new.rename(out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)
