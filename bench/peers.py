"""Shortlist against its peers on one XC raw-text dataset: accuracy, training time, latency, memory.

    python bench/peers.py [--data DIR] [--systems pecos,omikuji,napkinxc,shortlist] [--limit N]
                          [--shortlist-bundle PATH | --shortlist-checkpoint PATH]

Peers: libpecos XR-Linear, omikuji (Parabel-like, 3 trees) and napkinXC PLT, each on TF-IDF
unigram features built with Shortlist's own Tokenizer (so every system sees the same tokens),
and Shortlist itself (`shortlist train` -> `shortlist export` -> service.engine.Predictor).
Everything is scored by service.engine.metrics with propensities from the training split.

Each system is trained in a subprocess, then served by a fresh subprocess that loads the
model, answers single queries (text in, top-k ids out, one thread) and a batch pass over the
test split (one thread), and reports its own peak RSS. Latency includes featurisation of the
text, for the peers as for Shortlist, since a user sends text. The table goes to stdout and
to a section of bench/RESULTS.md; a plot of P@1 and PSP@5 against single-query p50 (with
Shortlist's speed knobs ef_search / shortlist sizes) goes to bench/out/ and bench/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    BENCH_DIR,
    OUT_DIR,
    REPO_ROOT,
    command_line,
    git_revision,
    latency_summary,
    peak_rss_mb,
    read_jsonl,
    replace_section,
    time_calls,
    write_jsonl_gz,
)

SYSTEMS = ("pecos", "omikuji", "napkinxc", "shortlist", "shortlist-tree")
TITLES = {
    "pecos": "PECOS XR-Linear",
    "omikuji": "Omikuji (Parabel-like, 3 trees)",
    "napkinxc": "napkinXC PLT",
    "shortlist": "Shortlist",
    "shortlist-tree": "Shortlist tree route (/v1/predict/tree)",
}
DISTRIBUTIONS = {"pecos": "libpecos", "omikuji": "omikuji", "napkinxc": "napkinxc", "shortlist": "shortlist",
                 "shortlist-tree": "shortlist"}
# Shortlist's own rows (the same bundle through either route); the others are its peers.
OURS = ("shortlist", "shortlist-tree")
K = 5
# Batch predictions keep one more label than K, so the same predictions also give the metrics
# with each document's own label left out (at most one label per document is its own).
RANKED = K + 1
# The metrics the Shortlist-minus-peer intervals are given for: the bars.
PAIRED_METRICS = ("P@1", "P@5", "PSP@5")
# Serving runs single-threaded so latency is per core and comparable across libraries.
ONE_THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "RAYON_NUM_THREADS": "1",
}


RESULTS_PREAMBLE = """# Benchmark results

Written by the scripts in bench/; each section names the command that produced it and is
replaced when that command runs again. The peers install apart from Shortlist's own
dependencies (libpecos pins numpy<2, see pyproject.toml):

    pip install -e '.[bench]' && pip install --no-deps libpecos==1.2.8
