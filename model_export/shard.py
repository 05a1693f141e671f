"""`shortlist shard`: a bundle's labels split into N shard bundles (service.engine.sharding).

Label l goes to shard l mod N (every shard gets its share of the head and of the tail), in
increasing order. Each shard is a complete, checksummed bundle over its labels: its rows of the
label table, classifiers, biases and centroids, HNSW indices built over them with the parent's
parameters and seed, the token shortlist as the parent serves it restricted to its labels (per
token, its labels among the parent's first k_tok slots, packed: k_tok is the most a row holds,
so N shards do not each pay the parent's [V, M] table; the overflow rows of labels added after
training alike), its retired labels, the parent's scoring with k_head the number of the parent's
head labels it holds and k_tok its own, canaries answered by the shard itself, `shard` in the
manifest (parent version, parent fingerprint = sha256 of its manifest.json, index, count) and
shard_labels.npy (each row's parent label id). The tokenizer and encoder files are the parent's,
byte for byte (hard links where the filesystem allows). The tree scorer is not sharded (the tree's
beam search runs over one tree of all labels): shards carry no tree.npz. Each shard's
validation.jsonl holds every validation row of the parent, its truths restricted to the shard's
labels, for the sharded service's quality gate.

The shards are written into a staging directory renamed to ROOT/VERSION when all are written and
load as served, so a crash never leaves a partial shard set under its final name.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from service.engine import canary, schema, store
from service.engine.bundle import Bundle
from service.engine.index import build_label_indices
from service.engine.labels import LabelTable
from service.engine.predictor import Predictor
from service.engine.sharding import ShardedPredictor, shard_dir_name

log = logging.getLogger("shortlist.shard")
# The parent's files every shard holds unchanged.
SHARED_FILES = (schema.ENCODER, schema.ENCODER_DATA, schema.TOKENIZER)


def shard_bundle(bundle_dir: str | Path, count: int, root: str | Path) -> Path:
    """Write ROOT/VERSION/shard-I-of-N for I < count from the bundle at `bundle_dir` (VERSION:
    the parent's); returns ROOT/VERSION once every shard loads as served."""
    if count < 1:
        raise ValueError(f"--shards must be >= 1, got {count}")
    t0 = time.perf_counter()
    parent = Predictor.load(bundle_dir).bundle  # every check the service runs, canaries included
    if parent.manifest.shard is not None:
        raise ValueError(f"{parent.path} is a shard already")
    if count > parent.manifest.num_labels:
        raise ValueError(f"{count} shards for {parent.manifest.num_labels} labels")
    version = parent.version
    staging = store.staging_dir(Path(root), version)
    try:
        for index in range(count):
            _write_shard(parent, index, count, staging / shard_dir_name(index, count))
            log.info("shard %d of %d written (%.1fs)", index + 1, count, time.perf_counter() - t0)
        final = store.finalize_bundle(staging, Path(root), version)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        parent.close()
    ShardedPredictor.load(final)  # what was written must load as the sharded service loads it
    log.info("%d shards of %s written to %s and checked in %.1fs", count, version, final, time.perf_counter() - t0)
    return final


def _write_shard(parent: Bundle, index: int, count: int, out: Path) -> None:
    m = parent.manifest
    ids = np.arange(index, m.num_labels, count, dtype=np.int64)
    out.mkdir()
    for name in SHARED_FILES:
        if name in m.files:
            _link_or_copy(parent.path / name, out / name)
    labels = parent.labels
    LabelTable([labels.uids[i] for i in ids], [labels.titles[i] for i in ids]).save(out / schema.LABELS)
    b = np.ascontiguousarray(parent.classifier_bias[ids])
    arrays = {schema.CLASSIFIERS: parent.classifiers[ids], schema.CLASSIFIER_BIAS: b,
              schema.CENTROIDS: parent.centroids[ids], schema.SHARD_LABELS: ids,
              schema.CLASSIFIER_SCALES: parent.classifier_scales, schema.CENTROID_SCALES: parent.centroid_scales}
    for name, array in arrays.items():
        if array is not None:
            np.save(out / name, np.ascontiguousarray(array if name not in schema.SCALES_FILES.values() else array[ids]))
    seed = int(m.training_config.get("seed", 0))
    index_w, index_mu = build_label_indices(parent.vector_rows(schema.CLASSIFIERS, ids), b,
                                            parent.vector_rows(schema.CENTROIDS, ids), m.hnsw, seed)
    index_w.save(out / schema.HNSW_W)
    index_mu.save(out / schema.HNSW_MU)
    _write_validation(parent, ids, out)
    k_tok = _write_token_table(parent, ids, out)
    if parent.retired is not None and parent.retired[ids].any():
        np.save(out / schema.RETIRED_LABELS, np.flatnonzero(parent.retired[ids]).astype(np.int32))
    fields = _manifest_fields(parent, ids, index, count, out.name)
    fields["scoring"]["shortlist"]["k_tok"] = k_tok
    store.write_manifest(out, fields)
    staged = Bundle.open(out, staged=True)
    try:
        texts = [c.text for c in m.canary] or [labels.titles[i] for i in ids[:3]]
        fields["canary"] = [c.model_dump() for c in canary.record(Predictor(staged), texts)]
    finally:
        staged.close()
    store.write_manifest(out, fields)


def _write_validation(parent: Bundle, ids: np.ndarray, out: Path) -> None:
    """The parent's validation rows, every one, their truths (and weights) restricted to the shard's
    labels (its own ids): the sharded service's quality gate merges them back
    (service.engine.sharding.GateRows)."""
    rows = parent.validation_rows()
    if not rows:
        return
    local = np.full(parent.manifest.num_labels, -1, dtype=np.int64)
    local[ids] = np.arange(len(ids))
    with (out / schema.VALIDATION).open("w", encoding="utf-8") as f:
        for row in rows:
            mine = [j for j, t in enumerate(row["target_ind"]) if local[t] >= 0]
            out_row = {"text": row["text"], "target_ind": [int(local[row["target_ind"][j]]) for j in mine]}
            if "target_weight" in row:
                out_row["target_weight"] = [row["target_weight"][j] for j in mine]
            f.write(json.dumps(out_row, ensure_ascii=False) + "\n")


def _write_token_table(parent: Bundle, ids: np.ndarray, out: Path) -> int:
    """The parent's token rows as this shard serves them: per token, the shard's labels among the
    parent's first k_tok slots, in slot order, packed to the left (by their row here; the width is
    the most any row holds, not the parent's), and the overflow rows (labels added after training)
    packed the same way. Returns the shard's k_tok (0: no token table)."""
    table, k_tok = parent.token_table(), parent.manifest.scoring.shortlist.k_tok
    if table is None or not k_tok:
        return 0
    local = np.full(parent.manifest.num_labels, -1, dtype=np.int32)
    local[ids] = np.arange(len(ids), dtype=np.int32)
    rows, weights = _own_slots(local, table.labels[:, :k_tok], None if table.weights is None else
                               table.weights[:, :k_tok])
    np.save(out / schema.TOKEN_SHORTLIST, rows)
    form_files = schema.LEXICAL_FILES[parent.manifest.scoring.lexical_form]
    if weights is not None:
        np.save(out / form_files[0], weights)
    if table.bias is not None and len(form_files) > 1:
        np.save(out / form_files[1], np.ascontiguousarray(table.bias[ids], dtype=np.float32))
    if table.overflow is not None:
        overflow, overflow_weights = _own_slots(local, table.overflow, table.overflow_weights)
        if (overflow >= 0).any():
            np.save(out / schema.TOKEN_OVERFLOW, overflow)
            if overflow_weights is not None:
                np.save(out / schema.TOKEN_OVERFLOW_WEIGHTS, overflow_weights)
    return rows.shape[1]


def _own_slots(local: np.ndarray, labels: np.ndarray, weights: np.ndarray | None
               ) -> tuple[np.ndarray, np.ndarray | None]:
    """labels [V, W] (parent ids, -1 empty) -> this shard's ids in each row's order, packed to the
    left, -1 padded, [V, w] with w the largest count in a row (at least 1); weights alike (0 in
    the empty slots)."""
    mapped = np.where(labels >= 0, local[np.maximum(labels, 0)], -1).astype(np.int32)
    order = np.argsort(mapped < 0, axis=1, kind="stable")  # own slots first, in the row's order
    width = max(1, int((mapped >= 0).sum(axis=1).max(initial=0)))
    rows = np.ascontiguousarray(np.take_along_axis(mapped, order, axis=1)[:, :width])
    if weights is None:
        return rows, None
    packed = np.take_along_axis(np.asarray(weights, dtype=np.float32), order, axis=1)[:, :width]
    return rows, np.ascontiguousarray(np.where(rows >= 0, packed, 0.0).astype(np.float32))


def _manifest_fields(parent: Bundle, ids: np.ndarray, index: int, count: int, name: str) -> dict[str, Any]:
    """The parent's manifest for this shard: its labels, the parent's head labels among them, and
    what it is a shard of."""
    m = parent.manifest
    fields = m.model_dump(exclude={"format_version", "created_at", "files", "canary"})
    head = np.argsort(-np.asarray(parent.classifier_bias), kind="stable")[: m.scoring.shortlist.k_head]
    fields["scoring"]["shortlist"]["k_head"] = int(np.isin(head, ids).sum())
    if m.lineage is not None:  # the tree's labels among the shard's (shards carry no tree)
        fields["lineage"]["tree_labels"] = int((ids < m.lineage.tree_labels).sum())
    fields.update(
        version=name, num_labels=len(ids), metrics={"parent": m.metrics},
        shard=schema.ShardOf(parent_version=m.version, parent_fingerprint=schema.sha256_file(parent.path /
                             schema.MANIFEST), parent_num_labels=m.num_labels, index=index, count=count).model_dump(),
    )
    return fields


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (shards share the parent's pages and disk blocks), a copy across filesystems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def run_cli(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    final = shard_bundle(args.bundle, args.shards, args.out)
    print(final)
    return 0
