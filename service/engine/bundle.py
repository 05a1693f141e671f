"""A bundle directory opened for serving: files checked against the manifest (service.engine.schema),
arrays memory-mapped, and the shortlist sources opened on first need.

Opening checks every listed file's checksum, the manifest's shapes and the tokenizer, label
table and vector arrays; the tree (served by its own route) is opened and checked too. The
HNSW indices and the token table are opened, and checked, the first time a Predictor needs
them: a bundle whose scoring searches no index never reads one. Answers through the whole path
(the canary) are checked by service.engine.canary, which needs a Predictor.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Literal

import numpy as np

from service.engine.encoder import OnnxEncoder
from service.engine.index import VectorIndex
from service.engine.labels import LabelTable
from service.engine.lexical import TokenShortlist
from service.engine.schema import (
    CENTROIDS,
    CLASSIFIER_BIAS,
    CLASSIFIERS,
    ENCODER,
    ENCODER_DATA,
    HNSW_MU,
    HNSW_W,
    KNOWN_FILES,
    LABELS,
    LEXICAL_FILES,
    MANIFEST,
    REQUIRED_FILES,
    TOKEN_SHORTLIST,
    TOKEN_SHORTLIST_BIAS,
    TOKEN_SHORTLIST_SHARES,
    TOKENIZER,
    TREE,
    TREE_ARRAYS,
    TREE_ARRAYS_SINCE,
    VALIDATION,
    BundleError,
    Manifest,
    sha256_file,
)
from service.engine.store import read_manifest
from service.engine.tokenizer import Tokenizer
from service.engine.tree import TreeScorer

IndexName = Literal["w", "mu"]


class Bundle:
    """An opened bundle. Use `Bundle.open`; never construct directly."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self.tokenizer: Tokenizer
        self.labels: LabelTable
        self.classifiers: np.ndarray
        self.classifier_bias: np.ndarray
        self.centroids: np.ndarray
        self.tree: TreeScorer | None = None
        self._indices: dict[tuple[str, int], VectorIndex] = {}
        self._table: TokenShortlist | None = None
        self._encoders: dict[int, OnnxEncoder] = {}
        self._lock = threading.Lock()

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def has_tree(self) -> bool:
        return self.tree is not None

    @classmethod
    def open(cls, path: str | Path, *, verify_checksums: bool = True, staged: bool = False) -> Bundle:
        """Check and open a bundle; raises BundleError naming the file and what is wrong.

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
        bundle._open_tables()
        bundle._check_lexical_files()
        if manifest.has_tree:
            bundle.tree = bundle._open_tree()
        bundle.validation_rows()
        return bundle

    def _check_files(self, verify_checksums: bool) -> None:
        files = self.manifest.files
        for name in REQUIRED_FILES:
            if name not in files:
                raise BundleError(f"{self.path / MANIFEST}: required file {name} is not listed")
        for name, digest in files.items():
            if name not in KNOWN_FILES:
                raise BundleError(f"{self.path / MANIFEST}: unknown file {name} listed")
            p = self.path / name
            if not p.is_file():
                raise BundleError(f"{p}: listed in the manifest but missing")
            if verify_checksums and sha256_file(p) != digest:
                raise BundleError(f"{p}: sha256 mismatch (file corrupted or modified)")

    def _load_array(self, name: str) -> np.ndarray:
        p = self.path / name
        try:
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
        except Exception as exc:  # numpy parses a header with Python's tokenizer: any error type
            raise BundleError(f"{p}: unreadable array: {type(exc).__name__}: {exc}") from exc
        # A map covers only what the header declares: bytes past it mean the file is not what
        # export wrote (appended to, or a header rewritten to a smaller shape).
        if isinstance(arr, np.memmap) and arr.offset + arr.nbytes != p.stat().st_size:
            raise BundleError(f"{p}: {p.stat().st_size} bytes, the header declares {arr.offset + arr.nbytes}")
        return arr

    def _array(self, name: str, shape: tuple[int, ...], dtype: type = np.float32, of: str = MANIFEST) -> np.ndarray:
        """The array `name`, of the `shape` that file `of` implies; a float array is also checked
        finite: NaN in one row silently drops that label from every answer (a NaN score never
        ranks), Inf makes it win every one."""
        arr = self._load_array(name)
        if arr.dtype != dtype or arr.shape != shape:
            raise BundleError(f"{self.path / name}: expected {np.dtype(dtype)} {shape} (from {of}), "
                              f"found {arr.dtype} {arr.shape}")
        if arr.dtype.kind == "f":
            bad = _first_non_finite(arr)
            if bad is not None:
                raise BundleError(f"{self.path / name}: non-finite value at flat index {bad}")
        return arr

    def _open_tables(self) -> None:
        m = self.manifest
        try:
            self.tokenizer = Tokenizer.load(self.path / TOKENIZER)
            self.labels = LabelTable.load(self.path / LABELS)
        except (OSError, ValueError) as exc:
            raise BundleError(str(exc)) from exc
        if self.tokenizer.vocab_size != m.vocab_size:
            raise BundleError(
                f"{self.path / TOKENIZER}: vocab size {self.tokenizer.vocab_size}, manifest says {m.vocab_size}"
            )
        if len(self.labels) != m.num_labels:
            raise BundleError(f"{self.path / LABELS}: {len(self.labels)} labels, manifest says {m.num_labels}")
        self.classifiers = self._array(CLASSIFIERS, (m.num_labels, m.dim))
        self.classifier_bias = self._array(CLASSIFIER_BIAS, (m.num_labels,))
        self.centroids = self._array(CENTROIDS, (m.num_labels, m.dim))

    def _check_lexical_files(self) -> None:
        """The token table's files agree with the manifest's scoring (opened on first need)."""
        m, manifest_path = self.manifest, self.path / MANIFEST
        form = m.scoring.lexical_form
        listed = [name for names in LEXICAL_FILES.values() for name in names if name in m.files]
        if TOKEN_SHORTLIST not in m.files:
            if m.scoring.shortlist.k_tok:
                raise BundleError(f"{manifest_path}: k_tok > 0 but {TOKEN_SHORTLIST} is not listed")
            if listed:
                raise BundleError(f"{manifest_path}: {listed[0]} without {TOKEN_SHORTLIST}")
        stray = [name for name in listed if name not in LEXICAL_FILES[form]]
        if stray:
            raise BundleError(f"{manifest_path}: {stray[0]} is not a file of lexical_form {form!r}")
        missing = [name for name in LEXICAL_FILES[form] if name not in m.files]
        if listed and missing:
            raise BundleError(f"{manifest_path}: lexical_form {form!r} needs {missing[0]}")
        if m.scoring.lexical_weight and not listed:
            raise BundleError(f"{manifest_path}: lexical_weight > 0 but {LEXICAL_FILES[form][0]} is not listed")

    def _open_tree(self) -> TreeScorer:
        m = self.manifest
        try:
            with np.load(self.path / TREE, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            for name, arr in arrays.items():
                if name not in TREE_ARRAYS:
                    raise BundleError(f"{self.path / TREE}: unknown array {name!r}")
                if arr.dtype != np.dtype(TREE_ARRAYS[name]):
                    raise BundleError(f"{self.path / TREE}: array {name} is {arr.dtype}, expected {TREE_ARRAYS[name]}")
                if TREE_ARRAYS_SINCE.get(name, 1) > m.format_version:
                    raise BundleError(f"{self.path / TREE}: array {name} needs bundle format "
                                      f">= {TREE_ARRAYS_SINCE[name]}, the manifest says {m.format_version}")
            tree = TreeScorer.from_arrays(arrays)
            tree.validate(m.num_labels, m.dim, m.vocab_size)
        except BundleError:
            raise
        except Exception as exc:  # a damaged zip raises zipfile's, zlib's or numpy's own errors
            raise BundleError(f"{self.path / TREE}: {type(exc).__name__}: {exc}") from exc
        return tree

    # -- shortlist sources, opened on first need -----------------------------------------

    def index(self, name: IndexName, ef_search: int | None = None) -> VectorIndex:
        """The HNSW index over [w_l, b_l] ("w") or mu_l ("mu"), opened and checked on first
        use and shared after; another ef_search opens a copy of its own, so one caller's
        search breadth never changes another's."""
        m = self.manifest
        ef = int(ef_search or m.hnsw.ef_search)
        with self._lock:
            index = self._indices.get((name, ef))
            if index is None:
                file, dim = (HNSW_W, m.dim + 1) if name == "w" else (HNSW_MU, m.dim)
                try:
                    index = VectorIndex.load(self.path / file, dim=dim, count=m.num_labels, ef_search=ef)
                except ValueError as exc:
                    raise BundleError(str(exc)) from exc
                self._indices[(name, ef)] = index
        return index

    def token_table(self) -> TokenShortlist | None:
        """The token shortlist with the manifest's lexical form (None if the bundle has none),
        opened and checked on first use."""
        if TOKEN_SHORTLIST not in self.manifest.files:
            return None
        with self._lock:
            if self._table is None:
                self._table = self._open_token_table()
        return self._table

    def _open_token_table(self) -> TokenShortlist:
        m = self.manifest
        p = self.path / TOKEN_SHORTLIST
        labels = self._load_array(TOKEN_SHORTLIST)
        if labels.dtype != np.int32 or labels.ndim != 2 or labels.shape[0] != m.vocab_size:
            raise BundleError(f"{p}: expected int32 [{m.vocab_size}, M], found {labels.dtype} {labels.shape}")
        if m.scoring.shortlist.k_tok > labels.shape[1]:
            raise BundleError(f"{p}: k_tok={m.scoring.shortlist.k_tok} but rows hold {labels.shape[1]} labels")
        if labels.size and (int(labels.min()) < -1 or int(labels.max()) >= m.num_labels):
            raise BundleError(f"{p}: label ids outside [-1, {m.num_labels})")
        form = m.scoring.lexical_form
        weights_file = LEXICAL_FILES[form][0]
        weights = bias = None
        if weights_file in m.files:
            weights = self._array(weights_file, labels.shape, of=TOKEN_SHORTLIST)
            low, high = float(weights.min(initial=0.0)), float(weights.max(initial=0.0))
            if form == "shares" and not (low >= 0.0 and high <= 1.0):
                raise BundleError(f"{self.path / TOKEN_SHORTLIST_SHARES}: shares must be in [0, 1]")
            if form == "logistic":
                bias = self._array(TOKEN_SHORTLIST_BIAS, (m.num_labels,))
        try:
            # Plain ndarray views of the maps (same pages): np.memmap indexing costs a Python call per lookup.
            return TokenShortlist(np.asarray(labels), None if weights is None else np.asarray(weights), form,
                                  None if bias is None else np.asarray(bias))
        except ValueError as exc:
            raise BundleError(f"{self.path / weights_file}: {exc}") from exc

    def encoder(self, threads: int = 1) -> OnnxEncoder:
        """The bundle's onnxruntime session with `threads` intra-op threads, made once and shared
        (sessions are thread-safe; making one costs ~45 ms of CPU)."""
        threads = max(1, int(threads))
        with self._lock:
            if threads not in self._encoders:
                try:
                    encoder = OnnxEncoder(self.path / ENCODER, threads=threads)
                except ValueError as exc:
                    raise BundleError(f"{self._encoder_files()}: {exc}") from exc
                if not self._encoders:
                    self._check_encoder(encoder)
                self._encoders[threads] = encoder
            return self._encoders[threads]

    def _encoder_files(self) -> str:
        """The encoder's file(s), for messages: a fault in either is a fault of the encoder."""
        external = self.path / ENCODER_DATA
        return f"{self.path / ENCODER} with {external}" if external.exists() else str(self.path / ENCODER)

    def _check_encoder(self, encoder: OnnxEncoder) -> None:
        """Every token id the tokenizer can produce encodes (alone, and as an empty text) to a
        finite vector of the manifest's dimension: a graph whose embedding table is shorter than
        the vocabulary, or holds NaN in some row, would otherwise fail only on the requests
        whose text holds that token."""
        vocab, dim = self.manifest.vocab_size, self.manifest.dim
        batches = [(np.zeros((1, 1), np.int64), np.zeros((1, 1), np.float32))]
        for start in range(1, vocab, 4096):
            ids = np.arange(start, min(vocab, start + 4096), dtype=np.int64)[:, None]
            batches.append((ids, np.ones(ids.shape, np.float32)))
        for ids, weights in batches:
            try:
                out = encoder.run(ids, weights)
            except Exception as exc:  # onnxruntime's own exception types
                raise BundleError(f"{self._encoder_files()}: token ids {ids[0, 0]}..{ids[-1, 0]}: {exc}") from exc
            if out.shape != (len(ids), dim) or out.dtype != np.float32:
                raise BundleError(f"{self._encoder_files()}: embeddings {out.dtype} {out.shape}, expected float32 "
                                  f"[{len(ids)}, {dim}]")
            bad = _first_non_finite(out)
            if bad is not None:
                raise BundleError(f"{self._encoder_files()}: token id {int(ids[bad // dim, 0])} encodes to a "
                                  "non-finite vector")

    def validation_rows(self) -> list[dict[str, Any]]:
        """Held-out {"text", "target_ind"} rows stored at export, for a quality gate ([] if none);
        BundleError naming the line of a row that is not one."""
        p = self.path / VALIDATION
        if VALIDATION not in self.manifest.files:
            return []
        rows = []
        with p.open("rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    rows.append(_validation_row(line, self.manifest.num_labels, f"{p}:{number}"))
        return rows

    def close(self) -> None:
        """Drop references to memory maps, indices and the tree so their memory can be released."""
        for name in ("classifiers", "classifier_bias", "centroids", "tree"):
            if hasattr(self, name):
                setattr(self, name, None)
        with self._lock:
            self._indices.clear()
            self._table = None
            self._encoders.clear()


_CHUNK = 1 << 20


def _first_non_finite(arr: np.ndarray) -> int | None:
    """Flat index of the first NaN or Inf, or None; a chunk at a time, so a memory-mapped
    array of 10^6 rows needs no temporary of its size."""
    flat = arr.reshape(-1)
    for start in range(0, len(flat), _CHUNK):
        ok = np.isfinite(flat[start : start + _CHUNK])
        if not ok.all():
            return start + int(np.argmin(ok))
    return None


def _validation_row(line: bytes, num_labels: int, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
        text, targets = row["text"], row["target_ind"]
    except (ValueError, KeyError, TypeError) as exc:
        raise BundleError(f"{where}: bad validation row: {exc!r}") from exc
    if not isinstance(text, str) or not isinstance(targets, list) or not all(
        type(t) is int and 0 <= t < num_labels for t in targets
    ):
        raise BundleError(f"{where}: a validation row is {{\"text\": str, \"target_ind\": [label ids < {num_labels}]}}")
    return row
