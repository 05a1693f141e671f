"""The bundle contract: which files a bundle holds, its manifest, how it is checksummed,
how it is finalised on disk, and how it is validated before anything is served.

A bundle is a directory BUNDLE_ROOT/VERSION, immutable once written:
  manifest.json          Manifest below; `files` maps every other file to its sha256
  encoder.onnx           padded token ids + weights [B, T] -> unit embeddings [B, D]
  tokenizer.json         service.engine.tokenizer.Tokenizer
  labels.jsonl           service.engine.labels.LabelTable (row i = label i everywhere)
  classifiers.npy        [L, D] float32 w_l         (memory-mapped)
  classifier_bias.npy    [L] float32 b_l            (memory-mapped)
  centroids.npy          [L, D] float32 mu_l        (memory-mapped)
  hnsw_w.bin             service.engine.index.VectorIndex over [w_l, b_l] (MIPS, rows centred, dim D + 1)
  hnsw_mu.bin            service.engine.index.VectorIndex over mu_l (MIPS, rows centred, dim D)
  token_shortlist.npy    optional: [vocab_size, M] int32, per token id the labels it co-occurred
                         with most in training, most first, -1 padded (row 0, padding, all -1)
  token_shortlist_shares.npy   optional: [vocab_size, M] float32 in [0, 1], P(label | token) of
                         those labels (lexical_form "shares"; service.engine.lexical)
  token_shortlist_weights.npy  optional: [vocab_size, M] float32, signed weights of those
                         (token, label) slots (lexical_form "logistic")
  token_shortlist_bias.npy     optional: [L] float32, the logistic form's per-label bias
  tree.npz               optional: the adversarial tree scorer's arrays
  validation.jsonl       optional: held-out {"text", "target_ind"} rows for a quality gate
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from service.engine.encoder import OnnxEncoder
from service.engine.index import VectorIndex
from service.engine.labels import LabelTable
from service.engine.lexical import LexicalForm, TokenShortlist
from service.engine.scorers import Calibration
from service.engine.tokenizer import Tokenizer

BUNDLE_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ENCODER = "encoder.onnx"
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
REQUIRED_FILES = (ENCODER, TOKENIZER, LABELS, CLASSIFIERS, CLASSIFIER_BIAS, CENTROIDS, HNSW_W, HNSW_MU)
OPTIONAL_FILES = (
    TREE, VALIDATION, TOKEN_SHORTLIST, TOKEN_SHORTLIST_SHARES, TOKEN_SHORTLIST_WEIGHTS, TOKEN_SHORTLIST_BIAS
)
# The files holding each lexical form's weights (service.engine.lexical).
LEXICAL_FILES: dict[str, tuple[str, ...]] = {
    "shares": (TOKEN_SHORTLIST_SHARES,),
    "logistic": (TOKEN_SHORTLIST_WEIGHTS, TOKEN_SHORTLIST_BIAS),
}

# When the prior's head labels join a query's shortlist (ShortlistSizes.head).
HeadMode = Literal["always", "fallback"]
HEAD_MODES: tuple[str, ...] = ("always", "fallback")

VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HASH_CHUNK = 1 << 20


class BundleError(ValueError):
    """A bundle that must not be served; the message names the file and what is wrong."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CalibrationSpec(_Strict):
    kind: Literal["sigmoid", "exp", "identity"]
    a: float = 1.0
    b: float = 0.0

    def to_calibration(self) -> Calibration:
        return Calibration(self.kind, self.a, self.b)


class Calibrations(_Strict):
    classifier: CalibrationSpec
    centroid: CalibrationSpec


