"""A bundle directory opened for serving: files checked against the manifest (service.engine.schema),
arrays memory-mapped, and the shortlist sources opened on first need.

Opening checks that every listed file is there, the checksums of the files it reads, the
manifest's shapes and the tokenizer, label table and vector arrays; the tree (served by its own
route) is opened and checked too. The HNSW indices and the token table are opened, and checked
(checksum included), the first time a Predictor needs them: a bundle whose scoring searches no
index never reads one. The vector arrays are memory-mapped (service.engine.mapped), and the
pages the checks read are handed back. Answers through the whole path (the canary) are checked
by service.engine.canary, which needs a Predictor.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Literal

import numpy as np

from service.engine import heap, vectors
from service.engine.encoder import OnnxEncoder
from service.engine.file_guard import FileStamps
from service.engine.index import VectorIndex
from service.engine.labels import LabelTable
from service.engine.lexical import TokenShortlist
from service.engine.manifests import read_manifest
from service.engine.mapped import MappedArrays
from service.engine.schema import (
    CENTROID_SCALES,
    CENTROIDS,
    CLASSIFIER_BIAS,
    CLASSIFIER_SCALES,
    CLASSIFIERS,
    ENCODER,
    ENCODER_DATA,
    HNSW_MU,
    HNSW_MU_PROJECTION,
    HNSW_W,
    HNSW_W_PROJECTION,
    KNOWN_FILES,
    LABELS,
    LEXICAL_FILES,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    REQUIRED_FILES,
    RETIRED_LABELS,
    SHARD_LABELS,
    TOKEN_OVERFLOW,
    TOKEN_OVERFLOW_WEIGHTS,
    TOKEN_SHORTLIST,
    TOKEN_SHORTLIST_BIAS,
    TOKEN_SHORTLIST_SHARES,
    TOKENIZER,
    TREE,
    TREE_ARRAYS,
    TREE_ARRAYS_SINCE,
    VALIDATION,
    VECTOR_DTYPE,
    BundleError,
    Manifest,
    sha256_file,
)
from service.engine.small_files import RefusedFile, bundle_file
from service.engine.tokenizer import Tokenizer
from service.engine.tree import TreeScorer
from service.engine.validation_rows import read_validation_rows

IndexName = Literal["w", "mu"]
# The label vectors a scorer gathers rows of are copied into the process's memory, in huge pages,
# when they take at most this much together (Bundle.label_vectors); larger ones stay file maps.
RESIDENT_VECTORS_MAX_BYTES = 256 << 20
_CHECK_BATCH = 256  # token ids a run when the encoder is checked (Bundle._check_encoder)
# Files opened (and checksummed) on first need rather than at opening: the shortlist sources.
INDEX_FILES = frozenset((HNSW_W, HNSW_MU, HNSW_W_PROJECTION, HNSW_MU_PROJECTION))
ON_FIRST_NEED = frozenset((*INDEX_FILES, TOKEN_SHORTLIST, *(n for names in LEXICAL_FILES.values() for n in names)))


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
        # The per-row scales of int8 classifiers and centroids (service.engine.vectors); None otherwise.
        self.classifier_scales: np.ndarray | None = None
        self.centroid_scales: np.ndarray | None = None
        self.tree: TreeScorer | None = None
        # A shard's parent label id of each row (manifest `shard`); None in a whole bundle.
        self.shard_labels: np.ndarray | None = None
        # True for retired labels (labels_retired.npy); None when none is.
        self.retired: np.ndarray | None = None
        self._indices: dict[tuple[str, int], VectorIndex] = {}
        self._table: TokenShortlist | None = None
        self._encoders: dict[int, OnnxEncoder] = {}
        self._maps = MappedArrays()
        self._label_vectors: tuple[np.ndarray, np.ndarray] | None = None
        self._unverified: set[str] = set()
        self._lock = threading.Lock()
        self.stamps = FileStamps(path, [])

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def has_tree(self) -> bool:
        return self.tree is not None

    @classmethod
    def open(cls, path: str | Path, *, verify_checksums: bool = True, staged: bool = False,
             max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> Bundle:
        """Check and open a bundle; raises BundleError naming the file and what is wrong.

        `staged` is for export only: a bundle still in its staging directory, before rename.
        `max_manifest_bytes`: the most of manifest.json read (schema.MAX_MANIFEST_BYTES by default).
        """
        path = Path(path)
        if not path.is_dir():
            raise BundleError(f"{path}: no such bundle directory")
        manifest = read_manifest(path, max_manifest_bytes)
        if not staged and manifest.version != path.name:
            raise BundleError(f"{path / MANIFEST}: version {manifest.version!r} does not match directory name")
        if not staged and not manifest.canary:
            # The canaries are the check that the loaded bundle answers as export saw it answer
            # (service.engine.canary); with none, any array, index or encoder would pass it. Only a
            # bundle still being written (staged) has none yet.
            raise BundleError(f"{path / MANIFEST}: canary: empty; a bundle records the answers it is checked against")
        bundle = cls(path, manifest)
        try:
            bundle._check_files(verify_checksums)
            bundle._open_tables()
            bundle._open_retired()
            bundle._check_lexical_files()
            bundle.shard_labels = bundle._open_shard_labels()
            if manifest.has_tree:
                bundle.tree = bundle._open_tree()
            bundle.validation_rows()
        finally:
            # The checks read every page of the maps: hand them back, serving touches a few
            # rows (and a refused bundle's pages are then mapped by no one).
            bundle._maps.release()
        return bundle

    @classmethod
    def open_query_side(cls, path: str | Path, max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> Bundle:
        """Only what turns texts into encoded queries: the manifest, and the tokenizer and
        encoder files checked (checksums, vocabulary size; every token id encodes when the
        encoder is first made). No label array is opened: a router that encodes a query once
        for every shard of a sharded bundle (service.api.ray_app) holds no label of its own."""
        path = Path(path)
        manifest = read_manifest(path, max_manifest_bytes)
        if manifest.version != path.name:
            raise BundleError(f"{path / MANIFEST}: version {manifest.version!r} does not match directory name")
        bundle = cls(path, manifest)
        for name in (TOKENIZER, ENCODER, ENCODER_DATA):
            if name in manifest.files and sha256_file(path / name) != manifest.files[name]:
                raise BundleError(f"{path / name}: sha256 mismatch (file corrupted or modified)")
        bundle.tokenizer = bundle._open_tokenizer()
        return bundle

    def _check_files(self, verify_checksums: bool) -> None:
        """Every listed file is known and present; the checksums of the files read at opening
        are verified now, those of the sources opened on first need (ON_FIRST_NEED) then: at
        10^6 labels the HNSW indices are 2.6 GB that a bundle serving the token rows never reads."""
        files = self.manifest.files
        self.stamps = FileStamps(self.path, [MANIFEST, *files])
        for name in REQUIRED_FILES:
            if name not in files:
                raise BundleError(f"{self.path / MANIFEST}: required file {name} is not listed")
        for name in files:
            if name not in KNOWN_FILES:
                raise BundleError(f"{self.path / MANIFEST}: unknown file {name} listed")
            try:
                bundle_file(self.path, name)  # the one rule for a bundle's files, its manifest's too
            except FileNotFoundError:
                raise BundleError(f"{self.path / name}: listed in the manifest but missing") from None
            except RefusedFile as exc:
                raise BundleError(str(exc)) from None
        self._unverified = set(files) if verify_checksums else set()
        for name in sorted(set(files) - ON_FIRST_NEED):
            self._verify(name)

    def _verify(self, name: str) -> None:
        """The file's sha256 against the manifest's, once (no-op without checksums)."""
        if name in self._unverified:
            p = self.path / name
            if sha256_file(p) != self.manifest.files[name]:
                raise BundleError(f"{p}: sha256 mismatch (file corrupted or modified)")
            self._unverified.discard(name)

    def _load_array(self, name: str) -> np.ndarray:
        """A memory map of the .npy file `name`, exactly as long as its header declares: bytes
        past it mean the file is not what export wrote (appended to, or a header rewritten to
        a smaller shape)."""
        p = self.path / name
        try:
            return self._maps.npy(p)
        except Exception as exc:  # numpy parses a header with Python's tokenizer: any error type
            raise BundleError(f"{p}: unreadable array: {type(exc).__name__}: {exc}") from exc

    @property
    def vector_dtype(self) -> np.dtype:
        """dtype of the [L, D] label vectors (schema: the manifest's vector_dtype)."""
        return np.dtype(self.manifest.vector_dtype)

    def _array(self, name: str, shape: tuple[int, ...], dtype: type | np.dtype = np.float32,
               of: str = MANIFEST) -> np.ndarray:
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
            self._maps.release()  # at once: the peak while opening holds one array, not all
        return arr

    def _open_tokenizer(self) -> Tokenizer:
        try:
            tokenizer = Tokenizer.load(self.path / TOKENIZER)
        except (OSError, ValueError) as exc:
            raise BundleError(str(exc)) from exc
        if tokenizer.vocab_size != self.manifest.vocab_size:
            raise BundleError(
                f"{self.path / TOKENIZER}: vocab size {tokenizer.vocab_size}, manifest says {self.manifest.vocab_size}"
            )
        return tokenizer

    def _open_tables(self) -> None:
        m = self.manifest
        self.tokenizer = self._open_tokenizer()
        try:
            self.labels = LabelTable.load(self.path / LABELS)
        except (OSError, ValueError) as exc:
            raise BundleError(str(exc)) from exc
        self._maps.also_check(self.path / LABELS, self.labels.file_map)
        if len(self.labels) != m.num_labels:
            raise BundleError(f"{self.path / LABELS}: {len(self.labels)} labels, manifest says {m.num_labels}")
        self.classifiers = self._array(CLASSIFIERS, (m.num_labels, m.dim), self.vector_dtype)
        self.classifier_bias = self._array(CLASSIFIER_BIAS, (m.num_labels,))
        self.centroids = self._array(CENTROIDS, (m.num_labels, m.dim), self.vector_dtype)
        if m.vector_dtype == "int8":
            self.classifier_scales, self.centroid_scales = (self._scales(name) for name in (CLASSIFIER_SCALES,
                                                                                             CENTROID_SCALES))

    def _scales(self, name: str) -> np.ndarray:
        """An int8 vector file's row scales: float32 [L], finite (_array) and >= 0, read into memory
        (4 bytes a label, read with every gathered row)."""
        scales = np.array(self._array(name, (self.manifest.num_labels,)))
        negative = np.flatnonzero(scales < 0)
        if len(negative):
            raise BundleError(f"{self.path / name}: negative scale {scales[negative[0]]} at row {negative[0]}")
        return scales

    def vector_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """float32 rows `ids` of the classifiers or the centroids (CLASSIFIERS or CENTROIDS): the
        values a scorer reads, whatever the bundle's vector_dtype."""
        values, scales = ((self.classifiers, self.classifier_scales) if name == CLASSIFIERS
                          else (self.centroids, self.centroid_scales))
        return vectors.dequantize(values[ids], None if scales is None else scales[ids])

    def _open_retired(self) -> None:
        if RETIRED_LABELS not in self.manifest.files:
            return
        p, num_labels = self.path / RETIRED_LABELS, self.manifest.num_labels
        ids = self._load_array(RETIRED_LABELS)
        if ids.dtype != np.int32 or ids.ndim != 1:
            raise BundleError(f"{p}: expected int32 [R], found {ids.dtype} {ids.shape}")
        if ids.size and (int(ids[0]) < 0 or int(ids[-1]) >= num_labels or np.any(np.diff(ids) <= 0)):
            raise BundleError(f"{p}: retired ids must be distinct, sorted and in [0, {num_labels})")
        self.retired = np.zeros(num_labels, dtype=bool)
        self.retired[ids] = True

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
        if TOKEN_OVERFLOW_WEIGHTS in m.files and TOKEN_OVERFLOW not in m.files:
            raise BundleError(f"{manifest_path}: {TOKEN_OVERFLOW_WEIGHTS} without {TOKEN_OVERFLOW}")
        if TOKEN_OVERFLOW in m.files and (TOKEN_SHORTLIST not in m.files
                                          or (TOKEN_OVERFLOW_WEIGHTS in m.files) != bool(listed)):
            raise BundleError(f"{manifest_path}: {TOKEN_OVERFLOW} needs {TOKEN_SHORTLIST}, and "
                              f"{TOKEN_OVERFLOW_WEIGHTS} exactly when the table has weights")

    def _open_shard_labels(self) -> np.ndarray | None:
        """A shard's parent label ids (increasing, in the parent's range), or None in a whole
        bundle; the file and the manifest's `shard` come together or not at all."""
        shard, listed = self.manifest.shard, SHARD_LABELS in self.manifest.files
        if shard is None or not listed:
            if shard is not None or listed:
                raise BundleError(f"{self.path / MANIFEST}: a shard has both `shard` and {SHARD_LABELS}, or neither")
            return None
        ids = np.asarray(self._array(SHARD_LABELS, (self.manifest.num_labels,), np.int64))
        if ids[0] < 0 or ids[-1] >= shard.parent_num_labels or np.any(np.diff(ids) <= 0):
            raise BundleError(f"{self.path / SHARD_LABELS}: parent label ids must increase within "
                              f"[0, {shard.parent_num_labels})")
        return ids

    def _open_tree(self) -> TreeScorer:
        m = self.manifest
        try:
            arrays = self._maps.npz(self.path / TREE)
            for name, arr in arrays.items():
                if name not in TREE_ARRAYS:
                    raise BundleError(f"{self.path / TREE}: unknown array {name!r}")
                want = self.vector_dtype if TREE_ARRAYS[name] == VECTOR_DTYPE else np.dtype(TREE_ARRAYS[name])
                if arr.dtype != want:
                    raise BundleError(f"{self.path / TREE}: array {name} is {arr.dtype}, expected {want}")
                if TREE_ARRAYS_SINCE.get(name, 1) > m.format_version:
                    raise BundleError(f"{self.path / TREE}: array {name} needs bundle format "
                                      f">= {TREE_ARRAYS_SINCE[name]}, the manifest says {m.format_version}")
            tree = TreeScorer.from_arrays(arrays)
            tree.validate(m.tree_labels, m.dim, m.vocab_size)
            self._maps.release()
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
        ef = int(ef_search or self.manifest.hnsw.ef_search)
        with self._lock:
            index = self._indices.get((name, ef))
            if index is None:
                index = self._load_index(name, ef)
                self._indices[(name, ef)] = index
        return index

    def index_copy(self, name: IndexName) -> VectorIndex:
        """A copy of the index of its own, checked as `index` checks it (checksum, then structure;
        BundleError naming the file): for a caller that modifies it (labels added after
        training), never the one searches share. Loaded without the bundle's lock: a copy of
        gigabytes takes seconds, and serving opens its own sources meanwhile."""
        return self._load_index(name, int(self.manifest.hnsw.ef_search))

    def _load_index(self, name: IndexName, ef: int) -> VectorIndex:
        m = self.manifest
        file, projection, dim = (HNSW_W, HNSW_W_PROJECTION, m.dim + 1) if name == "w" else (
            HNSW_MU, HNSW_MU_PROJECTION, m.dim)
        self._verify(file)
        if m.hnsw.projection_dim:
            self._verify(projection)
        try:
            return VectorIndex.load(self.path / file, dim=dim, count=m.num_labels, ef_search=ef,
                                    projection_dim=m.hnsw.projection_dim)
        except ValueError as exc:
            raise BundleError(str(exc)) from exc

    def token_table(self) -> TokenShortlist | None:
        """The token shortlist with the manifest's lexical form (None if the bundle has none),
        opened and checked on first use."""
        if TOKEN_SHORTLIST not in self.manifest.files:
            return None
        with self._lock:
            if self._table is None:
                self._table = self._open_token_table()
                self._maps.release()
        return self._table

    def _open_token_table(self) -> TokenShortlist:
        m = self.manifest
        p = self.path / TOKEN_SHORTLIST
        for name in sorted(ON_FIRST_NEED - INDEX_FILES):
            if name in m.files:
                self._verify(name)
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
        overflow, overflow_weights = self._open_overflow(weights is not None)
        try:
            # Plain ndarray views of the maps (same pages): np.memmap indexing costs a Python call per lookup.
            return TokenShortlist(np.asarray(labels), _plain(weights), form, _plain(bias), _plain(overflow),
                                  _plain(overflow_weights))
        except ValueError as exc:
            raise BundleError(f"{self.path / weights_file}: {exc}") from exc

    def _open_overflow(self, weighted: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The token overflow (labels added after training) and its weights, checked like the table."""
        m = self.manifest
        if TOKEN_OVERFLOW not in m.files:
            return None, None
        p = self.path / TOKEN_OVERFLOW
        labels = self._load_array(TOKEN_OVERFLOW)
        if labels.dtype != np.int32 or labels.ndim != 2 or labels.shape[0] != m.vocab_size:
            raise BundleError(f"{p}: expected int32 [{m.vocab_size}, W], found {labels.dtype} {labels.shape}")
        if labels.size and (int(labels.min()) < -1 or int(labels.max()) >= m.num_labels):
            raise BundleError(f"{p}: label ids outside [-1, {m.num_labels})")
        if not weighted:
            return labels, None
        weights = self._array(TOKEN_OVERFLOW_WEIGHTS, labels.shape, of=TOKEN_OVERFLOW)
        low, high = float(weights.min(initial=0.0)), float(weights.max(initial=0.0))
        if m.scoring.lexical_form == "shares" and not (low >= 0.0 and high <= 1.0):
            raise BundleError(f"{self.path / TOKEN_OVERFLOW_WEIGHTS}: shares must be in [0, 1]")
        return labels, weights

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
                    self._maps.also_check_file(self.path / ENCODER_DATA)  # onnxruntime maps it: checked too
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
        # Small batches: onnxruntime's memory arena keeps the largest run's buffers for the
        # session's life (4,096 ids a run left 18 MiB in every serving process, 256 leave 2.5).
        for start in range(1, vocab, _CHECK_BATCH):
            ids = np.arange(start, min(vocab, start + _CHECK_BATCH), dtype=np.int64)[:, None]
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

    def label_vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """The classifier and centroid rows [L, D] as the scorer reads them: with huge pages on
        (service.engine.heap) and both within RESIDENT_VECTORS_MAX_BYTES, copies in this process's
        memory in huge pages, made once per bundle (so processes forked after a preload share
        them); else the file maps themselves.

        A query gathers ~100 rows of each, scattered over the whole array: from a file map in
        4 KiB pages nearly every row is a TLB miss (debian-deps, 16-text batches: 1,500 -> 680 us
        a text; one text: 220 -> 64 us; bench/RESULTS.md, issue 22).
        """
        with self._lock:
            if self._label_vectors is None:
                w, mu = self.classifiers, self.centroids
                if heap.huge_pages() and w.nbytes + mu.nbytes <= RESIDENT_VECTORS_MAX_BYTES:
                    # A copy reads its map in: those pages are handed back piece by piece as
                    # they are copied, or a load's peak holds an array twice (debian-deps: +20
                    # MiB; both arrays, before the maps were released between them: +61).
                    w = heap.resident_copy(w, lambda start, stop, of=w: self._maps.release_rows(of, start, stop))
                    mu = heap.resident_copy(mu, lambda start, stop, of=mu: self._maps.release_rows(of, start, stop))
                    self._maps.release()
                self._label_vectors = (w, mu)
            return self._label_vectors

    def check_maps(self) -> None:
        """BundleChanged (file_guard) naming a mapped file truncated since it was mapped: run before
        a batch is scored, a truncation is an answer, not a SIGBUS. An fstat a file (~1.4 us)."""
        self._maps.check_sizes()

    def release_pages(self) -> None:
        """Hand back the pages of every array map (their data stays in the page cache; the next
        read maps them again): after the canary, whose tree searches alone read 20 MiB of
        tree.npz on debian-deps that a process serving the alpha route never reads again."""
        self._maps.release()

    def validation_rows(self) -> list[dict[str, Any]]:
        """Held-out {"text", "target_ind"[, "target_weight"]} rows stored at export, for a quality
        gate ([] if none); BundleError naming the line of a row that is not one."""
        if VALIDATION not in self.manifest.files:
            return []
        return read_validation_rows(self.path / VALIDATION, self.manifest.num_labels)

    def close(self) -> None:
        """Drop references to memory maps, indices and the tree so their memory can be released."""
        for name in ("classifiers", "classifier_bias", "centroids", "classifier_scales", "centroid_scales", "tree"):
            if hasattr(self, name):
                setattr(self, name, None)
        with self._lock:
            self._label_vectors = None
            self._indices.clear()
            self._table = None
            self._encoders.clear()
            self._maps.clear()


_CHUNK = 1 << 20


def drop_cached_pages(directory: Path) -> int:
    """Ask the kernel to drop the page cache of a refused bundle's files; returns how many files.

    Checking a bundle reads its files in full (checksums, then the check in a child process):
    in a container those pages are charged to the service's memory and, read twice, count as
    active (docker stats), although nothing will serve them. A file with other hard links
    (a derived bundle's shared encoder, the serving bundle's own) is left alone, and the kernel
    keeps pages any process maps.
    """
    if not hasattr(os, "posix_fadvise"):
        return 0
    dropped = 0
    for path in directory.iterdir():
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_nlink > 1:
                continue
            with path.open("rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += 1
        except OSError:
            continue
    return dropped


def _plain(arr: np.ndarray | None) -> np.ndarray | None:
    return None if arr is None else np.asarray(arr)


def _first_non_finite(arr: np.ndarray) -> int | None:
    """Flat index of the first NaN or Inf, or None; a chunk at a time, so a memory-mapped
    array of 10^6 rows needs no temporary of its size."""
    flat = arr.reshape(-1)
    for start in range(0, len(flat), _CHUNK):
        ok = np.isfinite(flat[start : start + _CHUNK])
        if not ok.all():
            return start + int(np.argmin(ok))
    return None
