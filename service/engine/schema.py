"""The bundle's one schema: which files a bundle holds, its manifest, how it is checksummed.

Written by model_export, read by service.engine.bundle; training builds the manifest's
`scoring` as the `Scoring` model below (never as a dict of its own).

A bundle is a directory BUNDLE_ROOT/VERSION, immutable once written:
  manifest.json          `Manifest`; its `files` maps every other file to its sha256
  encoder.onnx           padded token ids + weights [B, T] -> unit embeddings [B, D]
  encoder.onnx.data      format 2: encoder.onnx's large initializers (the token embedding
                         table: float32, float16, or int8 with a scale per row, cast to
                         float32 after its Gather) as ONNX external data, which
                         onnxruntime memory-maps: the pages are the
                         file's, shared by every process serving the bundle
  tokenizer.json         service.engine.tokenizer.Tokenizer
  labels.jsonl           service.engine.labels.LabelTable (row i = label i everywhere)
  classifiers.npy        [L, D] w_l, the manifest's vector_dtype (memory-mapped)
  classifier_bias.npy    [L] float32 b_l (memory-mapped)
  centroids.npy          [L, D] mu_l, the manifest's vector_dtype (memory-mapped)
  classifier_scales.npy  format 4, with vector_dtype int8 (and then required): [L] float32 >= 0, the
  centroid_scales.npy    scale of each int8 row of classifiers.npy / centroids.npy: row l stands for
                         scales[l] * row (service.engine.vectors)
  hnsw_w.bin             service.engine.index.VectorIndex over [w_l, b_l] (MIPS, rows centred, dim D + 1)
  hnsw_mu.bin            service.engine.index.VectorIndex over mu_l (MIPS, rows centred, dim D)
  hnsw_w_projection.npy  format 3, with hnsw.projection_dim d > 0 (and then required): float32
  hnsw_mu_projection.npy [D' + 1, d], D' the index's input dimension (D + 1 for hnsw_w, D for
                         hnsw_mu): rows 0..D'-1 the top-d principal directions of the centred rows
                         (orthonormal columns), row D' the rows' mean projected; the index then holds
                         the rows projected, (x - mean) @ P, dim d, and is searched with q @ P
                         (service.engine.index.Projection)
  token_shortlist.npy    optional: [vocab_size, M] int32, per token id the labels it co-occurred
                         with most in training, most first, -1 padded (row 0, padding, all -1)
  token_shortlist_shares.npy   optional: [vocab_size, M] float32 in [0, 1], P(label | token)
                         (lexical_form "shares"; service.engine.lexical)
  token_shortlist_weights.npy  optional: [vocab_size, M] float32, signed weights of the
                         (token, label) slots (lexical_form "logistic")
  token_shortlist_bias.npy     optional: [L] float32, the logistic form's per-label bias
  token_overflow.npy     optional (format 2): [vocab_size, W] int32, per token id the labels added
                         after training (service.engine.label_changes) whose text holds it, every
                         slot served beside the first k_tok of token_shortlist.npy; -1 padded
  token_overflow_weights.npy   optional (format 2): [vocab_size, W] float32, their slots' weights in
                         the bundle's lexical form (0 in empty slots)
  labels_retired.npy     optional (format 2): int32 [R], sorted distinct ids of retired labels: no
                         scorer returns them (their rows stay, so label ids never move)
  tree.npz               optional: the adversarial tree scorer's arrays (service.engine.tree), over
                         labels 0..tree_labels-1 (`Lineage.tree_labels`; all L without a lineage);
                         names and dtypes in TREE_ARRAYS (its classifier_weights in the manifest's
                         vector_dtype); stored, not compressed, so that a reader can memory-map it;
                         format 2 added the lexical arrays (xi's per-token term, TREE_ARRAYS_SINCE),
                         format 5 node_lexical (p_n's per-token term of its node logits)
  validation.jsonl       optional: held-out {"text", "target_ind"} rows for a quality gate; a row
                         may carry "target_weight", one weight in (0, 1] per label (how sure a
                         label imputed from group labels is; absent: every label 1)
  shard_labels.npy       format 2, a shard's (manifest `shard`): [L] int64, the parent bundle's
                         id of each label row, increasing (service.engine.sharding; written by
                         model_export/shard.py)

Versioning policy (what a reader does with a bundle from another writer):
- `format_version` is the layout's version. A reader reads every version in
  READABLE_FORMATS and refuses any other, naming both: a newer bundle may mean something an
  older engine would serve wrongly. A change that alters how an existing file or field is read
  (a new scoring term, another array dtype, a new index layout) bumps it; readers keep reading
  the versions before it.
- Unknown manifest fields are refused (every model here forbids extras): a writer that adds a
  field the reader must understand bumps the format; free-form information goes into the
  open dicts (`metrics`, `training_config`, `data_fingerprint`), which readers never interpret.
- Fields retired from the writer stay readable (LEGACY below) and are ignored.
- A new optional file is refused by readers that do not know it (`KNOWN_FILES`): serving a
  bundle without a file its writer thought it needed could change answers.
- Format 2 may also be a shard (a bundle over a subset of its parent's labels): `shard` in the
  manifest and shard_labels.npy, both or neither; a format-1 manifest with them is refused.
  Readers that know neither refuse a shard by the two rules above; a bundle without them reads
  as before.
- Array dtypes are fixed per file (int32 token table, float32 biases and lexical weights); a
  reader refuses any other. The [L, D] label vectors (classifiers, centroids, the tree's
  classifier weights) are the manifest's `vector_dtype`: format 2 added it, float16 halves what
  a 10^6-label bundle maps (scores are computed in float32 from the stored values); format 1
  bundles are float32 (the field's default) and stay readable. Format 4 added int8 rows with a
  float32 scale per row (the scales files, and tree.npz's classifier_scales).
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from service.engine.jsonlines import non_finite_at

# Format 2 added, each optional (a format-1 bundle has none of them):
# - the encoder's initializers in encoder.onnx.data (format 1: inside encoder.onnx);
# - float16 [L, D] label vectors (`Manifest.vector_dtype`; format 1: float32);
# - shards of another bundle (`shard`, shard_labels.npy);
# - labels changed after training (Manifest.lineage, the token overflow, retired labels, a tree
#   over the first tree_labels labels);
# - tree.npz's lexical arrays, a scoring term of the tree classifier (TREE_ARRAYS_SINCE).
# Format 3 added, optional: HNSW indices over the rows projected onto their top principal
# directions (`HnswParams.projection_dim`, the projection files); an index of another dimension
# than the manifest's dim is a new index layout, which readers before it must refuse.
# Format 4 added int8 label vectors (vector_dtype "int8" with the scales files): another dtype
# of an existing file, which readers before it must refuse.
# Format 5 added tree.npz's node_lexical, optional: a term of p_n's node logits (readers before it
# would search the tree without it).
# Every bundle of an earlier format reads as it did.
FORMAT_VERSION = 5
READABLE_FORMATS = (1, 2, 3, 4, 5)
VectorDtype = Literal["float32", "float16", "int8"]
VECTOR_DTYPES: tuple[str, ...] = ("float32", "float16", "int8")

MANIFEST = "manifest.json"
# The most bytes of manifest.json a reader reads (service.engine.small_files): manifests are 11-14 KB
# (the canaries and metrics the bulk of it), so 1 MiB leaves ample room, and bounds what listing a
# bundle root may read per directory. The service's SHORTLIST_MAX_MANIFEST_BYTES overrides it.
MAX_MANIFEST_BYTES = 1 << 20
ENCODER = "encoder.onnx"
ENCODER_DATA = "encoder.onnx.data"
TOKENIZER = "tokenizer.json"
LABELS = "labels.jsonl"
CLASSIFIERS = "classifiers.npy"
CLASSIFIER_BIAS = "classifier_bias.npy"
CENTROIDS = "centroids.npy"
HNSW_W = "hnsw_w.bin"
HNSW_MU = "hnsw_mu.bin"
TREE = "tree.npz"
TOKEN_SHORTLIST = "token_shortlist.npy"
TOKEN_SHORTLIST_SHARES = "token_shortlist_shares.npy"
TOKEN_SHORTLIST_WEIGHTS = "token_shortlist_weights.npy"
TOKEN_SHORTLIST_BIAS = "token_shortlist_bias.npy"
VALIDATION = "validation.jsonl"
SHARD_LABELS = "shard_labels.npy"
TOKEN_OVERFLOW = "token_overflow.npy"
TOKEN_OVERFLOW_WEIGHTS = "token_overflow_weights.npy"
RETIRED_LABELS = "labels_retired.npy"
CLASSIFIER_SCALES = "classifier_scales.npy"
CENTROID_SCALES = "centroid_scales.npy"
# The scales file of each label-vector file (listed exactly when vector_dtype is int8).
SCALES_FILES: dict[str, str] = {CLASSIFIERS: CLASSIFIER_SCALES, CENTROIDS: CENTROID_SCALES}


def projection_file(index_file: str) -> str:
    """The file of an index file's projection (hnsw_mu.bin -> hnsw_mu_projection.npy), in a bundle
    or a checkpoint: listed exactly when hnsw.projection_dim > 0."""
    return f"{Path(index_file).stem}_projection.npy"


HNSW_W_PROJECTION = projection_file(HNSW_W)
HNSW_MU_PROJECTION = projection_file(HNSW_MU)
PROJECTION_FILES = (HNSW_W_PROJECTION, HNSW_MU_PROJECTION)
REQUIRED_FILES = (ENCODER, TOKENIZER, LABELS, CLASSIFIERS, CLASSIFIER_BIAS, CENTROIDS, HNSW_W, HNSW_MU)
OPTIONAL_FILES = (
    ENCODER_DATA, TREE, VALIDATION, TOKEN_SHORTLIST, TOKEN_SHORTLIST_SHARES, TOKEN_SHORTLIST_WEIGHTS,
    TOKEN_SHORTLIST_BIAS, SHARD_LABELS, TOKEN_OVERFLOW, TOKEN_OVERFLOW_WEIGHTS, RETIRED_LABELS, *PROJECTION_FILES,
    *SCALES_FILES.values(),
)
KNOWN_FILES = frozenset((*REQUIRED_FILES, *OPTIONAL_FILES))

# tree.npz: every array the tree scorer reads, with its one dtype (any other name or dtype is
# refused), and the format version from which an array may appear.
# tree.npz's arrays and their dtypes; VECTOR_DTYPE: the manifest's vector_dtype.
VECTOR_DTYPE = "vector_dtype"
TREE_ARRAYS: dict[str, str] = {
    "pca_mean": "float32", "pca_components": "float32", "node_weights": "float32", "node_bias": "float32",
    "leaf_labels": "int64", "classifier_weights": VECTOR_DTYPE, "classifier_bias": "float32", "default_beam": "int64",
    "lexical_indptr": "int64", "lexical_labels": "int32", "lexical_weights": "float32", "lexical_bias": "float32",
    "classifier_scales": "float32", "node_lexical": "float16",
}
# classifier_scales: the int8 classifier weights' row scales (service.engine.vectors), with them only.
TREE_ARRAYS_SINCE: dict[str, int] = {"lexical_indptr": 2, "lexical_labels": 2, "lexical_weights": 2, "lexical_bias": 2,
                                     "classifier_scales": 4, "node_lexical": 5}

LexicalForm = Literal["shares", "logistic"]
LEXICAL_FORMS: tuple[str, ...] = ("shares", "logistic")
# The files holding each lexical form's weights, the weights file first.
LEXICAL_FILES: dict[str, tuple[str, ...]] = {
    "shares": (TOKEN_SHORTLIST_SHARES,),
    "logistic": (TOKEN_SHORTLIST_WEIGHTS, TOKEN_SHORTLIST_BIAS),
}
# When the prior's head labels join a query's shortlist (Shortlist.head).
HeadMode = Literal["always", "fallback"]
HEAD_MODES: tuple[str, ...] = ("always", "fallback")
ClassifierForm = Literal["paper", "scaled_bias"]
CalibrationKind = Literal["sigmoid", "exp", "identity"]

# The label text training reads and label changes write (training/data.py: title, or title and content).
TextField = Literal["title", "title+content"]
# Upper bounds of the manifest's per-query work, so that a manifest cannot ask for unbounded
# work per request (hnswlib keeps ef_search candidates per search; each source adds up to its k
# labels to every query's shortlist, which is scored whole). Trained bundles use ef_search 50 and
# 20-100 candidates per source. A source's k may still be "every label" (k_head = L scores a
# query exactly, as the sharding tests do) up to the largest label sets served, 10^6 (README).
MAX_SOURCE_K = 1 << 20  # k_w, k_mu, k_head, k_tok, k_added
MAX_EF_SEARCH = 10_000

VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HASH_CHUNK = 1 << 20


class BundleError(ValueError):
    """A bundle that must not be served; the message names the file and what is wrong."""


def _without_zero(fields: dict[str, Any], name: str) -> dict[str, Any]:
    """A model's serialized fields without `name` where it is 0: a field added later is written only
    where it is used, so every manifest that does not use it reads as before."""
    if not fields.get(name):
        fields.pop(name, None)
    return fields


class _Strict(BaseModel):
    # Readers validate in strict mode too (read_manifest: no "20" for 20, no 5.0 for 5), as every
    # other bundle file is read; writers build these models from Python values.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class CalibrationSpec(_Strict):
    """f(x) = act(a x + b), act in {sigmoid, exp, identity} (service.engine.scorers.Calibration)."""

    kind: CalibrationKind
    a: float = 1.0
    b: float = 0.0


class Calibrations(_Strict):
    classifier: CalibrationSpec
    centroid: CalibrationSpec


class Shortlist(_Strict):
    """The sources of each query's candidate labels (service.engine.candidates)."""

    k_w: int = Field(ge=0, le=MAX_SOURCE_K)  # HNSW over [w_l, b_l]
    k_mu: int = Field(ge=0, le=MAX_SOURCE_K)  # HNSW over mu_l
    # The labels with the largest bias (the label prior's head): a heavy-head label can win on
    # its prior while its direction ranks low in HNSW.
    k_head: int = Field(0, ge=0, le=MAX_SOURCE_K)
    # When the head joins: "always", or "fallback" = only for a query none of whose tokens has
    # a label in the token shortlist. With the token table the head's labels that a query's
    # words point to are in their rows already: on debian-deps validation "fallback" scores the
    # same (P@1 64.21 vs 64.16) with 35 candidates instead of 56.
    head: HeadMode = "always"
    # The first k_tok labels of each query token's row of token_shortlist.npy.
    k_tok: int = Field(0, ge=0, le=MAX_SOURCE_K)
    # Derived bundles (service.engine.label_changes): the k_added live labels added after training
    # (rows lineage.tree_labels..L-1) whose w_l.q + b_l is largest, by exact search over those rows.
    # A label added by its text has no row of trained co-occurrences in the token table, and its
    # words need not be its documents'. Written only when > 0, so a manifest without it reads as before.
    k_added: int = Field(0, ge=0, le=MAX_SOURCE_K)

    @model_serializer(mode="wrap")
    def _omit_unused(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_zero(handler(self), "k_added")

    @model_validator(mode="after")
    def _some_source(self) -> Shortlist:
        if self.k_w + self.k_mu + self.k_tok == 0:
            raise ValueError("k_w, k_mu and k_tok are all 0: no query-dependent shortlist")
        return self

    @property
    def searches_hnsw(self) -> bool:
        return bool(self.k_w or self.k_mu)

    @classmethod
    def served(cls, k_w: int, k_mu: int, k_tok: int, k_head: int, has_prior: bool) -> Shortlist:
        """The shortlist a trained model serves: the head only where the classifiers carry a
        prior (a bias) to rank it by, and with a token table only as its fallback (the rows
        already hold the head labels a query's words point to)."""
        return cls(k_w=k_w, k_mu=k_mu, k_tok=k_tok, k_head=k_head if has_prior else 0,
                   head="fallback" if k_tok else "always")


class Scoring(_Strict):
    """score_l = alpha f(w_l.q + b_l) + (1 - alpha) g(mu_l.q) + lexical_weight lex_l over the shortlist."""

    alpha: float = Field(ge=0.0, le=1.0)
    # Weight of the token shortlist's lexical score (service.engine.lexical); 0 for bundles
    # without the lexical form's files.
    lexical_weight: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    # "shares" (P(label | token); bundles before the logistic form) or "logistic".
    lexical_form: LexicalForm = "shares"
    classifier_form: ClassifierForm
    calibration: Calibrations
    shortlist: Shortlist


class HnswParams(_Strict):
    space: Literal["ip"] = "ip"
    M: int = Field(ge=2)
    ef_construction: int = Field(ge=1)
    ef_search: int = Field(ge=1, le=MAX_EF_SEARCH)
    # d > 0 (format 3): each index holds its rows projected onto their top-d principal directions
    # and finds candidates in d dimensions (the scores are computed from the stored rows after);
    # 0: the rows themselves. Written only when > 0, so a manifest without it reads as before.
    projection_dim: int = Field(0, ge=0)

    @model_serializer(mode="wrap")
    def _omit_unprojected(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_zero(handler(self), "projection_dim")


class CanaryQuery(_Strict):
    """A query answered at export; loading must reproduce its answer (service.engine.canary)."""

    text: str
    top_ids: list[int]
    top_scores: list[float]


class ShardOf(_Strict):
    """What a shard bundle is a part of: shard `index` of `count` over the labels of the parent
    bundle (its own rows' parent ids in shard_labels.npy)."""

    parent_version: str
    # sha256 of the parent's manifest.json, which holds the sha256 of every parent file: shards
    # of one parent, and only those, agree on it.
    parent_fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    parent_num_labels: int = Field(ge=1)
    index: int = Field(ge=0)
    count: int = Field(ge=1)

    @model_validator(mode="after")
    def _index_in_range(self) -> ShardOf:
        if self.index >= self.count:
            raise ValueError(f"shard index {self.index} of {self.count}")
        return self


class Lineage(_Strict):
    """A bundle derived from another by label changes (service.engine.label_changes), not by training."""

    parent: str  # the version it was derived from
    base: str  # the trained bundle at the start of the chain (versions are named after it)
    added: int = Field(ge=0)  # labels added by this change
    retired: int = Field(ge=0)  # labels retired by this change
    # Labels 0..tree_labels-1 are the trained ones the tree scorer covers; rows added later are
    # not in the tree until the next training.
    tree_labels: int = Field(ge=0)


# How deep the manifest's free-form records (metrics, data fingerprint, training config) may nest.
MAX_RECORD_DEPTH = 32


class Manifest(_Strict):
    format_version: int
    version: str
    # ISO-8601 with a UTC offset ("Z" or +00:00), as store.utc_now writes it; `created` parses it.
    created_at: str
    dim: int = Field(ge=1)
    num_labels: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    text_field: TextField = "title"
    # Set in a shard bundle (model_export/shard.py); None in a whole one.
    shard: ShardOf | None = None
    scoring: Scoring
    hnsw: HnswParams
    data_fingerprint: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, Any] = Field(default_factory=dict)
    training_config: dict[str, Any] = Field(default_factory=dict)
    canary: list[CanaryQuery] = Field(default_factory=list)
    files: dict[str, str]
    # dtype of the [L, D] label vectors (format 2; format 1 is float32)
    vector_dtype: VectorDtype = "float32"
    lineage: Lineage | None = None
    # LEGACY: written by exports before 2026-11-24 (the tree's beam is in tree.npz); ignored.
    tree_default_beam: int | None = Field(None, exclude=True)

    @field_validator("created_at")
    @classmethod
    def _utc_timestamp(cls, value: str) -> str:
        parse_utc(value)
        return value

    @property
    def created(self) -> datetime:
        """created_at as a time: what "newest" compares (never the string: "yesterday" > "2026-...")."""
        return parse_utc(self.created_at)

    @field_validator("data_fingerprint", "metrics", "training_config")
    @classmethod
    def _shallow(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Free-form records nest a few levels (export writes at most 5): one nested hundreds deep
        could not be answered in GET /admin/bundles (pydantic's serializer stops at its depth limit)."""
        depth, level = 1, [value]
        while level:
            level = [v for x in level for v in (x.values() if isinstance(x, dict) else x)
                     if isinstance(v, dict | list)]
            depth += bool(level)
            if depth > MAX_RECORD_DEPTH:
                raise ValueError(f"nested deeper than {MAX_RECORD_DEPTH} levels")
        # pydantic writes a NaN here as null, silently: a writer holding one is refused instead.
        where = non_finite_at(value)
        if where is not None:
            raise ValueError(f"{where or 'a value'} is not a finite number (JSON holds no NaN or infinity)")
        return value

    @model_validator(mode="after")
    def _fields_of_format(self) -> Manifest:
        """What only a later format may hold, each named when an earlier manifest claims it; a lineage's
        tree within the labels."""
        if self.format_version < 2:
            wrong = []
            if self.vector_dtype != "float32":
                wrong.append(f"vector_dtype {self.vector_dtype!r} needs format_version 2")
            if self.shard is not None:
                wrong.append(f"a shard is a format 2 bundle, this one says format {self.format_version}")
            if self.lineage is not None:
                wrong.append("a lineage (labels changed after training) needs format_version 2")
            if wrong:
                raise ValueError("; ".join(wrong))
        if self.format_version < 3 and self.hnsw.projection_dim:
            raise ValueError(f"hnsw.projection_dim {self.hnsw.projection_dim} needs format_version 3")
        if self.format_version < 4 and self.vector_dtype == "int8":
            raise ValueError("vector_dtype 'int8' needs format_version 4")
        self._projection_files()
        self._scales_files()
        if self.lineage is not None and self.lineage.tree_labels > self.num_labels:
            raise ValueError(f"lineage.tree_labels {self.lineage.tree_labels} > num_labels {self.num_labels}")
        return self

    def _projection_files(self) -> None:
        """The projection files are listed exactly when the indices are projected, onto fewer
        dimensions than the rows have (as many would only add a product to every query)."""
        d = self.hnsw.projection_dim
        for name in PROJECTION_FILES:
            if d and name not in self.files:
                raise ValueError(f"hnsw.projection_dim is {d} but {name} is not listed")
            if not d and name in self.files:
                raise ValueError(f"{name} is listed but hnsw.projection_dim is 0 (the indices are not projected)")
        if d >= self.dim:
            raise ValueError(f"hnsw.projection_dim {d} must be below dim {self.dim}")

    def _scales_files(self) -> None:
        """The scales files are listed exactly when the label vectors are int8."""
        for name in SCALES_FILES.values():
            if self.vector_dtype == "int8" and name not in self.files:
                raise ValueError(f"vector_dtype is int8 but {name} is not listed")
            if self.vector_dtype != "int8" and name in self.files:
                raise ValueError(f"{name} is listed but vector_dtype is {self.vector_dtype} (scales go with int8)")

    @property
    def has_tree(self) -> bool:
        return TREE in self.files

    @property
    def tree_labels(self) -> int:
        """How many labels (the first ones) the tree scorer covers."""
        return self.num_labels if self.lineage is None else self.lineage.tree_labels


def parse_utc(value: str) -> datetime:
    """An ISO-8601 timestamp with a UTC offset; ValueError otherwise (naive times are refused: whose
    clock they read is unknown, so they cannot be ordered against the others)."""
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"not an ISO-8601 timestamp: {value!r}") from None
    if parsed.utcoffset() != timedelta(0):
        raise ValueError(f"not a UTC timestamp (end it with Z or +00:00): {value!r}")
    return parsed


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def validate_version_name(version: str) -> str:
    if not isinstance(version, str) or not VERSION_RE.fullmatch(version) or version in (".", ".."):
        raise BundleError(
            f"invalid bundle version {version!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return version