class ShortlistSizes(_Strict):
    k_w: int = Field(ge=0)
    k_mu: int = Field(ge=0)
    # The labels with the largest bias (the label prior's head) are shortlisted (when: `head`):
    # a heavy-head label can win on its prior while its direction ranks low in HNSW.
    k_head: int = Field(0, ge=0)
    # When the head joins: "always", or "fallback" = only for a query none of whose tokens has
    # a label in the token shortlist. With the token table the head's labels that a query's
    # words point to are in their rows already: on debian-deps validation "fallback" scores the
    # same (P@1 64.21 vs 64.16) with 35 candidates instead of 56 (single-query p50 -7 us).
    head: HeadMode = "always"
    # The first k_tok labels of each query token's row of token_shortlist.npy.
    k_tok: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _some_source(self) -> ShortlistSizes:
        if self.k_w + self.k_mu + self.k_tok == 0:
            raise ValueError("k_w, k_mu and k_tok are all 0: no query-dependent shortlist")
        return self


class ScoringDefaults(_Strict):
    alpha: float = Field(ge=0.0, le=1.0)
    # Weight of the token shortlist's lexical score (service.engine.lexical) added to the
    # alpha mixture; 0 for bundles without the lexical form's files (LEXICAL_FILES).
    lexical_weight: float = Field(0.0, ge=0.0)
    # "shares" (P(label | token); bundles before the logistic form) or "logistic".
    lexical_form: LexicalForm = "shares"
    classifier_form: str
    calibration: Calibrations
    shortlist: ShortlistSizes


class HnswParams(_Strict):
    space: Literal["ip"] = "ip"
    M: int = Field(ge=2)
    ef_construction: int = Field(ge=1)
    ef_search: int = Field(ge=1)


class CanaryQuery(_Strict):
    """A query run at export; loading must reproduce its top label."""

    text: str
    top_ids: list[int]
    top_scores: list[float]


