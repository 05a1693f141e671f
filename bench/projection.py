"""HNSW over a low-dimensional projection of the label vectors (issue 21's serving memory, issue 22's
search time): a bundle's indices rebuilt at projection dims d, and each variant's accuracy on the
training's validation split, index bytes and single-query time, measured in one run.

  reindex: BUNDLE -> OUT/VERSION-pD for each D of --dims, the same files and scoring, its HNSW
           indices built again over the rows projected onto their top-D principal directions
           (hnswlib's insertion seeded as export's), canaries recorded again.
  compare: BUNDLE... on the validation split its training carved from --data (never a test split),
           through the engine (own labels left out with --filter own), each with its own scoring
           and optionally with other k_mu / ef_search; the single-query p50 of the whole predict
           and of the HNSW searches alone, the bundles' queries interleaved so that they share the
           machine's load.

  python bench/projection.py reindex --bundle B --out ROOT --dims 128,64,32
  python bench/projection.py compare --data DIR --filter own B ROOT/B-p128 ROOT/B-p64 ROOT/B-p32
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from model_export.evaluate import filtered_pairs
from service.engine import canary, schema, store
from service.engine.bundle import Bundle
from service.engine.index import build_label_indices
from service.engine.metrics import ranking_metrics
from service.engine.predictor import Predictor, PredictorOptions
from training.config import TrainConfig
from training.data import same_data
from training.dataset import TrainingSet


def reindex(bundle_dir: Path, out_root: Path, dim: int) -> Path:
    """A copy of the bundle (files hard-linked) whose indices are projected onto `dim` dimensions."""
    parent = Bundle.open(bundle_dir)
    m = parent.manifest
    version = f"{m.version}-p{dim}"
    staging = store.staging_dir(out_root, version)
    try:
        hnsw = m.hnsw.model_copy(update={"projection_dim": dim})
        seed = int(m.training_config.get("seed", 0))
        every = np.arange(m.num_labels)
        w, b, mu = (parent.vector_rows(schema.CLASSIFIERS, every), np.asarray(parent.classifier_bias),
                    parent.vector_rows(schema.CENTROIDS, every))
        t0 = time.perf_counter()
        written = {p.name for index, file in zip(build_label_indices(w, b, mu, hnsw, seed),
                                                  (schema.HNSW_W, schema.HNSW_MU), strict=True)
                   for p in index.save(staging / file)}
        print(f"{version}: indices built in {time.perf_counter() - t0:.1f}s", flush=True)
        for name in m.files:
            if name not in written and name not in schema.PROJECTION_FILES:
                store.share_file(parent.path / name, staging / name)
        fields = m.model_dump(exclude={"format_version", "created_at", "files", "canary"})
        fields.update(version=version, hnsw=hnsw.model_dump())
        store.write_manifest(staging, fields)
        staged = Bundle.open(staging, staged=True)
        fields["canary"] = [c.model_dump() for c in canary.record(Predictor(staged), [c.text for c in m.canary])]
        staged.close()
        store.write_manifest(staging, fields)
        return store.finalize_bundle(staging, out_root, version)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        parent.close()


def validation_split(bundle: Bundle, data_dir: Path, protocol: str) -> tuple[list[str], list[list[int]],
                                                                              list[list[int]], np.ndarray]:
    """The validation documents the bundle's training carved from data_dir's trn: texts, the
    labels the protocol leaves out, the truths without them, and inverse propensities from trn."""
    cfg = TrainConfig.from_dict(bundle.manifest.training_config)
    data = TrainingSet.load(data_dir, cfg, bundle.manifest.text_field, np.random.default_rng(cfg.seed))
    if not same_data(data_dir, data.fingerprint, bundle.manifest.data_fingerprint):
        raise ValueError(f"{data_dir}: not the data {bundle.path} was trained on (fingerprints differ)")
    left_out = filtered_pairs(protocol, data.val, data.labels, bundle.manifest.num_labels)
    truths = [[t for t in truth if t not in drop] for truth, drop in zip(data.val.targets, left_out, strict=True)]
    return list(data.val.texts), left_out, truths, data.inv_propensity


def accuracy(predictor: Predictor, texts: list[str], left_out: list[list[int]], truths: list[list[int]],
             inv_prop: np.ndarray) -> dict[str, float]:
    ids = np.concatenate([predictor.predict_ids(texts[s : s + 256], k=5, exclude=left_out[s : s + 256])[0]
                          for s in range(0, len(texts), 256)])
    metrics = ranking_metrics(ids, truths, ks=(1, 5), inv_propensity=inv_prop)
    return {name: round(metrics[name], 2) for name in ("P@1", "P@5", "PSP@5")}


def single_query_times(predictors: list[Predictor], texts: list[str], rounds: int) -> list[dict[str, float]]:
    """Per predictor the p50 (us) of one text's predict and of its HNSW searches alone, texts
    interleaved across predictors (each text answered by every predictor in turn)."""
    clock = time.perf_counter
    total = [[] for _ in predictors]
    search = [[] for _ in predictors]
    encoded = [predictors[0].queries([t]).q for t in texts]
    for _ in range(rounds):
        for text, enc in zip(texts, encoded, strict=True):
            for i, p in enumerate(predictors):
                start = clock()
                p.predict_ids([text], k=5)
                total[i].append(clock() - start)
                sources = p.sources
                start = clock()
                for index, k in ((sources.index_w, sources.spec.k_w), (sources.index_mu, sources.spec.k_mu)):
                    if index is not None:
                        index.search(enc if index is sources.index_mu else _with_one(enc), k)
                search[i].append(clock() - start)
    return [{"predict_p50_us": round(1e6 * float(np.median(t)), 1), "hnsw_p50_us": round(1e6 * float(np.median(s)), 1)}
            for t, s in zip(total, search, strict=True)]


def _with_one(q: np.ndarray) -> np.ndarray:
    return np.hstack([q, np.ones((len(q), 1), dtype=np.float32)])


def compare(bundles: list[Path], data_dir: Path, protocol: str, options: PredictorOptions,
            latency_texts: int, rounds: int) -> list[dict[str, Any]]:
    predictors = [Predictor.load(b, options) for b in bundles]
    texts, left_out, truths, inv_prop = validation_split(predictors[0].bundle, data_dir, protocol)
    rows = []
    for p in predictors:
        m = p.bundle.manifest
        index_bytes = sum((p.bundle.path / name).stat().st_size for name in (schema.HNSW_MU, schema.HNSW_W))
        mu_bytes = (p.bundle.path / schema.HNSW_MU).stat().st_size
        rows.append({"bundle": p.version, "projection_dim": m.hnsw.projection_dim, "k_mu": p.scoring.shortlist.k_mu,
                     "k_w": p.scoring.shortlist.k_w, "ef_search": options.ef_search or m.hnsw.ef_search,
                     **accuracy(p, texts, left_out, truths, inv_prop), "hnsw_mu_MiB": round(mu_bytes / 2**20, 1),
                     "hnsw_both_MiB": round(index_bytes / 2**20, 1)})
        print(json.dumps(rows[-1]), flush=True)
    rng = np.random.default_rng(0)
    sample = [texts[i] for i in rng.choice(len(texts), size=min(latency_texts, len(texts)), replace=False)]
    for row, times in zip(rows, single_query_times(predictors, sample, rounds), strict=True):
        row.update(times)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("reindex")
    r.add_argument("--bundle", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--dims", required=True, help="comma-separated projection dims")
    c = sub.add_parser("compare")
    c.add_argument("bundles", type=Path, nargs="+")
    c.add_argument("--data", type=Path, required=True)
    c.add_argument("--filter", default="plain", help="plain or own")
    c.add_argument("--k-mu", type=int, default=None)
    c.add_argument("--ef-search", type=int, default=None)
    c.add_argument("--latency-texts", type=int, default=1000)
    c.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.command == "reindex":
        args.out.mkdir(parents=True, exist_ok=True)
        for dim in (int(d) for d in args.dims.split(",")):
            print(reindex(args.bundle, args.out, dim), flush=True)
        return
    options = PredictorOptions(k_mu=args.k_mu, ef_search=args.ef_search)
    rows = compare(args.bundles, args.data, args.filter, options, args.latency_texts, args.rounds)
    print("| bundle | d | k_mu | ef | P@1 | P@5 | PSP@5 | hnsw_mu.bin MiB | both MiB | predict p50 us | HNSW p50 us |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['bundle']} | {row['projection_dim'] or 'full'} | {row['k_mu']} | {row['ef_search']} | "
              f"{row['P@1']} | {row['P@5']} | {row['PSP@5']} | {row['hnsw_mu_MiB']} | {row['hnsw_both_MiB']} | "
              f"{row['predict_p50_us']} | {row['hnsw_p50_us']} |")


if __name__ == "__main__":
    main()
