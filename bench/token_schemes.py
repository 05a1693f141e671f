"""Token schemes on a dataset as written and as a script without spaces would write it.

    python bench/token_schemes.py --data ../shared/data/debian-tags [--config FILE] [--out DIR]

Makes a copy of the dataset whose every letter and digit is an ideograph and whose spaces are
gone (what a dataset in Chinese or Japanese looks like to a tokenizer: words not separated), then
trains and exports a bundle of each (dataset, token_scheme) pair and scores it on the test split
through the served engine: "words" (`\\w+`, the split before schemes) against "unicode-words"
(the default). On the dataset as written the two split ASCII text identically; the spaceless copy
shows what the scheme is for. A training that refuses the data (no validation document shares a
token with the vocabulary) is reported as such. Bundles are kept under --out: a rerun resumes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import sys
import time
from pathlib import Path

import _common

from model_export.evaluate import evaluate_bundle
from model_export.export import export_checkpoint
from service.engine.token_schemes import UNICODE_WORDS, WORDS
from training.config import TrainConfig, read_config_file
from training.pipeline import train

# Letters and digits to ideographs, 37 code points apart (any fixed one-to-one map would do).
_IDEOGRAPHS = {c: chr(0x4E00 + 37 * i) for i, c in enumerate("abcdefghijklmnopqrstuvwxyz0123456789")}


def spaceless(text: str) -> str:
    """`text` lower-cased, letters and digits as ideographs, every other character dropped."""
    return "".join(_IDEOGRAPHS[c] for c in text.lower() if c in _IDEOGRAPHS)


def spaceless_copy(data: Path, out: Path) -> Path:
    if (out / "lbl.json.gz").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("trn.json.gz", "tst.json.gz", "lbl.json.gz"):
        with gzip.open(data / name, "rt") as src, gzip.open(out / f"{name}.part", "wt", encoding="utf-8") as dst:
            for line in src:
                row = json.loads(line)
                row["title"], row["content"] = spaceless(row["title"]), spaceless(row.get("content", ""))
                dst.write(json.dumps(row, ensure_ascii=False) + "\n")
        (out / f"{name}.part").rename(out / name)
    return out


def score(data: Path, scheme: str, cfg: TrainConfig, out: Path) -> dict:
    """The bundle of (data, scheme) trained unless kept, and its test metrics (or why training refused)."""
    done = out / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    started = time.monotonic()
    try:
        ckpt = train(data, TrainConfig.from_dict({"token_scheme": scheme}, base=cfg))
    except ValueError as exc:
        result = {"refused": str(exc)}
    else:
        bundle = export_checkpoint(ckpt.save(out / "ckpt"), out / "bundles", "b")
        result = {**evaluate_bundle(bundle, data), "train_s": time.monotonic() - started,
                  "vocab_size": ckpt.tokenizer.vocab_size}
    out.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--config", type=Path, help="a training config (JSON) for every run")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = TrainConfig.from_dict(read_config_file(args.config)) if args.config else TrainConfig()
    out = args.out or _common.OUT_DIR / f"token-schemes-{args.data.name}"
    variants = {"as written": args.data, "spaceless": spaceless_copy(args.data, out / "spaceless-data")}
    print(f"Command: `{_common.command_line()}` (commit {_common.git_revision()})\n")
    print("| data | token_scheme | vocabulary | P@1 | P@5 | PSP@5 | train (s) |\n|---|---|---:|---:|---:|---:|---:|")
    for name, data in variants.items():
        for scheme in (WORDS, UNICODE_WORDS):
            r = score(data, scheme, cfg, out / f"{name.replace(' ', '-')}-{scheme}")
            if "refused" in r:
                print(f"| {name} | {scheme} | | refused: {r['refused'].split(': ', 1)[-1]} | | | |")
            else:
                print(f"| {name} | {scheme} | {r['vocab_size']:,} | {r['P@1']:.2f} | {r['P@5']:.2f} | "
                      f"{r['PSP@5']:.2f} | {r['train_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
