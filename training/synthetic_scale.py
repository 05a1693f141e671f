"""A large seeded synthetic dataset in the XC raw-text format, shaped so it cannot be made easy
(`shortlist generate-data --profile scale`; bench/scale.py measures the whole path on it).

Fixed properties, whatever the size:
- label frequencies follow a Zipf law with exponent 1.1 over the labels in random order: with
  about as many documents as labels, at least half the labels have 0-3 training documents;
- 1-10 labels per document (1 + Binomial(9, 4/9): mean 5);
- a label's text is 3-8 words, about half of them its cluster's topic words (labels come in
  clusters of related labels, as product categories do) and the rest drawn from a pool of
  label words every cluster shares (min(L / 5, 100,000) words, at least 2,000): no word names
  one label alone;
- a document's text is 5-15 words, about half (at least one) taken from its labels' texts, the
  rest from a background vocabulary of 50,000 words shared by all documents (word frequencies
  Zipf with exponent 1, as in natural text).
Built with whole-array numpy operations: 10^6 labels and documents take about a minute.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from training.files import StagedFiles

LABEL_ZIPF = 1.1
BACKGROUND_WORDS = 50_000
BACKGROUND_ZIPF = 1.0
LABEL_WORDS = (3, 8)
DOC_WORDS = (5, 15)
LABELS_PER_DOC = (1, 10)
MEAN_LABELS_PER_DOC = 5.0
MEAN_CLUSTER = 20  # labels per cluster of related labels
TOPIC_WORDS = 8  # words per cluster topic
_SYLLABLES = np.array([c + v for c in "bdfgklmnprstvz" for v in "aeiou"])


def _vocabulary(rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` distinct made-up words of three syllables (70^3 = 343,000 possible)."""
    n = len(_SYLLABLES)
    if count > n**3:
        raise ValueError(f"at most {n**3} distinct words, asked for {count}")
    codes = rng.choice(n**3, size=count, replace=False)
    a, rest = np.divmod(codes, n * n)
    b, c = np.divmod(rest, n)
    return np.char.add(np.char.add(_SYLLABLES[a], _SYLLABLES[b]), _SYLLABLES[c])


def _zipf_sampler(rng: np.random.Generator, size: int, exponent: float) -> tuple[np.ndarray, np.ndarray]:
    """(cdf, order): draw k ~ Zipf by searchsorted(cdf, u), item order[k] (ranks in random order)."""
    weights = 1.0 / np.arange(1, size + 1, dtype=np.float64) ** exponent
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return cdf, rng.permutation(size)


def _draw(rng: np.random.Generator, sampler: tuple[np.ndarray, np.ndarray], count: int) -> np.ndarray:
    cdf, order = sampler
    return order[np.minimum(np.searchsorted(cdf, rng.random(count)), len(cdf) - 1)]


