"""`shortlist generate-data --profile scale`: the properties that keep large generated data hard."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from shortlist.cli import main as cli_main
from training.data import load_labels, load_split
from training.synthetic_scale import BACKGROUND_WORDS, generate_scale


@pytest.fixture(scope="module")
def scale_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("scale") / "data"
    assert cli_main(["generate-data", "--profile", "scale", "--labels", "3000", "--out", str(out), "--seed", "4"]) == 0
    return out


def test_sizes_and_the_format_the_loaders_read(scale_data: Path) -> None:
    labels = load_labels(scale_data)
    trn = load_split(scale_data, "trn", "title", len(labels))
    tst = load_split(scale_data, "tst", "title", len(labels))
    assert len(labels) == 3000 and len(trn) == 3000 and len(tst) == 300
    assert len(set(labels.uids)) == 3000 and len(set(trn.uids)) == 3000


def test_the_label_distribution_has_a_long_tail(scale_data: Path) -> None:
    labels = load_labels(scale_data)
    trn = load_split(scale_data, "trn", "title", len(labels))
    per_doc = np.array([len(t) for t in trn.targets])
    assert per_doc.min() >= 1 and per_doc.max() <= 10 and 4.0 <= per_doc.mean() <= 5.5
    docs_per_label = np.bincount([x for t in trn.targets for x in t], minlength=len(labels))
    assert np.mean(docs_per_label <= 3) >= 0.5  # at least half the labels have 0-3 documents
    assert docs_per_label.max() > 100 * np.median(docs_per_label + 1)  # and a heavy head
    # the head is not the first label ids: labels are ranked in random order
    assert np.argmax(docs_per_label) != 0 or docs_per_label[1] < docs_per_label[0] / 2


def test_texts_mix_label_words_and_a_shared_background(scale_data: Path) -> None:
    labels = load_labels(scale_data)
    trn = load_split(scale_data, "trn", "title", len(labels))
    label_words = [t.split() for t in labels.texts]
    assert all(3 <= len(w) <= 8 for w in label_words)
    doc_words = [t.split() for t in trn.texts]
    assert all(5 <= len(w) <= 15 for w in doc_words)
    # about half of a document's words come from its labels' texts, at least one always
    own = [sum(w in {x for lab in t for x in label_words[lab]} for w in words)
           for words, t in zip(doc_words, trn.targets, strict=True)]
    assert min(own) >= 1
    share = sum(own) / sum(len(w) for w in doc_words)
    assert 0.4 <= share <= 0.65
    # related labels share words: most label words appear in more than one label's text
    uses = Counter(w for words in label_words for w in set(words))
    assert np.mean([uses[w] > 1 for w in uses]) > 0.8
    background = {w for words in doc_words for w in words} - set(uses)
    assert 1000 < len(background) <= BACKGROUND_WORDS


def test_the_same_seed_writes_the_same_data(tmp_path: Path) -> None:
    a = generate_scale(tmp_path / "a", 500, seed=1)
    b = generate_scale(tmp_path / "b", 500, seed=1)
    c = generate_scale(tmp_path / "c", 500, seed=2)
    assert load_split(a, "trn").texts == load_split(b, "trn").texts
    assert load_split(a, "trn").texts != load_split(c, "trn").texts
