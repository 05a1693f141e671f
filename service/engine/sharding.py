"""A bundle's labels split into shards, each a bundle of its own (model_export/shard.py writes them),
and the answers of the shards merged into the parent's.

On disk: ROOT/VERSION/shard-I-of-N/ is shard I of the parent bundle VERSION, a complete bundle
over its labels (its manifest's version is its directory's name, `shard` says what it is part
of, shard_labels.npy holds each row's parent label id, in increasing order).

Why the merge is the parent's answer: a label's score depends on the query and that label only
(service.engine.scorers), so the top k of the parent's shortlist is the top k of the shards' top
k. The shortlist itself is the parent's, source by source: a shard's token rows hold its labels
among the parent's first k_tok slots of each row (packed; the shard's k_tok is the most a row
holds), and its overflow rows its labels among the parent's; its head is the parent's head
restricted (the shard's k_head counts the parent's head labels it holds); the head's "fallback"
rule is decided for the parent, from every shard's rows (`ShardPredictor.token_rows`, `head_rows`).
Only HNSW searches differ: each shard searches its own graph for its own top k_w / k_mu, a superset
of the parent's candidates when the searches are exact.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from service.engine import canary
from service.engine.predictor import Prediction, Predictor, PredictorOptions
from service.engine.query import EncodedQueries, QueryEncoder
from service.engine.schema import (
    ENCODER,
    ENCODER_DATA,
    MAX_MANIFEST_BYTES,
    TOKENIZER,
    BundleError,
    ShardOf,
    validate_version_name,
)
from service.engine.validation_rows import validation_truths

_SHARD_DIR = re.compile(r"^shard-(\d+)-of-(\d+)$")


def shard_dir_name(index: int, count: int) -> str:
    return f"shard-{index}-of-{count}"


def shard_dirs(version_dir: Path) -> list[Path]:
    """The shard bundles of a sharded version, in shard order; BundleError unless the directory
    holds shards 0..N-1 of one N, and nothing else that looks like a shard."""
    found: dict[int, Path] = {}
    counts = set()
    for child in version_dir.iterdir() if version_dir.is_dir() else ():
        match = _SHARD_DIR.fullmatch(child.name)
        if match and child.is_dir():
            found[int(match[1])] = child
            counts.add(int(match[2]))
    if len(counts) != 1 or sorted(found) != list(range(next(iter(counts)))):
        raise BundleError(f"{version_dir}: expected shard-0-of-N .. shard-(N-1)-of-N, found "
                          f"{sorted(p.name for p in found.values()) or 'no shard'}")
    return [found[i] for i in sorted(found)]


def sharded_versions(root: Path) -> list[tuple[str, float]]:
    """(version, modification time) of each directory under root that holds a shard set, oldest first."""
    out = []
    for child in root.iterdir() if root.is_dir() else ():
        if child.name.startswith(".") or not child.is_dir():
            continue
        try:
            validate_version_name(child.name)
            shard_dirs(child)
        except BundleError:
            continue
        out.append((child.name, child.stat().st_mtime))
    return sorted(out, key=lambda item: (item[1], item[0]))


class ShardInfo(NamedTuple):
    """What a loaded shard says about itself, for the check that shards belong together."""

    path: str
    shard: ShardOf
    num_labels: int
    alpha: float
    # sha256 of the tokenizer and encoder files: a router encodes with shard 0's for every shard
    query_side: tuple[str | None, ...]


class ShardAnswer(NamedTuple):
    """One shard's top k per query: parent label ids int64 [B, k] (-1 where fewer), scores float32
    [B, k], uids and titles per query (one per id >= 0), and which exclude uids the shard holds."""

    ids: np.ndarray
    scores: np.ndarray
    uids: list[list[str]]
    titles: list[list[str]]
    known: list[bool]


class GateRows(NamedTuple):
    """A shard's validation rows, for the quality gate of its version: every row of the parent's (the
    same texts in every shard), its truths restricted to the shard's labels, in parent ids; and the
    parent ids of the shard's retired labels."""

    texts: list[str]
    truths: list[list[int]]
    retired: list[int]
    weights: list[list[float]] | None = None  # the truths' weights (None: every truth sure)


class MergedGateRows(NamedTuple):
    """The parent's validation rows merged from its shards' (merge_gate_rows)."""

    texts: list[str]
    truths: list[list[int]]  # parent ids, increasing
    retired: np.ndarray | None  # bool per parent id (None when no label is retired)
    weights: list[list[float]] | None  # with truths (None: every truth sure)


