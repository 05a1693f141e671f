"""The token shortlist: fitted from co-occurrence in training, validated in the bundle, read at serving."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from service.engine import Bundle, BundleError, Predictor
from service.engine.bundle import MANIFEST, TOKEN_SHORTLIST, sha256_file
from training.token_shortlist import fit_token_shortlist


def _targets(rows: list[list[int]], num_labels: int) -> sp.csr_matrix:
    y = sp.lil_matrix((len(rows), num_labels), dtype=np.float32)
    for i, labels in enumerate(rows):
        for label in labels:
            y[i, label] = 1.0
    return y.tocsr()


def test_rows_rank_labels_by_documents_shared_then_label_text_then_id():
    # vocab: 0 pad, 1 "a", 2 "b", 3 "c" (only in a label text), 4 unused
    docs = np.array([[1, 2, 1], [1, 0, 0], [1, 2, 0], [2, 0, 0]])
    y = _targets([[0], [1], [1, 2], [2]], 4)
    label_text = np.array([[0, 0], [3, 0], [3, 1], [0, 0]])
    table = fit_token_shortlist(docs, y, label_text, vocab_size=5, width=3)
    assert table.dtype == np.int32 and table.shape == (5, 3)
    assert table[0].tolist() == [-1, -1, -1]
    # "a": label 1 in 2 docs (+0), label 2 in 1 doc + its own text, label 0 in 1 doc; a
    # token repeated in a document counts once.
    assert table[1].tolist() == [1, 2, 0]
    # "b": label 2 in 2 docs, then labels 0 and 1 tied at 1 doc: the smaller id first
    assert table[2].tolist() == [2, 0, 1]
    # "c" is in no document, only in the texts of labels 1 and 2
    assert table[3].tolist() == [1, 2, -1]
    assert table[4].tolist() == [-1, -1, -1]
    assert fit_token_shortlist(docs, y, label_text, 5, width=1)[:, 0].tolist() == [-1, 1, 2, 1, -1]


def test_bad_inputs_are_refused():
    docs = np.array([[1]])
    y = _targets([[0]], 2)
    with pytest.raises(ValueError, match="width"):
        fit_token_shortlist(docs, y, np.zeros((2, 1), np.int64), 2, width=0)
    with pytest.raises(ValueError, match="rows of targets"):
        fit_token_shortlist(np.array([[1], [1]]), y, np.zeros((2, 1), np.int64), 2, width=1)
    with pytest.raises(ValueError, match="label texts"):
        fit_token_shortlist(docs, y, np.zeros((3, 1), np.int64), 2, width=1)


def _write_table(bundle_dir: Path, table: np.ndarray, k_tok: int | None = None) -> None:
    np.save(bundle_dir / TOKEN_SHORTLIST, table)
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    manifest["files"][TOKEN_SHORTLIST] = sha256_file(bundle_dir / TOKEN_SHORTLIST)
    if k_tok is not None:
        manifest["scoring"]["shortlist"]["k_tok"] = k_tok
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))


def test_exported_bundle_carries_the_table_and_serves_it(bundle_root):
    bundle = Bundle.load(bundle_root / "v1")
    k_tok = bundle.manifest.scoring.shortlist.k_tok
    assert k_tok >= 1 and bundle.token_shortlist is not None
    assert bundle.token_shortlist.shape[0] == bundle.tokenizer.vocab_size
    text = bundle.labels.titles[7]
    token_ids, _ = bundle.tokenizer.encode(text)
    expected = {int(x) for t in token_ids for x in bundle.token_shortlist[t, :k_tok] if x >= 0}
    assert expected, "the label's own title must reach the table"
    # With the HNSW searches and the head off, the shortlist is exactly the tokens' rows.
    only_tokens = Predictor(bundle, shortlist_w=0, shortlist_mu=0, shortlist_head=0)
    assert set(only_tokens.shortlist([text])[0].tolist()) == expected
    ids, _ = only_tokens.predict_ids([text], k=len(expected) + 3)
    assert set(ids[0][ids[0] >= 0].tolist()) == expected
    # A text with no known token gets nothing to score from the table alone.
    ids, _ = only_tokens.predict_ids(["zzqx unknown"], k=3)
    assert ids.tolist() == [[-1, -1, -1]]
    # The default predictor's shortlist holds the token rows as well.
    assert expected <= set(Predictor(bundle).shortlist([text])[0].tolist())


def test_token_shortlist_sizes_are_checked(bundle_root):
    bundle = Bundle.load(bundle_root / "v1")
    width = bundle.token_shortlist.shape[1]
    Predictor(bundle, shortlist_tok=width)
    with pytest.raises(ValueError, match="labels per token"):
        Predictor(bundle, shortlist_tok=width + 1)
    with pytest.raises(ValueError, match="all 0"):
        Predictor(bundle, shortlist_w=0, shortlist_mu=0, shortlist_tok=0)
    with pytest.raises(ValueError, match=">= 0"):
        Predictor(bundle, shortlist_tok=-1)


def test_bundle_with_k_tok_needs_a_valid_table(bundle_root_copy):
    bundle_dir = bundle_root_copy / "v1"
    good = np.load(bundle_dir / TOKEN_SHORTLIST)
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    num_labels = manifest["num_labels"]

    del manifest["files"][TOKEN_SHORTLIST]
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="k_tok > 0 but token_shortlist.npy is not listed"):
        Bundle.load(bundle_dir)

    for bad, message in [
        (good.astype(np.int64), "expected int32"),
        (good[:-1], "expected int32"),
        (np.where(good == good.max(), num_labels, good).astype(np.int32), "label ids outside"),
        (np.full_like(good, -2), "label ids outside"),
    ]:
        _write_table(bundle_dir, bad)
        with pytest.raises(BundleError, match=message):
            Bundle.load(bundle_dir)
    _write_table(bundle_dir, good, k_tok=good.shape[1] + 1)
    with pytest.raises(BundleError, match="rows hold"):
        Bundle.load(bundle_dir)
    _write_table(bundle_dir, good, k_tok=good.shape[1])
    assert Bundle.load(bundle_dir).manifest.scoring.shortlist.k_tok == good.shape[1]


def test_bundle_without_a_table_still_serves(bundle_root_copy):
    """Bundles written before the token shortlist existed: no file, no k_tok."""
    bundle_dir = bundle_root_copy / "v1"
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    del manifest["files"][TOKEN_SHORTLIST]
    del manifest["scoring"]["shortlist"]["k_tok"]
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    (bundle_dir / TOKEN_SHORTLIST).unlink()
    bundle = Bundle.load(bundle_dir)
    assert bundle.token_shortlist is None
    predictor = Predictor(bundle)
    assert predictor.shortlist_tok == 0
    ids, _ = predictor.predict_ids([bundle.labels.titles[3]], k=5)
    assert (ids >= 0).all()
    with pytest.raises(ValueError, match="holds 0 labels per token"):
        Predictor(bundle, shortlist_tok=1)


def test_manifest_with_no_query_dependent_shortlist_is_refused(bundle_root_copy):
    bundle_dir = bundle_root_copy / "v1"
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    manifest["scoring"]["shortlist"].update({"k_w": 0, "k_mu": 0, "k_tok": 0})
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="all 0"):
        Bundle.load(bundle_dir)
