"""Memory of a fresh serving process: one bundle loaded and queried in process, on both routes.

    python bench/load_memory.py --bundle DIR --data DIR [--queries 1000] [--json]

Prints peak RSS and PSS (memory-mapped pages count once touched) after loading the bundle and
after serving `queries` test titles on the alpha route and the tree route, with the PSS of each
bundle file. Run it with another checkout's code first on PYTHONPATH (e.g. main's) to compare
engines on the same bundle: an engine from before the manifest's vector_dtype (format 2's float16
label vectors) refuses the field, so `--without-vector-dtype DIR` serves a copy of a float32
bundle whose manifest lacks it (encoder.onnx.data, format 2's other item, such an engine reads).
"""

from __future__ import annotations

import argparse
import gzip
import json
import resource
import shutil
import sys
import time
from pathlib import Path

from scale import memory_of


def titles(data: Path, n: int) -> list[str]:
    out = []
    with gzip.open(data / "tst.json.gz", "rt", encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line)["title"])
            if len(out) == n:
                break
    return out


def without_vector_dtype(bundle: Path, out: Path) -> Path:
    """A copy of a float32 bundle whose manifest has no vector_dtype (hard links)."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    if manifest.get("vector_dtype", "float32") != "float32":
        raise SystemExit(f"{bundle}: float16 vectors need the manifest's vector_dtype")
    manifest.pop("vector_dtype", None)
    target = out / bundle.name
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for f in bundle.iterdir():
        if f.name != "manifest.json":
            (target / f.name).hardlink_to(f)
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--without-vector-dtype", type=Path, default=None, metavar="DIR",
                    help="serve a copy made in DIR whose manifest lacks vector_dtype (for an older engine)")
    args = ap.parse_args(argv)
    from service.engine import Predictor, PredictorOptions

    bundle = args.bundle.resolve()
    if args.without_vector_dtype:
        bundle = without_vector_dtype(bundle, args.without_vector_dtype)
    texts = titles(args.data, args.queries)
    t0 = time.perf_counter()
    predictor = Predictor.load(bundle, PredictorOptions(threads=1))
    out = {"bundle": str(bundle), "load_s": round(time.perf_counter() - t0, 2),
           "after_load": {**memory_of(under=bundle),
                          "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}}
    for text in texts:
        predictor.predict_ids([text], k=5)
        if predictor.bundle.has_tree:
            predictor.predict_tree_ids([text], k=5)
    out["after_serving"] = {**memory_of(under=bundle),
                            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