def merge_gate_rows(parts: Sequence[GateRows], parent: ShardOf) -> MergedGateRows:
    """The parent's validation rows from its shards' GateRows (in shard order); BundleError when
    the shards' texts differ (shards not written together)."""
    texts = parts[0].texts
    for index, part in enumerate(parts):
        if part.texts != texts or len(part.truths) != len(texts):
            raise BundleError(f"shard {index} of {parent.parent_version}: its validation rows are not shard 0's")
    weighted = any(part.weights is not None for part in parts)
    truths: list[list[int]] = []
    weights: list[list[float]] | None = [] if weighted else None
    for row in range(len(texts)):
        pairs = sorted((label, 1.0 if part.weights is None else part.weights[row][j])
                       for part in parts for j, label in enumerate(part.truths[row]))
        truths.append([label for label, _ in pairs])
        if weights is not None:
            weights.append([w for _, w in pairs])
    retired_ids = [label for part in parts for label in part.retired]
    retired = None
    if retired_ids:
        retired = np.zeros(parent.parent_num_labels, dtype=bool)
        retired[retired_ids] = True
    return MergedGateRows(texts, truths, retired, weights)


class ShardPredictor:
    """A Predictor over one shard bundle, answering in the parent's label ids.

    Safe to call from several threads at once (as Predictor is).
    """

    def __init__(self, predictor: Predictor) -> None:
        shard, ids = predictor.bundle.manifest.shard, predictor.bundle.shard_labels
        if shard is None or ids is None:
            raise BundleError(f"{predictor.bundle.path}: not a shard (no `shard` in its manifest)")
        self.predictor = predictor
        self.shard = shard
        self.parent_ids = ids

    @classmethod
    def load(cls, path: str | Path, options: PredictorOptions | None = None, *,
             max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> ShardPredictor:
        """Predictor.load of a shard bundle without an encoder session (its queries come encoded by
        the router, which holds the parent's encoder): every check but the canaries, which need
        encoded texts: the router checks them with check_canaries before the shard serves."""
        return cls(Predictor.load(path, replace(options or PredictorOptions(), encoder=False),
                                  max_manifest_bytes=max_manifest_bytes))

    def canary_texts(self) -> list[str]:
        return canary.check_texts(self.predictor.bundle)

    def check_canaries(self, queries: EncodedQueries) -> None:
        """canary.check of this shard, on canary_texts() as the router encoded them; BundleError
        naming the shard's path."""
        p = self.predictor
        exported = p if p.answers_as_exported else Predictor(p.bundle, PredictorOptions(threads=p.options.threads,
                                                                                        encoder=False))
        canary.check(_EncodedTexts(exported, self.canary_texts(), queries))

    def info(self) -> ShardInfo:
        p = self.predictor
        files = p.bundle.manifest.files
        return ShardInfo(str(p.bundle.path), self.shard, p.num_labels, p.alpha,
                         tuple(files.get(name) for name in (TOKENIZER, ENCODER, ENCODER_DATA)))

    def gate_rows(self) -> GateRows:
        bundle, ids = self.predictor.bundle, self.parent_ids
        rows = bundle.validation_rows()
        truths, weights = validation_truths(rows)
        retired = [] if bundle.retired is None else ids[np.flatnonzero(bundle.retired)].tolist()
        return GateRows([str(r["text"]) for r in rows], [ids[t].tolist() for t in truths], retired, weights)

    def token_rows(self) -> np.ndarray | None:
        """Packed bits [ceil(V / 8)]: which tokens have a label of this shard among the first
        k_tok slots of their row or in their overflow row (None without a token shortlist); OR
        over every shard of the parent, the parent's own rows' test (head_rows)."""
        table, k_tok = self.predictor.sources.table, self.predictor.scoring.shortlist.k_tok
        if table is None:
            return None
        found = (table.labels[:, :k_tok] >= 0).any(axis=1)
        if table.overflow is not None:
            found |= (table.overflow >= 0).any(axis=1)
        return np.packbits(found)

    def predict(
        self, queries: EncodedQueries, k: int, alpha: float | None = None, exclude: Sequence[str] = (),
        head: np.ndarray | None = None,
    ) -> ShardAnswer:
        """The shard's top k of each query, excluding the labels whose uid is in `exclude`."""
        local = self.predictor.bundle.labels.ids_of(list(exclude)) if exclude else []
        dropped = sorted({i for i in local if i is not None})
        exclusions = [dropped] * len(queries.q) if dropped else None
        ids, scores = self.predictor.predict_encoded_ids(queries, k, alpha, exclusions, head)
        labels = self.predictor.bundle.labels
        named = [[labels.row(i) for i in row if i >= 0] for row in ids.tolist()]
        uids = [[uid for uid, _ in row] for row in named]
        titles = [[title for _, title in row] for row in named]
        parent = np.where(ids >= 0, self.parent_ids[np.maximum(ids, 0)], -1)
        return ShardAnswer(parent, scores, uids, titles, [i is not None for i in local])


class _EncodedTexts:
    """canary.CanaryTarget of a predictor without an encoder: `texts` answered from their
    encodings `queries` (row i = texts[i])."""

    def __init__(self, predictor: Predictor, texts: Sequence[str], queries: EncodedQueries) -> None:
        if len(queries.q) != len(texts):
            raise BundleError(f"{predictor.bundle.path}: {len(queries.q)} encoded canaries for {len(texts)} texts")
        self.predictor, self.bundle = predictor, predictor.bundle
        self.rows = {text: i for i, text in enumerate(texts)}
        self.queries = queries

    @property
    def num_labels(self) -> int:
        return self.predictor.num_labels

    @property
    def tree_serves(self) -> bool:
        return False  # a shard has no tree

    def predict_ids(self, texts: list[str], k: int, alpha: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        rows = [self.rows[t] for t in texts]
        return self.predictor.predict_encoded_ids(EncodedQueries(*(a[rows] for a in self.queries)), k, alpha)

    def predict_tree_ids(self, texts: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        raise LookupError("a shard has no tree scorer")


def check_shard_set(infos: Sequence[ShardInfo]) -> ShardOf:
    """The parent's description, when `infos` (in shard order) are its shards 0..N-1 exactly and
    hold as many labels as it does; BundleError naming the first shard that does not fit."""
    if not infos:
        raise BundleError("no shard")
    first = infos[0].shard
    for index, info in enumerate(infos):
        s = info.shard
        if (s.parent_fingerprint, s.parent_version) != (first.parent_fingerprint, first.parent_version):
            raise BundleError(f"{info.path}: a shard of {s.parent_version} ({s.parent_fingerprint[:12]}), not of "
                              f"{first.parent_version} ({first.parent_fingerprint[:12]}) as shard 0")
        if (s.index, s.count) != (index, len(infos)):
            raise BundleError(f"{info.path}: shard {s.index} of {s.count}, expected {index} of {len(infos)}")
        if info.alpha != infos[0].alpha or info.query_side != infos[0].query_side:
            raise BundleError(f"{info.path}: its alpha, tokenizer or encoder differs from shard 0's")
    total = sum(info.num_labels for info in infos)
    if total != first.parent_num_labels:
        raise BundleError(f"{infos[0].path}: the shards hold {total} labels, the parent {first.parent_num_labels}")
    return first


def union_token_rows(rows: Sequence[np.ndarray | None], vocab_size: int) -> np.ndarray | None:
    """bool [V] from the shards' ShardPredictor.token_rows (None when no shard has a token table)."""
    present = [r for r in rows if r is not None]
    if not present:
        return None
    return np.unpackbits(np.bitwise_or.reduce(np.stack(present), axis=0), count=vocab_size).astype(bool)


def head_rows(token_rows: np.ndarray | None, tokens: np.ndarray) -> np.ndarray | None:
    """bool [B]: the queries none of whose tokens has a label in the parent's rows (the head's
    "fallback" test, made for the parent); None without a token table."""
    if token_rows is None:
        return None
    return ~token_rows[tokens].any(axis=1)


def merge_answers(answers: Sequence[ShardAnswer], k: int) -> list[list[Prediction]]:
    """Each query's k best over the shards' answers: by score, ties to the lower parent id, as the
    parent ranks them (its candidates are sorted by id and its sort is stable)."""
    rows = len(answers[0].ids)
    out = []
    for row in range(rows):
        ids = np.concatenate([a.ids[row][a.ids[row] >= 0] for a in answers])
        scores = np.concatenate([a.scores[row][a.ids[row] >= 0] for a in answers])
        uids = [u for a in answers for u in a.uids[row]]
        titles = [t for a in answers for t in a.titles[row]]
        order = np.lexsort((ids, -scores))[:k]
        out.append([Prediction(int(ids[i]), uids[i], titles[i], float(scores[i])) for i in order])
    return out


def unknown_excluded(exclude: Sequence[str], answers: Sequence[ShardAnswer]) -> list[int]:
    """Positions in `exclude` of the uids that no shard holds."""
    return [i for i in range(len(exclude)) if not any(a.known[i] for a in answers)]


@dataclass
class ShardedPredictor:
    """The shards of one parent in this process, answering as the parent does: what the Ray Serve
    application (service.api.ray_app) distributes, here for evaluation, benchmarks and tests."""

    encode: QueryEncoder
    shards: list[ShardPredictor]

    def __post_init__(self) -> None:
        self.parent = check_shard_set([s.info() for s in self.shards])
        vocab = self.shards[0].predictor.bundle.manifest.vocab_size
        self.token_rows = union_token_rows([s.token_rows() for s in self.shards], vocab)

    @classmethod
    def load(cls, version_dir: str | Path, options: PredictorOptions | None = None, *,
             max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> ShardedPredictor:
        dirs = shard_dirs(Path(version_dir))
        encoder = QueryEncoder.open(dirs[0], max_manifest_bytes=max_manifest_bytes)
        shards = [ShardPredictor.load(d, options, max_manifest_bytes=max_manifest_bytes) for d in dirs]
        for shard in shards:
            shard.check_canaries(encoder(shard.canary_texts()))
        return cls(encoder, shards)

    def predict(self, texts: Sequence[str], k: int = 10, alpha: float | None = None,
                exclude: Sequence[str] = ()) -> list[list[Prediction]]:
        queries = self.encode(texts)
        head = head_rows(self.token_rows, queries.tokens)
        answers = [s.predict(queries, k, alpha, exclude, head) for s in self.shards]
        missing = unknown_excluded(exclude, answers)
        if missing:
            raise KeyError(f"unknown label uid {exclude[missing[0]]!r}")
        return merge_answers(answers, k)