"""


class BenchError(RuntimeError):
    """A system could not be trained or served; the message says which and why."""


# --------------------------------------------------------------------------- run files


@dataclass
class RunFiles:
    """Everything the workers of one run share, as paths (workers are separate processes)."""

    run_dir: str
    data_dir: str
    text_field: str
    tokenizer: str
    x_trn: str
    y_trn: str
    x_tst: str
    tst_texts: str
    num_features: int
    num_labels: int

    @property
    def models(self) -> Path:
        return Path(self.run_dir) / "models"

    @property
    def preds(self) -> Path:
        return Path(self.run_dir) / "preds"


def subset_dataset(data_dir: Path, out_dir: Path, limit: int) -> Path:
    """First `limit` train and test documents of data_dir, with the full label file, in out_dir."""
    from training.data import find_split_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for split in ("trn", "tst"):
        src = find_split_file(data_dir, split)
        if src is None:
            raise BenchError(f"{data_dir}: no {split} file")
        write_jsonl_gz(out_dir / f"{split}.json.gz", read_jsonl(src, limit=limit))
    lbl = find_split_file(data_dir, "lbl")
    if lbl is None:
        raise BenchError(f"{data_dir}: no lbl file")
    target = out_dir / ("lbl" + "".join(lbl.suffixes))
    if not target.exists():
        shutil.copyfile(lbl, target)
    return out_dir


def texts_to_csr(tokenizer: Any, texts: Sequence[str], num_features: int) -> Any:
    """TF-IDF rows of `texts` as CSR float32; column j is token id j + 1 (id 0 is padding)."""
    import scipy.sparse as sp

    indptr = [0]
    indices: list[int] = []
    values: list[float] = []
    for text in texts:
        ids, weights = tokenizer.encode(text)
        indices.extend(i - 1 for i in ids)
        values.extend(weights)
        indptr.append(len(indices))
    matrix = sp.csr_matrix(
        (np.asarray(values, dtype=np.float32), np.asarray(indices, dtype=np.int32), np.asarray(indptr, dtype=np.int64)),
        shape=(len(texts), num_features),
    )
    # The tokenizer keeps first-occurrence order; PECOS and omikuji's file format want sorted columns.
    matrix.sort_indices()
    return matrix


def prepare_run(args: argparse.Namespace) -> tuple[RunFiles, Any, Any]:
    """Load the dataset, fit the shared tokenizer, write features; returns (files, trn, tst) splits."""
    import scipy.sparse as sp

    from service.engine.tokenizer import Tokenizer
    from training.data import load_labels, load_split

    data_dir = Path(args.data).resolve()
    name = data_dir.name + (f"-limit{args.limit}" if args.limit else "")
    run_dir = Path(args.out or OUT_DIR / name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.limit:
        data_dir = subset_dataset(data_dir, run_dir / "data", args.limit)
    labels = load_labels(data_dir)
    trn = load_split(data_dir, "trn", args.text_field, num_labels=len(labels))
    tst = load_split(data_dir, "tst", args.text_field, num_labels=len(labels))
    tokenizer = Tokenizer.fit(trn.texts, min_df=args.min_df, max_vocab=args.max_vocab, max_tokens=args.max_tokens)
    num_features = tokenizer.vocab_size - 1
    files = RunFiles(
        run_dir=str(run_dir),
        data_dir=str(data_dir),
        text_field=args.text_field,
        tokenizer=str(run_dir / "tokenizer.json"),
        x_trn=str(run_dir / "X_trn.npz"),
        y_trn=str(run_dir / "Y_trn.npz"),
        x_tst=str(run_dir / "X_tst.npz"),
        tst_texts=str(run_dir / "tst_texts.json"),
        num_features=num_features,
        num_labels=len(labels),
    )
    tokenizer.save(files.tokenizer)
    sp.save_npz(files.x_trn, texts_to_csr(tokenizer, trn.texts, num_features))
    sp.save_npz(files.x_tst, texts_to_csr(tokenizer, tst.texts, num_features))
    rows = np.repeat(np.arange(len(trn)), [len(t) for t in trn.targets])
    cols = np.fromiter((label for t in trn.targets for label in t), dtype=np.int64, count=len(rows))
    y = sp.csr_matrix((np.ones(len(rows), dtype=np.float32), (rows, cols)), shape=(len(trn), len(labels)))
    sp.save_npz(files.y_trn, y)
    Path(files.tst_texts).write_text(json.dumps(tst.texts, ensure_ascii=False), encoding="utf-8")
    files.models.mkdir(exist_ok=True)
    files.preds.mkdir(exist_ok=True)
    return files, trn, tst


# --------------------------------------------------------------------------- peer systems


def _pad_ids(rows: Sequence[Sequence[int]], k: int) -> np.ndarray:
    out = np.full((len(rows), k), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        row = list(row)[:k]
        out[i, : len(row)] = row
    return out


def _csr_topk(pred: Any, k: int) -> np.ndarray:
    """Best-first label ids of each row of a sparse score matrix, padded with -1."""
    rows = []
    for i in range(pred.shape[0]):
        lo, hi = pred.indptr[i], pred.indptr[i + 1]
        order = np.argsort(-pred.data[lo:hi], kind="stable")[:k]
        rows.append(pred.indices[lo:hi][order].tolist())
    return _pad_ids(rows, k)


class Peer:
    """A peer library behind one interface: train from the run's files, load, predict from text."""

    name = ""

    def __init__(self, files: RunFiles) -> None:
        from service.engine.tokenizer import Tokenizer

        self.files = files
        self.tokenizer = Tokenizer.load(files.tokenizer)

    def train(self, model_dir: Path, threads: int, seed: int) -> None:
        raise NotImplementedError

    def load(self, model_dir: Path) -> None:
        raise NotImplementedError

    def predict_one(self, text: str) -> list[int]:
        raise NotImplementedError

    def predict_batch(self, texts: Sequence[str]) -> np.ndarray:
        raise NotImplementedError

    def _train_arrays(self) -> tuple[Any, Any]:
        import scipy.sparse as sp

        return sp.load_npz(self.files.x_trn).astype(np.float32), sp.load_npz(self.files.y_trn).astype(np.float32)

    def _csr(self, texts: Sequence[str]) -> Any:
        return texts_to_csr(self.tokenizer, texts, self.files.num_features)


class PecosPeer(Peer):
    """libpecos XR-Linear: PIFA label embeddings, hierarchical 2-means tree, beam 10."""

    name = "pecos"
    beam = 10

    def __init__(self, files: RunFiles) -> None:
        super().__init__(files)
        from _pecos_compat import patch_pecos

        patch_pecos()

    def train(self, model_dir: Path, threads: int, seed: int) -> None:
        from pecos.xmc import Indexer, LabelEmbeddingFactory
        from pecos.xmc.xlinear.model import XLinearModel

        x, y = self._train_arrays()
        label_emb = LabelEmbeddingFactory.create(y, x, method="pifa")
        clusters = Indexer.gen(label_emb, indexer_type="hierarchicalkmeans", seed=seed, threads=threads)
        model = XLinearModel.train(x, y, C=clusters, threads=threads)
        model.save(str(model_dir))

    def load(self, model_dir: Path) -> None:
        import scipy.sparse as sp
        from pecos.xmc.xlinear.model import XLinearModel

        self._sp = sp
        # is_predict_only loads the C++ inference structures (the fast realtime path).
        self.model = XLinearModel.load(str(model_dir), is_predict_only=True)

    def predict_one(self, text: str) -> list[int]:
        ids, weights = self.tokenizer.encode(text)
        cols = np.asarray(ids, dtype=np.int32) - 1
        order = np.argsort(cols)  # PECOS rejects unsorted column indices
        x = self._sp.csr_matrix(
            (np.asarray(weights, dtype=np.float32)[order], cols[order], np.array([0, len(ids)])),
            shape=(1, self.files.num_features),
        )
        pred = self.model.predict(x, beam_size=self.beam, only_topk=K, threads=1)
        order = np.argsort(-pred.data, kind="stable")
        return pred.indices[order].tolist()

    def predict_batch(self, texts: Sequence[str]) -> np.ndarray:
        pred = self.model.predict(self._csr(texts), beam_size=self.beam, only_topk=RANKED, threads=1)
        return _csr_topk(pred.tocsr(), RANKED)


