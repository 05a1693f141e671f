"""The bundle fuzzer at length: thousands of seeded faults, one per variant, over a bundle.

    python bench/fuzz_bundles.py [--bundle DIR] [--variants 3000] [--seed 0]

Without --bundle, a small bundle is trained and exported from generated data first (~30 s).
Prints, per file and fault, how many variants were refused at load, refused when a source the
scoring does not search was first opened, served (answers checked sound on every scorer path),
or broke (an error a request would see as a 5xx, or a crash of the worker process); exits 1
when a structural fault was not refused or anything broke. tests/test_bundle_fuzz.py runs the
same fuzzer on a few hundred variants in CI.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

from shortlist.bundle_fuzz import fuzz


def _small_bundle(work: Path) -> Path:
    from model_export.export import export_checkpoint
    from training.config import TrainConfig
    from training.pipeline import train
    from training.synthetic import generate

    generate(work / "data", num_labels=300, train_docs=1500, test_docs=300, seed=0)
    train(work / "data", TrainConfig.tiny(), seed=1).save(work / "ckpt")
    export_checkpoint(work / "ckpt", work / "bundles", "v1")
    return work / "bundles" / "v1"


def _report(records: list[dict], seconds: float) -> int:
    table: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for r in records:
        table[(r["file"], r["kind"])][r["outcome"]] += 1
    columns = ("refused", "refused on first need", "served", "error", "crash")
    print(f"\n| file | fault | structural | {' | '.join(columns)} |")
    print("|---|---|---|" + "---:|" * len(columns))
    must = {(r["file"], r["kind"]): r["must_refuse"] for r in records}
    for key in sorted(table):
        counts = table[key]
        print(f"| {key[0]} | {key[1]} | {'yes' if must[key] else 'no'} | "
              + " | ".join(str(counts[c]) for c in columns) + " |")
    totals = collections.Counter(r["outcome"] for r in records)
    print(f"\n{len(records)} variants in {seconds:.0f} s ({1e3 * seconds / max(1, len(records)):.0f} ms each): "
          + ", ".join(f"{c} {totals[c]}" for c in columns))
    failed = [r for r in records if r["outcome"] in ("error", "crash")
              or (r["must_refuse"] and not r["outcome"].startswith("refused"))]
    for r in failed[:20]:
        print(f"FAIL variant {r['index']}: {r['file']} {r['kind']} -> {r['outcome']}: {r['message'][:200]}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=None, help="a bundle directory (default: train a small one)")
    ap.add_argument("--variants", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fuzz-bundles-") as tmp:
        work = Path(tmp)
        bundle = args.bundle or _small_bundle(work)
        start, done = time.monotonic(), [0]

        def progress(record: dict) -> None:
            done[0] += 1
            if done[0] % 250 == 0:
                print(f"{done[0]}/{args.variants} variants, {time.monotonic() - start:.0f} s", flush=True)

        records = fuzz(bundle, work / "variants", args.seed, args.variants, progress=progress)
        return _report(records, time.monotonic() - start)


if __name__ == "__main__":
    sys.exit(main())
