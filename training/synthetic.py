"""A small seeded synthetic dataset in the XC raw-text format (the demo's and tests' fallback).

Labels belong to topics; a label's text is its own name word plus a few of its topic's
words. A document picks 1-4 labels (label popularity follows a power law, so there is a
head and a long tail), mixes their words with some dropped or replaced by another word
of the topic, and adds generic noise words. So a label is recoverable from a document's
words, but not trivially, and the head labels carry a prior like real data.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from training.files import StagedFiles

_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
# Words are 2-3 syllables, ~348,000 distinct: past them drawing a new one never ended (a large
# --labels ran for ever), and drawing slows as they run out. The small profile is the demo's and
# tests' data; `--profile scale` (training/synthetic_scale.py) is for more labels.
MAX_SMALL_LABELS = 20_000


def _words(rng: np.random.Generator, count: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        w = "".join(rng.choice(_SYLLABLES, size=int(rng.integers(2, 4))))
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


def generate(
    out_dir: str | Path,
    num_labels: int = 2000,
    train_docs: int = 8000,
    test_docs: int = 2000,
    seed: int = 0,
    zipf_exponent: float = 1.0,
) -> Path:
    """Write trn.json.gz, tst.json.gz and lbl.json.gz under out_dir; returns out_dir."""
    if num_labels < 2 or train_docs < 1 or test_docs < 0:
        raise ValueError("need at least 2 labels, 1 training document and a non-negative test size")
    if num_labels > MAX_SMALL_LABELS:
        raise ValueError(f"--labels {num_labels}: the small profile makes at most {MAX_SMALL_LABELS} labels (its "
                         "made-up words run out); --profile scale makes 10^4..10^6+")
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    taken: set[str] = set()
    num_topics = max(2, num_labels // 25)
    topic_words = [_words(rng, 12, taken) for _ in range(num_topics)]
    noise_words = _words(rng, 300, taken)
    names = _words(rng, num_labels, taken)
    label_topic = rng.integers(0, num_topics, size=num_labels)
    label_words: list[list[str]] = []
    lbl_rows = []
    for i in range(num_labels):
        words = [names[i], *rng.choice(topic_words[label_topic[i]], size=3, replace=False).tolist()]
        label_words.append(words)
        lbl_rows.append({"uid": f"L{i}", "title": " ".join(words), "content": f"about {' '.join(words)}"})
    # Power-law popularity over a random order of labels, so the head is not just low ids.
    popularity = 1.0 / np.arange(1, num_labels + 1) ** zipf_exponent
    popularity = popularity[rng.permutation(num_labels)]
    popularity /= popularity.sum()

    def document(idx: int, prefix: str) -> dict:
        n = int(rng.choice([1, 2, 3, 4], p=[0.4, 0.3, 0.2, 0.1]))
        labels = rng.choice(num_labels, size=n, replace=False, p=popularity).tolist()
        words: list[str] = []
        for lab in labels:
            for w in label_words[lab]:
                r = rng.random()
                if r < 0.3:
                    continue  # dropped
                if r < 0.4:
                    w = str(rng.choice(topic_words[label_topic[lab]]))  # replaced by a topic word
                words.append(w)
            if not words:
                words.append(label_words[lab][0])
        words.extend(rng.choice(noise_words, size=int(rng.integers(1, 4))).tolist())
        rng.shuffle(words)
        text = " ".join(words)
        return {
            "uid": f"{prefix}{idx}",
            "title": text,
            "content": f"{text} {text}",
            "target_ind": sorted(labels),
            "target_rel": [1.0] * n,
        }

    with StagedFiles(out) as files:  # renamed into place together, once all are written
        files.write_gz_lines("lbl.json.gz", map(json.dumps, lbl_rows))
        files.write_gz_lines("trn.json.gz", (json.dumps(document(i, "d")) for i in range(train_docs)))
        files.write_gz_lines("tst.json.gz", (json.dumps(document(i, "t")) for i in range(test_docs)))
    return out


def run_cli(args: argparse.Namespace) -> int:
    if args.profile == "scale":
        from training.synthetic_scale import generate_scale

        out = generate_scale(args.out, args.labels, args.train_docs, args.test_docs, args.seed)
    else:
        train_docs = 8000 if args.train_docs is None else args.train_docs
        test_docs = 2000 if args.test_docs is None else args.test_docs
        out = generate(args.out, args.labels, train_docs, test_docs, args.seed)
    print(f"wrote a {args.profile} dataset of {args.labels} labels to {out}")
    return 0