class OmikujiPeer(Peer):
    """omikuji with its default (Parabel-like) hyper-parameters: 3 balanced 2-means trees, beam 10."""

    name = "omikuji"
    beam = 10

    def train(self, model_dir: Path, threads: int, seed: int) -> None:
        import omikuji

        x, y = self._train_arrays()
        # omikuji trains from a file in the Extreme Classification Repository's sparse format.
        path = Path(self.files.run_dir) / "omikuji_trn.txt"
        with path.open("w", encoding="utf-8") as f:
            f.write(f"{x.shape[0]} {x.shape[1]} {y.shape[1]}\n")
            for i in range(x.shape[0]):
                labels = ",".join(str(j) for j in y.indices[y.indptr[i] : y.indptr[i + 1]])
                lo, hi = x.indptr[i], x.indptr[i + 1]
                feats = " ".join(f"{j}:{v:.6g}" for j, v in zip(x.indices[lo:hi], x.data[lo:hi], strict=True))
                f.write(f"{labels} {feats}\n")
        params = omikuji.Model.default_hyper_param()
        # omikuji has no seed parameter; its trees are deterministic given the data order.
        model = omikuji.Model.train_on_data(str(path), params, n_threads=threads)
        model.save(str(model_dir))

    def load(self, model_dir: Path) -> None:
        import omikuji

        self.model = omikuji.Model.load(str(model_dir))
        self.model.init_prediction_thread_pool(1)

    def predict_one(self, text: str, k: int = K) -> list[int]:
        ids, weights = self.tokenizer.encode(text)
        pairs = [(i - 1, w) for i, w in zip(ids, weights, strict=True)]
        return [label for label, _ in self.model.predict(pairs, beam_size=self.beam, top_k=k)]

    def predict_batch(self, texts: Sequence[str]) -> np.ndarray:
        # The Python API answers one document per call; a batch is a loop over them.
        return _pad_ids([self.predict_one(t, RANKED) for t in texts], RANKED)


class NapkinxcPeer(Peer):
    """napkinXC PLT with its defaults (hierarchical 2-means tree, logistic nodes, beam search)."""

    name = "napkinxc"

    def train(self, model_dir: Path, threads: int, seed: int) -> None:
        from napkinxc.models import PLT

        x, y = self._train_arrays()
        targets = [y.indices[y.indptr[i] : y.indptr[i + 1]].tolist() for i in range(y.shape[0])]
        model = PLT(str(model_dir), threads=threads, seed=seed)
        model.fit(x, targets)

    def load(self, model_dir: Path) -> None:
        from napkinxc.models import PLT

        self.model = PLT(str(model_dir), threads=1)
        self.model.load()

    def predict_one(self, text: str) -> list[int]:
        ids, weights = self.tokenizer.encode(text)
        # A list of (feature, value) rows skips building a scipy matrix for one document.
        row = [(i - 1, w) for i, w in zip(ids, weights, strict=True)]
        return list(self.model.predict([row], top_k=K)[0])

    def predict_batch(self, texts: Sequence[str]) -> np.ndarray:
        return _pad_ids(self.model.predict(self._csr(texts), top_k=RANKED), RANKED)


class ShortlistServed:
    """Shortlist through the serving engine: Predictor.load(bundle) with one thread, or another
    Predictor over the same opened bundle with other speed knobs."""

    name = "shortlist"

    def __init__(self, bundle_dir: Path, ef_search: int | None = None, shortlist_w: int | None = None,
                 shortlist_mu: int | None = None, shortlist_tok: int | None = None, bundle: Any = None) -> None:
        from service.engine import Predictor, PredictorOptions

        options = PredictorOptions(threads=1, ef_search=ef_search, k_w=shortlist_w, k_mu=shortlist_mu,
                                   k_tok=shortlist_tok)
        self.predictor = Predictor(bundle, options) if bundle is not None else Predictor.load(bundle_dir, options)
        self.bundle = self.predictor.bundle

    def predict_one(self, text: str) -> list[int]:
        ids, _ = self.predictor.predict_ids([text], k=K)
        return [int(i) for i in ids[0] if i >= 0]

    def predict_batch(self, texts: Sequence[str]) -> np.ndarray:
        return self.predictor.predict_ids(texts, k=RANKED)[0]


class ShortlistTreeServed(ShortlistServed):
    """The same bundle's tree route (Predictor.predict_tree_ids at the bundle's default beam)."""

    name = "shortlist-tree"

    def predict_one(self, text: str) -> list[int]:
        ids, _ = self.predictor.predict_tree_ids([text], k=K)
        return [int(i) for i in ids[0] if i >= 0]

    def predict_batch(self, texts: Sequence[str]) -> np.ndarray:
        return self.predictor.predict_tree_ids(texts, k=RANKED)[0]


PEERS: dict[str, type[Peer]] = {"pecos": PecosPeer, "omikuji": OmikujiPeer, "napkinxc": NapkinxcPeer}


# --------------------------------------------------------------------------- worker side


def _batched_predict(model: Any, texts: Sequence[str], batch_size: int) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    parts = [model.predict_batch(texts[i : i + batch_size]) for i in range(0, len(texts), batch_size)]
    elapsed = time.perf_counter() - start
    return np.vstack(parts), elapsed


def _agreement(singles: Sequence[list[int]], batch: np.ndarray) -> float:
    """Fraction of single-query answers whose top-k ids equal the batch path's."""
    same = sum(list(s) == [int(i) for i in row[:K] if i >= 0] for s, row in zip(singles, batch, strict=False))
    return same / max(len(singles), 1)


def serve_and_measure(model: Any, texts: Sequence[str], spec: dict[str, Any], preds_path: Path) -> dict[str, Any]:
    latency_texts = texts[: spec["latency_queries"]]
    seconds, singles = time_calls(model.predict_one, latency_texts, warmup=spec["warmup"])
    preds, batch_s = _batched_predict(model, texts, spec["batch_size"])
    np.save(preds_path, preds)
    return {
        **latency_summary(seconds),
        "qps": len(texts) / batch_s,
        "agreement": _agreement(singles, preds),
        "preds": str(preds_path),
    }


def worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    files = RunFiles(**spec["files"])
    system, phase = spec["system"], spec["phase"]
    result: dict[str, Any] = {}
    if phase == "train":
        peer = PEERS[system](files)
        model_dir = Path(spec["model_dir"])
        if model_dir.exists():
            shutil.rmtree(model_dir)
        model_dir.mkdir(parents=True)
        start = time.perf_counter()
        peer.train(model_dir, threads=spec["threads"], seed=spec["seed"])
        result = {"train_s": time.perf_counter() - start, "train_rss_mb": peak_rss_mb()}
    elif phase == "serve":
        texts = json.loads(Path(files.tst_texts).read_text(encoding="utf-8"))
        start = time.perf_counter()
        if system in OURS:
            model: Any = (ShortlistServed if system == "shortlist" else ShortlistTreeServed)(Path(spec["model_dir"]))
        else:
            model = PEERS[system](files)
            model.load(Path(spec["model_dir"]))
        load_s = time.perf_counter() - start
        result = serve_and_measure(model, texts, spec, files.preds / f"{system}.npy")
        result["load_s"] = load_s
        result["rss_mb"] = peak_rss_mb()
        if system == "shortlist":
            result["defaults"] = shortlist_defaults(model)
            result["breakdown"] = shortlist_breakdown(model, texts[: spec["latency_queries"]])
            result["grid"] = shortlist_grid(model, texts, spec, files)
            result["exact"] = shortlist_exact(model, texts, spec, files)
    else:
        raise BenchError(f"unknown worker phase {phase!r}")
    Path(spec["result"]).write_text(json.dumps(result), encoding="utf-8")
    return 0


def shortlist_breakdown(served: ShortlistServed, texts: Sequence[str]) -> dict[str, float]:
    """Median time of each stage of one single-query prediction (ms): where the latency goes.

    Calls the Predictor's stages one by one, so it follows the engine as it is; the stages add
    up to a little less than predict_ids' own time.
    """
    from service.engine.scorers import top_k

    p, b = served.predictor, served.bundle
    clock = time.perf_counter
    stages: dict[str, list[float]] = {k: [] for k in ("tokenize", "encode", "shortlist", "score_topk")}
    for text in texts:
        t0 = clock()
        ids, weights = b.tokenizer.encode_batch([text])
        t1 = clock()
        q = p.encoder.run(ids, weights)
        t2 = clock()
        cands, lexical = p.sources(ids, weights, q)
        t3 = clock()
        top_k(p.scorer.score(q, cands, p.alpha, lexical), K)
        t4 = clock()
        for key, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            stages[key].append(dt)
    return {key: float(np.median(v) * 1e3) for key, v in stages.items()}


def shortlist_defaults(served: ShortlistServed) -> dict[str, Any]:
    s, spec = served.predictor.scoring, served.predictor.scoring.shortlist
    return {"ef_search": served.bundle.manifest.hnsw.ef_search, "shortlist_w": spec.k_w, "shortlist_mu": spec.k_mu,
            "shortlist_tok": spec.k_tok, "shortlist_head": spec.k_head, "head_mode": spec.head, "alpha": s.alpha,
            "lexical_weight": s.lexical_weight, "lexical_form": s.lexical_form}


class _ExactScoring:
    """Shortlist's scores over all L labels (no ANN): the ceiling its shortlist approximates."""

    def __init__(self, served: ShortlistServed) -> None:
        self.predictor = served.predictor

    def predict_one(self, text: str) -> list[int]:
        ids, _ = self.predictor.predict_exact_ids([text], k=K)
        return [int(i) for i in ids[0] if i >= 0]

    def predict_batch(self, texts: Sequence[str]) -> np.ndarray:
        return self.predictor.predict_exact_ids(texts, k=RANKED)[0]


def shortlist_exact(served: ShortlistServed, texts: Sequence[str], spec: dict[str, Any], files: RunFiles) -> dict:
    # Dense [B, L] scores: small batches keep the reference pass's memory modest.
    sub = {**spec, "latency_queries": spec["grid_latency_queries"], "batch_size": 128}
    return serve_and_measure(_ExactScoring(served), texts, sub, files.preds / "shortlist-exact.npy")


def shortlist_grid(served: ShortlistServed, texts: Sequence[str], spec: dict[str, Any], files: RunFiles) -> list[dict]:
    """Accuracy and latency of Shortlist's speed knobs, on the already loaded bundle."""
    points = []
    for ef, k_w, k_mu, k_tok in spec["grid"]:
        knob = ShortlistServed(Path(spec["model_dir"]), ef, k_w, k_mu, k_tok, bundle=served.bundle)
        tag = f"shortlist-ef{ef}-w{k_w}-mu{k_mu}-tok{k_tok}"
        sub = {**spec, "latency_queries": spec["grid_latency_queries"]}
        measured = serve_and_measure(knob, texts, sub, files.preds / f"{tag}.npy")
        points.append({"ef_search": ef, "shortlist_w": k_w, "shortlist_mu": k_mu, "shortlist_tok": k_tok, **measured})
    return points


# --------------------------------------------------------------------------- driver side