class Manifest(_Strict):
    format_version: int
    version: str
    created_at: str
    dim: int = Field(ge=1)
    num_labels: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    text_field: str = "title"
    scoring: ScoringDefaults
    hnsw: HnswParams
    tree_default_beam: int | None = None
    data_fingerprint: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, Any] = Field(default_factory=dict)
    training_config: dict[str, Any] = Field(default_factory=dict)
    canary: list[CanaryQuery] = Field(default_factory=list)
    files: dict[str, str]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def validate_version_name(version: str) -> str:
    if not isinstance(version, str) or not VERSION_RE.match(version) or version in (".", ".."):
        raise BundleError(
            f"invalid bundle version {version!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return version


def resolve_bundle_dir(root: str | Path, version: str) -> Path:
    """ROOT/VERSION, refusing names or symlinks that lead outside the root."""
    validate_version_name(version)
    root_real = Path(root).resolve()
    candidate = (root_real / version).resolve()
    if candidate.parent != root_real:
        raise BundleError(f"bundle {version!r} resolves outside the bundle root {root_real}")
    if not candidate.is_dir():
        raise BundleError(f"no bundle {version!r} under {root_real}")
    return candidate


def read_manifest(bundle_dir: str | Path) -> Manifest:
    path = Path(bundle_dir) / MANIFEST
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise BundleError(f"{path}: missing manifest") from exc
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path}: unreadable manifest: {exc}") from exc
    if isinstance(raw, dict) and raw.get("format_version") != BUNDLE_FORMAT_VERSION:
        raise BundleError(
            f"{path}: bundle format {raw.get('format_version')!r}, this engine reads {BUNDLE_FORMAT_VERSION}"
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        raise BundleError(f"{path}: invalid manifest: {exc}") from exc


def list_bundles(root: str | Path) -> list[Manifest]:
    """Manifests of every readable bundle directly under root, oldest first."""
    found = []
    root = Path(root)
    if not root.is_dir():
        return found
    for child in root.iterdir():
        if child.name.startswith(".") or not child.is_dir() or not VERSION_RE.match(child.name):
            continue
        try:
            found.append(read_manifest(child))
        except BundleError:
            continue
    return sorted(found, key=lambda m: (m.created_at, m.version))


def newest_version(root: str | Path) -> str:
    bundles = list_bundles(root)
    if not bundles:
        raise BundleError(f"no bundle under {Path(root).resolve()}")
    return bundles[-1].version


def write_manifest(staging: Path, manifest_fields: dict[str, Any]) -> Manifest:
    """Checksum every file in `staging` and write its manifest.json."""
    files = {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file() and p.name != MANIFEST}
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
        raise BundleError(f"{staging}: cannot write manifest, missing {', '.join(missing)}")
    fields = {"format_version": BUNDLE_FORMAT_VERSION, "created_at": utc_now(), **manifest_fields, "files": files}
    manifest = Manifest.model_validate(fields)
    (staging / MANIFEST).write_text(manifest.model_dump_json(indent=2), encoding="utf-8")
    return manifest


def finalize_bundle(staging: Path, root: Path, manifest_fields: dict[str, Any]) -> Path:
    """Write the manifest of `staging` and rename it to ROOT/VERSION.

    The rename is the commit point: a crash before it leaves only a hidden staging
    directory, never a half-written bundle under its final name.
    """
    version = validate_version_name(manifest_fields["version"])
    final = Path(root) / version
    if final.exists():
        raise BundleError(f"bundle {final} already exists; bundles are immutable, pick another version")
    write_manifest(staging, manifest_fields)
    for p in staging.iterdir():
        _fsync(p)
    os.rename(staging, final)
    _fsync(final.parent)
    return final


def staging_dir(root: Path, version: str) -> Path:
    validate_version_name(version)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".staging-{version}-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    return staging


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Bundle:
    """A validated bundle, ready to serve. Use `Bundle.load`; never construct directly."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self.tokenizer: Tokenizer
        self.labels: LabelTable
        self.classifiers: np.ndarray
        self.classifier_bias: np.ndarray
        self.centroids: np.ndarray
        self.index_w: VectorIndex
        self.index_mu: VectorIndex
        self.tree = None
        self.token_shortlist: TokenShortlist | None = None
        self.encoder_path = path / ENCODER
        self._encoders: dict[int, OnnxEncoder] = {}

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def has_tree(self) -> bool:
        return self.tree is not None

    @classmethod
    def load(
        cls, path: str | Path, *, verify_checksums: bool = True, canary: bool = True, staged: bool = False
    ) -> Bundle:
        """Validate and open a bundle: checksums, shapes, format version, canary queries.

        Raises BundleError naming the file and what is wrong; nothing half-loaded escapes.
        `staged` is for export only: a bundle still in its staging directory, before rename.
        """
        path = Path(path)
        if not path.is_dir():
            raise BundleError(f"{path}: no such bundle directory")
        manifest = read_manifest(path)
        if not staged and manifest.version != path.name:
            raise BundleError(f"{path / MANIFEST}: version {manifest.version!r} does not match directory name")
        bundle = cls(path, manifest)
        bundle._check_files(verify_checksums)
        bundle._open_arrays()
        if canary:
            bundle._run_canary()
        return bundle

    def _check_files(self, verify_checksums: bool) -> None:
        files = self.manifest.files
        for name in REQUIRED_FILES:
            if name not in files:
                raise BundleError(f"{self.path / MANIFEST}: required file {name} is not listed")
        for name, digest in files.items():
            if name not in REQUIRED_FILES and name not in OPTIONAL_FILES:
                raise BundleError(f"{self.path / MANIFEST}: unknown file {name} listed")
            p = self.path / name
            if not p.is_file():
                raise BundleError(f"{p}: listed in the manifest but missing")
            if verify_checksums and sha256_file(p) != digest:
                raise BundleError(f"{p}: sha256 mismatch (file corrupted or modified)")

    def _load_array(self, name: str) -> np.ndarray:
        p = self.path / name
        try:
            return np.load(p, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise BundleError(f"{p}: unreadable array: {exc}") from exc

    def _array(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        p = self.path / name
        arr = self._load_array(name)
        if arr.dtype != np.float32 or arr.shape != shape:
            raise BundleError(f"{p}: expected float32 {shape}, found {arr.dtype} {arr.shape}")
        return arr

    def _open_arrays(self) -> None:
        m = self.manifest
        L, D = m.num_labels, m.dim
        try:
            self.tokenizer = Tokenizer.load(self.path / TOKENIZER)
            self.labels = LabelTable.load(self.path / LABELS)
        except (OSError, ValueError) as exc:
            raise BundleError(str(exc)) from exc
        if self.tokenizer.vocab_size != m.vocab_size:
            raise BundleError(
                f"{self.path / TOKENIZER}: vocab size {self.tokenizer.vocab_size}, manifest says {m.vocab_size}"
            )
        if len(self.labels) != L:
            raise BundleError(f"{self.path / LABELS}: {len(self.labels)} labels, manifest says {L}")
        self.classifiers = self._array(CLASSIFIERS, (L, D))
        self.classifier_bias = self._array(CLASSIFIER_BIAS, (L,))
        self.centroids = self._array(CENTROIDS, (L, D))
        ef = m.hnsw.ef_search
        try:
            self.index_w = VectorIndex.load(self.path / HNSW_W, dim=D + 1, count=L, ef_search=ef)
            self.index_mu = VectorIndex.load(self.path / HNSW_MU, dim=D, count=L, ef_search=ef)
        except ValueError as exc:
            raise BundleError(str(exc)) from exc
        self._open_token_shortlist()
        if (self.path / TREE).is_file() and TREE in m.files:
            from service.engine.tree import TreeScorer

            try:
                with np.load(self.path / TREE, allow_pickle=False) as z:
                    arrays = {k: z[k] for k in z.files}
                tree = TreeScorer.from_arrays(arrays)
                tree.validate(L, D)
            except (OSError, ValueError, KeyError) as exc:
                raise BundleError(f"{self.path / TREE}: {exc}") from exc
            self.tree = tree

    def _open_token_shortlist(self) -> None:
        m = self.manifest
        form = m.scoring.lexical_form
        listed = [name for names in LEXICAL_FILES.values() for name in names if name in m.files]
        if TOKEN_SHORTLIST not in m.files:
            if m.scoring.shortlist.k_tok:
                raise BundleError(f"{self.path / MANIFEST}: k_tok > 0 but {TOKEN_SHORTLIST} is not listed")
            if listed:
                raise BundleError(f"{self.path / MANIFEST}: {listed[0]} without {TOKEN_SHORTLIST}")
            if m.scoring.lexical_weight:
                raise BundleError(f"{self.path / MANIFEST}: lexical_weight > 0 but {TOKEN_SHORTLIST} is not listed")
            return
        stray = [name for name in listed if name not in LEXICAL_FILES[form]]
        if stray:
            raise BundleError(f"{self.path / MANIFEST}: {stray[0]} is not a file of lexical_form {form!r}")
        p = self.path / TOKEN_SHORTLIST
        labels = self._load_array(TOKEN_SHORTLIST)
        if labels.dtype != np.int32 or labels.ndim != 2 or labels.shape[0] != m.vocab_size:
            raise BundleError(f"{p}: expected int32 [{m.vocab_size}, M], found {labels.dtype} {labels.shape}")
        k_tok = m.scoring.shortlist.k_tok
        if k_tok > labels.shape[1]:
            raise BundleError(f"{p}: k_tok={k_tok} but rows hold {labels.shape[1]} labels")
        if labels.size and (int(labels.min()) < -1 or int(labels.max()) >= m.num_labels):
            raise BundleError(f"{p}: label ids outside [-1, {m.num_labels})")
        weights = bias = None
        if listed:
            missing = [name for name in LEXICAL_FILES[form] if name not in m.files]
            if missing:
                raise BundleError(f"{self.path / MANIFEST}: lexical_form {form!r} needs {missing[0]}")
            weights = self._array(LEXICAL_FILES[form][0], labels.shape)
            if not np.all(np.isfinite(weights)):
                raise BundleError(f"{self.path / LEXICAL_FILES[form][0]}: weights must be finite")
            if form == "shares" and not (
                float(weights.min(initial=0.0)) >= 0.0 and float(weights.max(initial=0.0)) <= 1.0
            ):
                raise BundleError(f"{self.path / TOKEN_SHORTLIST_SHARES}: shares must be in [0, 1]")
            if form == "logistic":
                bias = self._array(TOKEN_SHORTLIST_BIAS, (m.num_labels,))
                if not np.all(np.isfinite(bias)):
                    raise BundleError(f"{self.path / TOKEN_SHORTLIST_BIAS}: bias must be finite")
        elif m.scoring.lexical_weight:
            raise BundleError(
                f"{self.path / MANIFEST}: lexical_weight > 0 but {LEXICAL_FILES[form][0]} is not listed"
            )
        # Plain ndarray views of the maps (same pages): np.memmap indexing costs a Python call per lookup.
        try:
            self.token_shortlist = TokenShortlist(
                np.asarray(labels),
                None if weights is None else np.asarray(weights),
                form,
                None if bias is None else np.asarray(bias),
            )
        except ValueError as exc:
            raise BundleError(f"{self.path / LEXICAL_FILES[form][0]}: {exc}") from exc

    def _run_canary(self) -> None:
        from service.engine.predictor import Predictor

        try:
            predictor = Predictor(self)
            texts = [c.text for c in self.manifest.canary] or [self.labels.titles[0]]
            ids, scores = predictor.predict_ids(texts, k=5)
            if self.tree is not None:
                predictor.predict_tree_ids(texts[:1], k=5)
        except BundleError:
            raise
        except Exception as exc:  # any runtime failure on the path disqualifies the bundle
            raise BundleError(f"{self.path}: canary query failed: {type(exc).__name__}: {exc}") from exc
        if not np.all(np.isfinite(scores[ids >= 0])):
            raise BundleError(f"{self.path}: canary query produced non-finite scores")
        for c, row_ids, row_scores in zip(self.manifest.canary, ids, scores, strict=False):
            if not c.top_ids:
                continue
            if c.top_ids[0] not in row_ids.tolist():
                raise BundleError(
                    f"{self.path}: canary {c.text!r}: expected label {c.top_ids[0]} in the top 5, got "
                    f"{row_ids.tolist()} (encoder, arrays and indices disagree with export)"
                )
            if abs(float(row_scores[0]) - c.top_scores[0]) > 1e-3 * max(1.0, abs(c.top_scores[0])):
                raise BundleError(
                    f"{self.path}: canary {c.text!r}: top score {row_scores[0]:.6f}, export saw {c.top_scores[0]:.6f}"
                )

    def encoder(self, threads: int = 1) -> OnnxEncoder:
        """The bundle's onnxruntime session with `threads` intra-op threads, made once and shared
        (sessions are thread-safe; making one costs ~45 ms of CPU, and the canary's predictor and
        the serving predictor would otherwise each make their own)."""
        threads = max(1, int(threads))
        if threads not in self._encoders:
            self._encoders[threads] = OnnxEncoder(self.encoder_path, threads=threads)
        return self._encoders[threads]

    def validation_rows(self) -> list[dict[str, Any]]:
        """Held-out {"text", "target_ind"} rows stored at export, for a quality gate ([] if none)."""
        p = self.path / VALIDATION
        if not p.is_file():
            return []
        with p.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def close(self) -> None:
        """Drop references to memory maps, indices and the tree so their memory can be released."""
        for name in ("classifiers", "classifier_bias", "centroids", "index_w", "index_mu", "tree", "token_shortlist"):
            if hasattr(self, name):
                setattr(self, name, None)
        self._encoders.clear()