def _label_texts(rng: np.random.Generator, num_labels: int, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Word ids [L, 8] (-1 padded) and lengths [L] of the label texts: half topic, half pool."""
    num_clusters = max(2, num_labels // MEAN_CLUSTER)
    topics = rng.integers(0, len(words), size=(num_clusters, TOPIC_WORDS))
    cluster = rng.integers(0, num_clusters, size=num_labels)
    lengths = rng.integers(LABEL_WORDS[0], LABEL_WORDS[1] + 1, size=num_labels)
    n_topic = (lengths + 1) // 2
    # Topic words without repeats within a label: the first n_topic of a random order of 8.
    topic_pick = np.argsort(rng.random((num_labels, TOPIC_WORDS)), axis=1)
    col = np.arange(LABEL_WORDS[1])
    from_topic = col[None, :] < n_topic[:, None]
    topic_words = topics[cluster[:, None], topic_pick[:, np.arange(LABEL_WORDS[1]) % TOPIC_WORDS]]
    pool_words = rng.integers(0, len(words), size=(num_labels, LABEL_WORDS[1]))
    text = np.where(from_topic, topic_words, pool_words)
    text[col[None, :] >= lengths[:, None]] = -1
    return text, lengths


def _documents(rng: np.random.Generator, count: int, label_sampler: tuple[np.ndarray, np.ndarray],
               label_text: np.ndarray, label_len: np.ndarray,
               background: tuple[np.ndarray, np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per document its sorted label ids and its word ids (label-pool ids >= 0, background
    ids encoded as -1 - id), in a random order."""
    per_doc = LABELS_PER_DOC[0] + rng.binomial(
        LABELS_PER_DOC[1] - LABELS_PER_DOC[0], (MEAN_LABELS_PER_DOC - LABELS_PER_DOC[0])
        / (LABELS_PER_DOC[1] - LABELS_PER_DOC[0]), size=count)
    doc_of = np.repeat(np.arange(count), per_doc)
    drawn = _draw(rng, label_sampler, len(doc_of))
    # A head label drawn twice for one document counts once (the mean stays ~5).
    keys = np.unique(doc_of.astype(np.int64) * len(label_len) + drawn)
    doc_of, labels = np.divmod(keys, len(label_len))
    label_counts = np.bincount(doc_of, minlength=count)
    label_starts = np.cumsum(label_counts) - label_counts
    n_words = rng.integers(DOC_WORDS[0], DOC_WORDS[1] + 1, size=count)
    n_from_labels = np.clip(rng.binomial(n_words, 0.5), 1, n_words)
    # Label words: slot j of a document takes a random word of its label (j mod its label count),
    # its labels in random order so every label of a document has the same chance to speak.
    slot_doc = np.repeat(np.arange(count), n_from_labels)
    slot = np.arange(len(slot_doc)) - np.repeat(np.cumsum(n_from_labels) - n_from_labels, n_from_labels)
    shift = rng.integers(0, 1 << 30, size=count)
    slot_label = labels[label_starts[slot_doc] + (slot + shift[slot_doc]) % label_counts[slot_doc]]
    pick = (rng.random(len(slot_doc)) * label_len[slot_label]).astype(np.int64)
    label_words = label_text[slot_label, pick]
    bg_doc = np.repeat(np.arange(count), n_words - n_from_labels)
    bg_words = -1 - _draw(rng, background, len(bg_doc))
    word_doc = np.concatenate([slot_doc, bg_doc])
    word_ids = np.concatenate([label_words, bg_words])
    order = np.lexsort((rng.random(len(word_doc)), word_doc))
    word_ids = word_ids[order]
    word_bounds = np.cumsum(n_words)[:-1]
    return np.split(labels, np.cumsum(label_counts)[:-1]), np.split(word_ids, word_bounds)


# gzip level 1: a 10^6-document file at the default level 9 took minutes for a few % of size.
_GZIP_LEVEL = 1


def generate_scale(out_dir: str | Path, num_labels: int, train_docs: int | None = None,
                   test_docs: int | None = None, seed: int = 0) -> Path:
    """Write trn.json.gz, tst.json.gz and lbl.json.gz under out_dir (documents default to about
    as many as labels, test to a tenth of that); returns out_dir."""
    train_docs = num_labels if train_docs is None else train_docs
    test_docs = max(1, train_docs // 10) if test_docs is None else test_docs
    if num_labels < 2 or train_docs < 1 or test_docs < 0:
        raise ValueError("need at least 2 labels, 1 training document and a non-negative test size")
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pool_size = int(np.clip(num_labels // 5, 2000, 100_000))
    vocab = _vocabulary(rng, pool_size + BACKGROUND_WORDS)
    pool, background_words = vocab[:pool_size], vocab[pool_size:]
    label_text, label_len = _label_texts(rng, num_labels, pool)
    titles = [" ".join(pool[row[:n]]) for row, n in zip(label_text, label_len, strict=True)]
    with StagedFiles(out) as files:  # renamed into place together, once all are written
        files.write_gz_lines("lbl.json.gz", (json.dumps({"uid": f"L{i}", "title": t, "content": ""})
                                             for i, t in enumerate(titles)), _GZIP_LEVEL)
        label_sampler = _zipf_sampler(rng, num_labels, LABEL_ZIPF)
        background = _zipf_sampler(rng, BACKGROUND_WORDS, BACKGROUND_ZIPF)
        words = np.concatenate([pool, background_words[::-1]])  # id -1 - b -> background word b
        for name, prefix, count in (("trn", "d", train_docs), ("tst", "t", test_docs)):
            labels, texts = _documents(rng, count, label_sampler, label_text, label_len, background)
            files.write_gz_lines(f"{name}.json.gz", (
                json.dumps({"uid": f"{prefix}{i}", "title": " ".join(words[ids]), "content": "",
                            "target_ind": lab.tolist(), "target_rel": [1.0] * len(lab)})
                for i, (lab, ids) in enumerate(zip(labels, texts, strict=True))), _GZIP_LEVEL)
    return out