def run_worker(files: RunFiles, system: str, phase: str, log: Path, threads_env: bool, **spec: Any) -> dict[str, Any]:
    """Run one worker subprocess; its stdout/stderr go to `log`; raise BenchError if it fails."""
    run_dir = Path(files.run_dir)
    spec_path = run_dir / f"spec-{system}-{phase}.json"
    result_path = run_dir / f"result-{system}-{phase}.json"
    result_path.unlink(missing_ok=True)
    spec.update(system=system, phase=phase, files=asdict(files), result=str(result_path))
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    env = {**os.environ, **(ONE_THREAD_ENV if threads_env else {})}
    with log.open("a", encoding="utf-8") as out:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "_worker", str(spec_path)],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    if proc.returncode != 0 or not result_path.exists():
        raise BenchError(f"{system} {phase} failed (exit {proc.returncode}); see {log}")
    return json.loads(result_path.read_text(encoding="utf-8"))


def run_cli_step(cmd: list[str], log: Path) -> float:
    """Run a `shortlist` subcommand, appending its output to `log`; returns its wall time."""
    start = time.perf_counter()
    with log.open("a", encoding="utf-8") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise BenchError(f"`{' '.join(cmd[2:])}` failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - start


def prepare_shortlist(args: argparse.Namespace, files: RunFiles, log: Path) -> dict[str, Any]:
    """The bundle to serve ("bundle"; trained and exported here unless one was given) and its
    build times."""
    cli = [sys.executable, "-m", "shortlist.cli"]
    if args.shortlist_bundle:
        bundle = Path(args.shortlist_bundle).resolve()
        if not (bundle / "manifest.json").is_file():
            raise BenchError(f"--shortlist-bundle {bundle}: no manifest.json there (give a bundle version folder)")
        return {"reused": str(bundle), "bundle": str(bundle)}
    info: dict[str, Any] = {}
    if args.shortlist_checkpoint:
        checkpoint = Path(args.shortlist_checkpoint).resolve()
        info["reused"] = str(checkpoint)
    else:
        checkpoint = files.models / "shortlist-checkpoint"
        cmd = [*cli, "train", "--data", files.data_dir, "--out", str(checkpoint), "--text-field", files.text_field,
               "--seed", str(args.seed)]
        if args.shortlist_config:
            cmd += ["--config", str(Path(args.shortlist_config).resolve())]
        info["train_s"] = run_cli_step(cmd, log)
    root = files.models / "shortlist-bundles"
    version = "bench"
    if (root / version).exists():
        shutil.rmtree(root / version)
    info["export_s"] = run_cli_step([*cli, "export", str(checkpoint), "--out", str(root), "--version", version], log)
    info["bundle"] = str(root / version)
    return info


def document_terms(
    preds_path: str, truths: Sequence[Sequence[int]], inv_prop: np.ndarray, own: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Each test document's metric terms (service.engine.metrics.document_terms) of the top K of
    saved predictions [N, RANKED]; with `own` (each document's own label id, -1 for none) that
    label is removed first and the next one moves up."""
    from service.engine.metrics import document_terms as terms_of

    preds = np.load(preds_path)
    if preds.shape != (len(truths), RANKED):
        raise BenchError(f"{preds_path}: predictions of shape {preds.shape}, expected {(len(truths), RANKED)}")
    if own is not None:
        preds = without_own_label(preds, own)
    return terms_of(preds[:, :K], truths, ks=(1, 3, 5), inv_propensity=inv_prop)


def evaluate(
    preds_path: str, truths: Sequence[Sequence[int]], inv_prop: np.ndarray, own: np.ndarray | None = None
) -> dict[str, float]:
    """Metrics of saved predictions (see document_terms)."""
    from service.engine.metrics import aggregate

    return aggregate(document_terms(preds_path, truths, inv_prop, own))


def paired_differences(
    rows: list[dict[str, Any]], truths: Sequence[Sequence[int]], inv_prop: np.ndarray, own: np.ndarray | None,
    resamples: int, seed: int,
) -> list[dict[str, Any]]:
    """Each of Shortlist's rows minus each peer on the same test documents, per protocol, with paired
    bootstrap intervals (service.engine.metrics.paired_bootstrap)."""
    from service.engine.metrics import paired_bootstrap

    if resamples < 1:
        return []
    protocols = [("plain", None), *([("own label excluded", own)] if own is not None else [])]
    out = []
    for ours in (r for r in rows if r["system"] in OURS and "preds" in r):
        for name, excluded in protocols:
            terms = document_terms(ours["preds"], truths, inv_prop, excluded)
            for peer in rows:
                if peer["system"] in OURS or "preds" not in peer:
                    continue
                diff = paired_bootstrap(terms, document_terms(peer["preds"], truths, inv_prop, excluded),
                                        PAIRED_METRICS, resamples=resamples, seed=seed)
                out.append({"system": ours["title"], "peer": peer["title"], "protocol": name, "diff": diff})
    return out


def without_own_label(preds: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Ranked ids [N, R] with each row's own label removed (the rest shift up, -1 fills the end)."""
    out = np.full_like(preds, -1)
    keep = (preds != own[:, None]) & (preds >= 0)
    for row in range(len(preds)):
        kept = preds[row][keep[row]]
        out[row, : len(kept)] = kept
    return out


def parse_grid(text: str) -> list[tuple[int, int, int, int]]:
    """'ef:k_w:k_mu:k_tok,...' -> [(ef, k_w, k_mu, k_tok), ...]."""
    points = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            raise argparse.ArgumentTypeError(f"grid point {item!r} is not EF:K_W:K_MU:K_TOK (four integers)")
        ef, k_w, k_mu, k_tok = (int(p) for p in parts)
        if ef < 1 or k_w + k_mu + k_tok == 0:
            raise argparse.ArgumentTypeError(f"grid point {item!r}: EF must be >= 1 and K_W + K_MU + K_TOK > 0")
        points.append((ef, k_w, k_mu, k_tok))
    return points


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return value


def parse_systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown system(s) {unknown}; choose from {','.join(SYSTEMS)}")
    return names


def version_of(system: str) -> str:
    try:
        return metadata.version(DISTRIBUTIONS[system])
    except metadata.PackageNotFoundError:
        return "not installed"


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render_markdown(rows: list[dict[str, Any]], grid: list[dict[str, Any]], context: dict[str, Any]) -> str:
    head = (
        "| system | P@1 | P@3 | P@5 | nDCG@5 | PSP@1 | PSP@3 | PSP@5 | train (s) | p50 (ms) | p99 (ms) "
        "| batch (q/s) | peak RSS (MiB) |\n|---|" + "---|" * 12
    )
    lines = [head]
    for r in rows:
        m = r.get("metrics", {})
        if "error" in r:
            lines.append(f"| {r['title']} | failed: {r['error']} |" + " |" * 11)
            continue
        lines.append(
            "| " + " | ".join([
                r["title"],
                *(fmt(m.get(key)) for key in ("P@1", "P@3", "P@5", "nDCG@5", "PSP@1", "PSP@3", "PSP@5")),
                fmt(r.get("train_s"), 1),
                fmt(r.get("p50_ms"), 3),
                fmt(r.get("p99_ms"), 3),
                fmt(round(r["qps"]) if r.get("qps") else None),
                fmt(round(r["rss_mb"]) if r.get("rss_mb") else None),
            ]) + " |"
        )
    out = [
        f"## {context['dataset']} ({context['text_field']})",
        "",
        f"Command: `{context['command']}`",
        "",
        f"{context['date']}, commit {context['commit']}, {context['cpus']} CPU cores shared with other jobs; "
        f"{context['trn_docs']} train / {context['tst_docs']} test documents, {context['labels']} labels, "
        f"{context['features']} TF-IDF features for the peers.",
        "",
        *lines,
        "",
        "Accuracy in percent on the test split (service.engine.metrics; PSP with propensities from the "
        "training split, A=0.55, B=1.5). p50/p99: one query per call, text in -> top-5 ids out, one thread, "
        f"over {context['latency_queries']} test queries after {context['warmup']} warm-up calls. "
        f"Batch: the whole test split in batches of {context['batch_size']}, one thread. "
        "Peak RSS: ru_maxrss of a fresh serving process (imports + model load + all the above). "
        f"Training uses {context['train_threads']} threads.",
    ]
    own_rows = [r for r in rows if "metrics_own_excluded" in r]
    if own_rows:
        out += [
            "",
            f"The same predictions with each document's own label left out ({context.get('own_label_docs', 0)} test "
            "documents are labels themselves, a package among the packages others depend on, and their own label "
            "is never their target): each system's sixth label moves up where its own label was in the top 5. The "
            "Extreme Classification Repository scores its LF-* datasets this way (its filter_labels files); the "
            "service does it per request with `exclude`.",
            "",
            "| system | P@1 | P@3 | P@5 | nDCG@5 | PSP@1 | PSP@3 | PSP@5 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in own_rows:
            m = r["metrics_own_excluded"]
            keys = ("P@1", "P@3", "P@5", "nDCG@5", "PSP@1", "PSP@3", "PSP@5")
            out.append("| " + " | ".join([r["title"], *(fmt(m.get(key)) for key in keys)]) + " |")
    if context.get("paired"):
        out += [
            "",
            f"Each Shortlist route minus each peer on the same test documents, in points, with a 95% paired bootstrap "
            f"interval ({context['resamples']} resamples of the test documents, both systems scored on each): "
            "an interval that holds 0 is a tie at this test set's size.",
            "",
            "| route | peer | protocol | " + " | ".join(PAIRED_METRICS) + " |",
            "|---|---|---|" + "---|" * len(PAIRED_METRICS),
        ]
        for d in context["paired"]:
            cells = [f"{v:+.2f} [{lo:+.2f}, {hi:+.2f}]" for v, lo, hi in (d["diff"][m] for m in PAIRED_METRICS)]
            route = d.get("system", TITLES["shortlist"])
            out.append(f"| {route} | {d['peer']} | {d['protocol']} | " + " | ".join(cells) + " |")
    if context.get("versions"):
        out += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in context["versions"].items()) + "."]
    info = context.get("shortlist_info") or {}
    if info:
        build = [f"{key} {fmt(info[key], 1)} s" for key in ("train_s", "export_s") if key in info]
        if "reused" in info:
            build.append(f"reused {info['reused']}")
        out += ["", "Shortlist build: " + ", ".join(build) + "."]
    if info.get("defaults"):
        d = info["defaults"]
        out += ["", f"Shortlist's row uses the bundle defaults: ef_search {d['ef_search']}, shortlist_w "
                f"{d['shortlist_w']}, shortlist_mu {d['shortlist_mu']}, shortlist_tok {d.get('shortlist_tok', 0)}, "
                f"head {d.get('shortlist_head', '-')} ({d.get('head_mode', 'always')}), alpha {fmt(d['alpha'])}"
                + (f", lexical {d['lexical_form']} at {fmt(d['lexical_weight'])}" if "lexical_form" in d else "")
                + "."]
    if info.get("breakdown"):
        parts = ", ".join(f"{k} {v:.3f}" for k, v in info["breakdown"].items())
        out += ["", f"Where Shortlist's single-query time goes (median ms per stage, bundle defaults): {parts}."]
    if grid or info.get("exact"):
        out += [
            "",
            "Shortlist speed knobs (same bundle, PredictorOptions(ef_search, k_w, k_mu, k_tok) in the columns "
            "ef_search, shortlist_w, shortlist_mu, shortlist_tok, "
            f"one thread; latency over {context['grid_latency_queries']} queries; shortlist_w/mu: HNSW searches, "
            "shortlist_tok: labels per query token from the token shortlist; the head labels join as the bundle's "
            "head mode says, see the defaults above). "
            "\"exact\" scores all L labels without any shortlist: the ceiling the shortlist approximates.",
            "",
            "| ef_search | shortlist_w | shortlist_mu | shortlist_tok | P@1 | P@5 | PSP@5 | p50 (ms) | p99 (ms) "
            "| batch (q/s) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        exact_row = {"ef_search": "exact", "shortlist_w": "all", "shortlist_mu": "all", "shortlist_tok": "-"}
        for g in [*grid, *([{**exact_row, **info["exact"]}] if info.get("exact") else [])]:
            m = g["metrics"]
            out.append(
                f"| {g['ef_search']} | {g['shortlist_w']} | {g['shortlist_mu']} | {g.get('shortlist_tok', 0)} "
                f"| {fmt(m['P@1'])} | {fmt(m['P@5'])} "
                f"| {fmt(m['PSP@5'])} | {fmt(g['p50_ms'], 3)} | {fmt(g['p99_ms'], 3)} | {round(g['qps'])} |"
            )
    if context.get("plot"):
        out += ["", f"![P@1 and PSP@5 against single-query latency]({context['plot']})"]
    if context.get("notes"):
        out += ["", *context["notes"]]
    return "\n".join(out) + "\n"


def plot(rows: list[dict[str, Any]], grid: list[dict[str, Any]], exact: dict[str, Any] | None, path: Path,
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    markers = {"pecos": "s", "omikuji": "^", "napkinxc": "D", "shortlist": "*", "shortlist-tree": "P"}
    for ax, metric in zip(axes, ("P@1", "PSP@5"), strict=True):
        if grid:
            pts = sorted(grid, key=lambda g: g["p50_ms"])
            ax.plot([g["p50_ms"] for g in pts], [g["metrics"][metric] for g in pts], "-o", color="tab:red",
                    alpha=0.45, markersize=4, label="Shortlist knobs (ef_search, k_w, k_mu, k_tok)")
            for g in pts:
                ax.annotate(f"{g['ef_search']},{g['shortlist_w']},{g['shortlist_mu']},{g.get('shortlist_tok', 0)}",
                            (g["p50_ms"], g["metrics"][metric]), fontsize=6, alpha=0.7,
                            xytext=(3, -8), textcoords="offset points")
        if exact:
            ax.axhline(exact["metrics"][metric], color="tab:red", linestyle="--", linewidth=0.8, alpha=0.6)
            ax.scatter([exact["p50_ms"]], [exact["metrics"][metric]], marker="x", color="tab:red", s=40,
                       label="Shortlist exact scoring (all labels, no ANN)")
        for r in rows:
            if "error" in r or "metrics" not in r:
                continue
            color = "tab:red" if r["system"] in OURS else None
            ax.scatter([r["p50_ms"]], [r["metrics"][metric]], marker=markers.get(r["system"], "o"), s=90,
                       color=color, label=r["title"], zorder=3)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("single-query p50 latency (ms, one thread, text in, log scale)")
        ax.set_ylabel(f"{metric} (%)")
        ax.set_title(metric, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO_ROOT.parent / "shared" / "data" / "debian-deps"),
                   help="XC raw-text dataset folder (trn, tst, lbl)")
    p.add_argument("--systems", type=parse_systems, default=list(SYSTEMS), help="comma-separated subset of "
                   + ",".join(SYSTEMS))
    p.add_argument("--text-field", default="title", choices=["title", "title+content"])
    p.add_argument("--limit", type=int, default=None, help="quick run: first N train and N test documents")
    p.add_argument("--out", default=None, help="run folder (default bench/out/<dataset>[-limitN])")
    p.add_argument("--results", default=None,
                   help="markdown file to update (default bench/RESULTS.md, or the run folder with --limit)")
    p.add_argument("--publish", action=argparse.BooleanOptionalAction, default=None,
                   help="update bench/RESULTS.md and bench/peers*.png (default: only for a full run in bench/out)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--min-df", type=int, default=1, help="peers' tokenizer (Shortlist's default is 1 too)")
    p.add_argument("--max-vocab", type=int, default=200_000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--latency-queries", type=int, default=1000)
    p.add_argument("--grid-latency-queries", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument("--resamples", type=non_negative_int, default=1000,
                   help="bootstrap resamples for Shortlist-minus-peer intervals (0: none)")
    p.add_argument("--shortlist-bundle", default=None, help="serve this bundle version folder instead of training")
    p.add_argument("--shortlist-checkpoint", default=None, help="export this checkpoint instead of training")
    p.add_argument("--shortlist-config", default=None, help="JSON config passed to `shortlist train --config`")
    p.add_argument("--grid", type=parse_grid,
                   default=parse_grid("10:0:0:5,10:0:0:10,10:0:0:20,16:0:16:10,50:50:50:10,"
                                      "16:16:16:0,50:50:50:0,100:100:100:0"),
                   help="Shortlist speed knobs EF:K_W:K_MU:K_TOK,... (empty string: none)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_worker"]:
        return worker(argv[1])
    args = build_parser().parse_args(argv)
    if args.shortlist_bundle and args.shortlist_checkpoint:
        raise SystemExit("peers.py: give --shortlist-bundle or --shortlist-checkpoint, not both")
    from service.engine.metrics import label_frequencies, propensities

    t0 = time.perf_counter()
    files, trn, tst = prepare_run(args)
    print(f"[peers] {files.run_dir}: {len(trn)} train / {len(tst)} test docs, {files.num_labels} labels, "
          f"{files.num_features} features ({time.perf_counter() - t0:.1f}s)", flush=True)
    inv_prop = 1.0 / propensities(label_frequencies(trn.targets, files.num_labels), len(trn))
    from training.data import load_labels, own_label_ids

    own = own_label_ids(tst.uids, load_labels(files.data_dir).uids)
    own = own if (own >= 0).any() else None
    log = Path(files.run_dir) / "peers.log"
    serve_spec = {"latency_queries": args.latency_queries, "warmup": args.warmup, "batch_size": args.batch_size}
    rows: list[dict[str, Any]] = []
    grid: list[dict[str, Any]] = []
    shortlist_info: dict[str, Any] = {}
    for system in args.systems:
        row: dict[str, Any] = {"system": system, "title": f"{TITLES[system]} ({version_of(system)})"}
        rows.append(row)
        try:
            model_dir = files.models / system
            if system == "shortlist-tree":  # the bundle the alpha row serves, or one made here
                if "bundle" not in shortlist_info:
                    shortlist_info = prepare_shortlist(args, files, log)
                row["train_s"] = shortlist_info.get("train_s")
                serve = run_worker(files, system, "serve", log, True, model_dir=shortlist_info["bundle"],
                                   **serve_spec)
            elif system == "shortlist":
                shortlist_info = prepare_shortlist(args, files, log)
                model_dir = Path(shortlist_info["bundle"])
                row["train_s"] = shortlist_info.get("train_s")
                serve = run_worker(files, system, "serve", log, True, model_dir=str(model_dir), **serve_spec,
                                   grid=args.grid, grid_latency_queries=args.grid_latency_queries)
                for point in serve.pop("grid", []):
                    point["metrics"] = evaluate(point["preds"], tst.targets, inv_prop)
                    grid.append(point)
                exact = serve.pop("exact")
                exact["metrics"] = evaluate(exact["preds"], tst.targets, inv_prop)
                shortlist_info["exact"] = exact
                shortlist_info["defaults"] = serve.pop("defaults")
                shortlist_info["breakdown"] = serve.pop("breakdown")
            else:
                trained = run_worker(files, system, "train", log, False, model_dir=str(model_dir),
                                     threads=args.train_threads, seed=args.seed)
                row["train_s"] = trained["train_s"]
                serve = run_worker(files, system, "serve", log, True, model_dir=str(model_dir), **serve_spec)
            row.update(serve)
            row["metrics"] = evaluate(serve["preds"], tst.targets, inv_prop)
            if own is not None:
                row["metrics_own_excluded"] = evaluate(serve["preds"], tst.targets, inv_prop, own)
            m = row["metrics"]
            print(f"[peers] {system}: P@1 {m['P@1']:.2f} P@5 {m['P@5']:.2f} PSP@5 {m['PSP@5']:.2f} "
                  f"train {fmt(row.get('train_s'), 1)}s p50 {row['p50_ms']:.3f}ms p99 {row['p99_ms']:.3f}ms "
                  f"{row['qps']:.0f} q/s RSS {row['rss_mb']:.0f} MiB single/batch agreement "
                  f"{row['agreement']:.3f}", flush=True)
            if own is not None:
                m = row["metrics_own_excluded"]
                print(f"[peers] {system}, own label excluded: P@1 {m['P@1']:.2f} P@5 {m['P@5']:.2f} "
                      f"PSP@5 {m['PSP@5']:.2f}", flush=True)
        except (BenchError, ImportError, OSError, ValueError) as exc:
            row["error"] = str(exc)
            print(f"[peers] {system}: {exc}", flush=True)

    run_dir = Path(files.run_dir)
    dataset = Path(args.data).resolve().name
    published = args.publish if args.publish is not None else (args.limit is None and args.out is None)
    plot_path = run_dir / "peers.png"
    title = f"{dataset} ({args.text_field}{', limit ' + str(args.limit) if args.limit else ''})"
    plot(rows, grid, shortlist_info.get("exact"), plot_path, title)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plot_path, OUT_DIR / "peers.png")
    default_md = BENCH_DIR / "RESULTS.md" if published else run_dir / "RESULTS.md"
    results_md = Path(args.results) if args.results else default_md
    plot_link = plot_path
    if published:
        plot_link = BENCH_DIR / ("peers.png" if dataset == "debian-deps" else f"peers-{dataset}.png")
        shutil.copyfile(plot_path, plot_link)
    notes = [f"- {r['system']}: single-query and batch answers agree on {r['agreement']:.1%} of the latency queries."
             for r in rows if "agreement" in r and r["agreement"] < 0.999]
    context = {
        "dataset": dataset + (f", first {args.limit} train/test docs" if args.limit else ""),
        "text_field": args.text_field,
        "command": command_line(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_revision(),
        "cpus": os.cpu_count(),
        "trn_docs": len(trn),
        "own_label_docs": int((own >= 0).sum()) if own is not None else 0,
        "tst_docs": len(tst),
        "labels": files.num_labels,
        "features": files.num_features,
        "latency_queries": min(args.latency_queries, len(tst)),
        "grid_latency_queries": min(args.grid_latency_queries, len(tst)),
        "warmup": args.warmup,
        "batch_size": args.batch_size,
        "train_threads": args.train_threads,
        "versions": {DISTRIBUTIONS[s]: version_of(s) for s in args.systems},
        "shortlist_info": shortlist_info,
        "plot": os.path.relpath(plot_link, results_md.resolve().parent),
        "notes": notes,
        "resamples": args.resamples,
        "paired": paired_differences(rows, tst.targets, inv_prop, own, args.resamples, args.seed),
    }
    table = render_markdown(rows, grid, context)
    print(table)
    key = f"peers:{dataset}:{args.text_field}" + (f":limit{args.limit}" if args.limit else "")
    replace_section(results_md, key, table, title=RESULTS_PREAMBLE)
    (run_dir / "results.json").write_text(json.dumps({"rows": rows, "grid": grid, "context": context}, indent=1),
                                          encoding="utf-8")
    print(f"[peers] wrote {results_md} and {plot_link} ({time.perf_counter() - t0:.0f}s)", flush=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
