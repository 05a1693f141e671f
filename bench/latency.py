"""In-process latency of the engine against exact brute-force scoring over the same vectors.

    python bench/latency.py --bundle bundles/v1 [--data ../shared/data/debian-deps] [--queries 2000]

Prints single-query p50/p99 at one thread (ANN path and brute force, measured in the same
run, and the tree route when the bundle has one), the ratios, batch throughput, and the stage
costs of one query (tokenise, encode, shortlist search, scoring; the tree route's beam search
and rescoring).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from service.engine import Predictor, PredictorOptions  # noqa: E402
from service.engine.bundle import Bundle  # noqa: E402


def _texts(bundle: Bundle, data: str | None, n: int) -> list[str]:
    if data:
        from training.data import load_split

        texts = load_split(data, "tst", bundle.manifest.text_field).texts
    else:
        texts = bundle.labels.titles
    rng = np.random.default_rng(0)
    return [texts[int(i)] for i in rng.integers(0, len(texts), size=n)]


def _latencies(fn, texts: list[str]) -> np.ndarray:
    for t in texts[:50]:  # warm-up
        fn([t])
    out = np.empty(len(texts))
    for i, t in enumerate(texts):
        t0 = time.perf_counter()
        fn([t])
        out[i] = time.perf_counter() - t0
    return out * 1e3


def _throughput(fn, texts: list[str], batch: int) -> float:
    t0 = time.perf_counter()
    for start in range(0, len(texts), batch):
        fn(texts[start : start + batch])
    return len(texts) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--data", default=None, help="dataset folder: queries from its tst split (default: label titles)")
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--exact-queries", type=int, default=300)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--ef-search", type=int, default=None)
    ap.add_argument("--shortlist-w", type=int, default=None)
    ap.add_argument("--shortlist-mu", type=int, default=None)
    ap.add_argument("--shortlist-tok", type=int, default=None)
    args = ap.parse_args()

    options = PredictorOptions(threads=1, ef_search=args.ef_search, k_w=args.shortlist_w, k_mu=args.shortlist_mu,
                               k_tok=args.shortlist_tok)
    predictor = Predictor.load(args.bundle, options)
    bundle = predictor.bundle
    texts = _texts(bundle, args.data, args.queries)
    m, spec = bundle.manifest, predictor.scoring.shortlist
    print(f"bundle {bundle.version}: L={m.num_labels} D={m.dim} k_w={spec.k_w} k_mu={spec.k_mu} k_tok={spec.k_tok} "
          f"ef={args.ef_search or m.hnsw.ef_search}")

    def ann(batch):
        return predictor.predict_ids(batch, args.k)

    def exact(batch):
        return predictor.predict_exact_ids(batch, args.k)

    ann_ms = _latencies(ann, texts)
    exact_ms = _latencies(exact, texts[: args.exact_queries])
    a50, a99 = np.percentile(ann_ms, [50, 99])
    e50, e99 = np.percentile(exact_ms, [50, 99])
    print(f"single query, 1 thread   ANN   p50 {a50:.3f} ms  p99 {a99:.3f} ms  ({len(ann_ms)} queries)")
    print(f"single query, 1 thread   exact p50 {e50:.3f} ms  p99 {e99:.3f} ms  ({len(exact_ms)} queries)")
    print(f"ANN / exact p50 ratio    {a50 / e50:.3f}")
    tree = bundle.tree

    def tree_route(batch):
        return predictor.predict_tree_ids(batch, args.k)

    if tree is not None:
        tree_ms = _latencies(tree_route, texts)
        t50, t99 = np.percentile(tree_ms, [50, 99])
        print(f"single query, 1 thread   tree  p50 {t50:.3f} ms  p99 {t99:.3f} ms  (beam {tree.default_beam}; "
              f"tree / ANN p50 {t50 / a50:.2f})")

    # Where one query's time goes.
    tok = bundle.tokenizer
    q_ids, q_w = tok.encode_batch(texts[:1])
    q = predictor.encoder.run(q_ids, q_w)
    ones = np.ones((1, 1), dtype=np.float32)
    index_w, index_mu = bundle.index("w", args.ef_search), bundle.index("mu", args.ef_search)
    stages = {
        "tokenise": lambda t: tok.encode_batch([t]),
        "encode (onnxruntime)": lambda t: predictor.encoder.run(q_ids, q_w),
        "hnsw_w search": lambda t: index_w.search(np.hstack([q, ones]), max(spec.k_w, 1)),
        "hnsw_mu search": lambda t: index_mu.search(q, max(spec.k_mu, 1)),
        "shortlists + lexical": lambda t: predictor.sources(q_ids, q_w, q),
    }
    cands, lexical = predictor.sources(q_ids, q_w, q)
    stages["score shortlist"] = lambda t: predictor.scorer.score(q, cands, predictor.alpha, lexical)
    if tree is not None:
        stages["tree beam search"] = lambda t: tree.beam_leaves(q, tree.default_beam, (q_ids, q_w))
        stages["tree search (+ rescoring)"] = lambda t: tree.search(q, args.k, tokens=(q_ids, q_w))
    for name, fn in stages.items():
        ms = _latencies(lambda batch, fn=fn: fn(batch[0]), texts[:1000])
        print(f"  stage {name:<22} p50 {np.percentile(ms, 50) * 1e3:8.1f} us")

    for batch in (16, 64, 256):
        qps = _throughput(ann, texts, batch)
        qps_exact = _throughput(exact, texts[: args.exact_queries], batch)
        line = f"batch {batch:>3}: ANN {qps:9.0f} q/s   exact {qps_exact:9.0f} q/s   ratio {qps / qps_exact:.2f}"
        if tree is not None:
            line += f"   tree {_throughput(tree_route, texts, batch):9.0f} q/s"
        print(line)


if __name__ == "__main__":
    main()
