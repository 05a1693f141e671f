"""The token shortlist: fitted from co-occurrence in training, validated in the bundle, read at serving."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from service.engine import Bundle, BundleError, Predictor, PredictorOptions
from service.engine.candidates import merge_shortlists
from service.engine.lexical import TokenShortlist
from service.engine.schema import (
    LEXICAL_FILES,
    MANIFEST,
    TOKEN_SHORTLIST,
    TOKEN_SHORTLIST_BIAS,
    TOKEN_SHORTLIST_SHARES,
    TOKEN_SHORTLIST_WEIGHTS,
    sha256_file,
)
from training.token_shortlist import fit_token_logistic, fit_token_shortlist


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
    table, shares = fit_token_shortlist(docs, y, label_text, vocab_size=5, width=3)
    assert table.dtype == np.int32 and table.shape == (5, 3)
    assert shares.dtype == np.float32 and shares.shape == (5, 3)
    assert table[0].tolist() == [-1, -1, -1]
    # "a": label 1 in 2 docs (+0), label 2 in 1 doc + its own text, label 0 in 1 doc; a
    # token repeated in a document counts once.
    assert table[1].tolist() == [1, 2, 0]
    # "b": label 2 in 2 docs, then labels 0 and 1 tied at 1 doc: the smaller id first
    assert table[2].tolist() == [2, 0, 1]
    # "c" is in no document, only in the texts of labels 1 and 2
    assert table[3].tolist() == [1, 2, -1]
    assert table[4].tolist() == [-1, -1, -1]
    # shares: co-occurrences / texts holding the token ("a": 3 documents + 1 label text)
    np.testing.assert_allclose(shares[1], [2 / 4, 2 / 4, 1 / 4])
    np.testing.assert_allclose(shares[3], [1 / 2, 1 / 2, 0])
    assert not shares[0].any() and not shares[4].any()
    assert fit_token_shortlist(docs, y, label_text, 5, width=1)[0][:, 0].tolist() == [-1, 1, 2, 1, -1]


def test_bad_inputs_are_refused():
    docs = np.array([[1]])
    y = _targets([[0]], 2)
    with pytest.raises(ValueError, match="width"):
        fit_token_shortlist(docs, y, np.zeros((2, 1), np.int64), 2, width=0)
    with pytest.raises(ValueError, match="rows of targets"):
        fit_token_shortlist(np.array([[1], [1]]), y, np.zeros((2, 1), np.int64), 2, width=1)
    with pytest.raises(ValueError, match="label texts"):
        fit_token_shortlist(docs, y, np.zeros((3, 1), np.int64), 2, width=1)


def _write_table(bundle_dir: Path, table: np.ndarray, k_tok: int | None = None, name: str = TOKEN_SHORTLIST) -> None:
    np.save(bundle_dir / name, table)
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    manifest["files"][name] = sha256_file(bundle_dir / name)
    if k_tok is not None:
        manifest["scoring"]["shortlist"]["k_tok"] = k_tok
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))


def test_exported_bundle_carries_the_table_and_serves_it(bundle_root):
    bundle = Predictor.load(bundle_root / "v1").bundle
    k_tok = bundle.manifest.scoring.shortlist.k_tok
    table = bundle.token_table()
    assert k_tok >= 1 and table is not None
    labels = table.labels
    assert labels.shape[0] == bundle.tokenizer.vocab_size and table.weights is not None
    assert bundle.manifest.scoring.lexical_form == table.form == "logistic"  # the tiny preset's
    text = bundle.labels.titles[7]
    token_ids, _ = bundle.tokenizer.encode(text)
    expected = {int(x) for t in token_ids for x in labels[t, :k_tok] if x >= 0}
    assert expected, "the label's own title must reach the table"
    # With the HNSW searches and the head off, the shortlist is exactly the tokens' rows.
    only_tokens = Predictor(bundle, PredictorOptions(k_w=0, k_mu=0, k_head=0))
    assert set(only_tokens.shortlist([text])[0].tolist()) == expected
    ids, _ = only_tokens.predict_ids([text], k=len(expected) + 3)
    assert set(ids[0][ids[0] >= 0].tolist()) == expected
    # A text with no known token gets nothing to score from the table alone.
    ids, _ = only_tokens.predict_ids(["zzqx unknown"], k=3)
    assert ids.tolist() == [[-1, -1, -1]]
    # The default predictor's shortlist holds the token rows as well.
    assert expected <= set(Predictor(bundle).shortlist([text])[0].tolist())


def test_bundle_with_k_tok_needs_a_valid_table(bundle_root_copy):
    bundle_dir = bundle_root_copy / "v1"
    good = np.load(bundle_dir / TOKEN_SHORTLIST)
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    num_labels = manifest["num_labels"]
    k_tok = manifest["scoring"]["shortlist"]["k_tok"]
    assert 0 < k_tok < good.shape[1]

    del manifest["files"][TOKEN_SHORTLIST]
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="k_tok > 0 but token_shortlist.npy is not listed"):
        Predictor.load(bundle_dir)
    manifest["scoring"]["shortlist"]["k_tok"] = 0
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="token_shortlist_weights.npy without token_shortlist.npy"):
        Predictor.load(bundle_dir)
    manifest["scoring"]["shortlist"]["k_tok"] = k_tok  # served again: the table is read, and checked
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))

    for bad, message in [
        (good.astype(np.int64), "expected int32"),
        (good[:-1], "expected int32"),
        (np.where(good == good.max(), num_labels, good).astype(np.int32), "label ids outside"),
        (np.full_like(good, -2), "label ids outside"),
    ]:
        _write_table(bundle_dir, bad)
        with pytest.raises(BundleError, match=message):
            Predictor.load(bundle_dir)
    _write_table(bundle_dir, good, k_tok=good.shape[1] + 1)
    with pytest.raises(BundleError, match="rows hold"):
        Predictor.load(bundle_dir)
    # at the edge, k_tok = the row width: rows cut to the served k_tok (the canary's answers stay)
    weights = np.load(bundle_dir / TOKEN_SHORTLIST_WEIGHTS)
    _write_table(bundle_dir, np.ascontiguousarray(weights[:, :k_tok]), name=TOKEN_SHORTLIST_WEIGHTS)
    _write_table(bundle_dir, np.ascontiguousarray(good[:, :k_tok]), k_tok=k_tok)
    assert Predictor.load(bundle_dir).bundle.token_table().width == k_tok


def test_bundle_without_a_table_still_serves(bundle_root_copy):
    """Bundles written before the token shortlist existed: no file, no k_tok."""
    bundle_dir = bundle_root_copy / "v1"
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    for name in (TOKEN_SHORTLIST, *LEXICAL_FILES["logistic"]):
        del manifest["files"][name]
        (bundle_dir / name).unlink()
    del manifest["scoring"]["shortlist"]["k_tok"]
    del manifest["scoring"]["lexical_weight"]
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    # The canaries were recorded with the lexical score, which this bundle no longer has.
    bundle = Bundle.open(bundle_dir)
    assert bundle.token_table() is None
    predictor = Predictor(bundle)
    assert predictor.scoring.shortlist.k_tok == 0
    ids, _ = predictor.predict_ids([bundle.labels.titles[3]], k=5)
    assert (ids >= 0).all()
    with pytest.raises(ValueError, match="holds 0 labels per token"):
        Predictor(bundle, PredictorOptions(k_tok=1))


def test_manifest_with_no_query_dependent_shortlist_is_refused(bundle_root_copy):
    bundle_dir = bundle_root_copy / "v1"
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    manifest["scoring"]["shortlist"].update({"k_w": 0, "k_mu": 0, "k_tok": 0})
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="all 0"):
        Predictor.load(bundle_dir)


def test_lexical_terms_summed_per_label_equal_the_dense_reference():
    labels = np.array([[-1, -1], [0, 2], [2, -1], [1, 0]], dtype=np.int32)
    shares = np.array([[0, 0], [0.5, 0.25], [1.0, 0], [0.75, 0.5]], dtype=np.float32)
    table = TokenShortlist(labels, shares)
    tokens = np.array([[1, 2, 0], [3, 0, 0], [0, 0, 0]])
    weights = np.array([[0.6, 0.8, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    dense = table.dense_scores(tokens, weights, num_labels=4, k=2)
    # label 2: 0.6 * 0.25 (token 1) + 0.8 * 1.0 (token 2)
    np.testing.assert_allclose(dense[0], [0.6 * 0.5, 0, 0.6 * 0.25 + 0.8, 0], rtol=1e-6)
    np.testing.assert_allclose(dense[1], [0.5, 0.75, 0, 0], rtol=1e-6)
    assert not dense[2].any()
    ids, terms = table.entries(tokens, 2, weights)
    assert ids.shape == terms.shape == (3, 6)
    summed = np.zeros((3, 5), dtype=np.float32)  # column 4 collects the empty (-1) slots
    np.add.at(summed, (np.repeat(np.arange(3), 6), ids.ravel()), terms.ravel())
    np.testing.assert_allclose(summed[:, :4], dense, rtol=1e-6)
    assert not summed[:, 4].any()  # empty slots carry no weight
    assert table.entries(tokens, 2)[1] is None
    # k = 1 reads only the first label of each row
    np.testing.assert_allclose(table.dense_scores(tokens, weights, 4, k=1)[0], [0.3, 0, 0.8, 0], rtol=1e-6)
    with pytest.raises(LookupError, match="no weights"):
        TokenShortlist(labels).entries(tokens, 2, weights)
    with pytest.raises(ValueError, match="differs"):
        TokenShortlist(labels, shares[:, :1])
    with pytest.raises(ValueError, match="empty"):
        TokenShortlist(labels, np.where(labels < 0, 0.1, shares).astype(np.float32))


def test_logistic_scores_are_the_sigmoid_of_the_summed_terms_plus_the_label_bias():
    labels = np.array([[-1, -1], [0, 2], [2, -1], [1, 0]], dtype=np.int32)
    weights = np.array([[0, 0], [1.5, -2.0], [0.5, 0], [-1.0, 3.0]], dtype=np.float32)
    bias = np.array([-1.0, 0.5, 0.0, -4.0], dtype=np.float32)
    table = TokenShortlist(labels, weights, "logistic", bias)
    tokens = np.array([[1, 2, 0], [3, 0, 0]])
    x = np.array([[0.6, 0.8, 0.0], [1.0, 0.0, 0.0]], dtype=np.float32)
    sigmoid = lambda z: 1 / (1 + np.exp(-np.asarray(z, dtype=np.float64)))  # noqa: E731
    dense = table.dense_scores(tokens, x, num_labels=4, k=2)
    # label 2: 0.6 * -2.0 (token 1) + 0.8 * 0.5 (token 2); a label in none of the query's rows: 0
    np.testing.assert_allclose(dense[0], [*sigmoid([0.9 - 1.0]), 0, *sigmoid([-1.2 + 0.4]), 0], rtol=1e-6)
    np.testing.assert_allclose(dense[1], [*sigmoid([3.0 - 1.0, -1.0 + 0.5]), 0, 0], rtol=1e-6)
    ids, terms = table.entries(tokens, 2, x)
    cands, sums = merge_shortlists(ids, terms, 4)
    served = table.scores(cands, sums)
    for row in range(2):
        listed = cands[row] >= 0
        np.testing.assert_allclose(served[row][listed], dense[row, cands[row][listed]], rtol=1e-6)
    for bad, message in [
        (dict(form="logistic"), "needs a bias"),
        (dict(form="logistic", bias=bias[:2]), "bias covers 2 labels"),
        (dict(form="shares", bias=bias), "logistic form"),
        (dict(form="softmax", bias=bias), "lexical form must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            TokenShortlist(labels, weights, **bad)


def test_fit_token_logistic_learns_which_token_points_at_which_label():
    # vocab: 0 pad, 1 "a" (always label 0), 2 "b" (always label 1), 3 "c" (nothing)
    docs = np.array([[1, 0], [1, 2], [2, 0], [2, 3], [3, 0], [1, 3]] * 20)
    x = np.where(docs > 0, 1.0, 0.0).astype(np.float32)
    y = _targets([[0], [0, 1], [1], [1], [], [0]] * 20, 3)
    table = np.array([[-1, -1], [0, 1], [1, 0], [1, -1]], dtype=np.int32)
    kwargs = dict(epochs=30, lr=0.1, l2=1e-4, batch_size=16, seed=3, device=torch.device("cpu"))
    weights, bias, losses = fit_token_logistic(docs, x, y, table, 2, **kwargs)
    assert weights.shape == table.shape and weights.dtype == np.float32 and bias.shape == (3,)
    assert losses[-1] < losses[0]
    assert not weights[table < 0].any()
    assert weights[1, 0] > 1 and weights[1, 1] < -1  # "a": label 0 yes, label 1 no
    assert weights[2, 0] > 1 and weights[2, 1] < -1  # "b": label 1 yes, label 0 no
    assert weights[3, 0] < 0  # "c" alone is no label
    # The learned scores put each document's labels first.
    lexical = TokenShortlist(table, weights, "logistic", bias).dense_scores(docs[:6], x[:6], 3, 2)
    assert lexical[0].argmax() == 0 and lexical[2].argmax() == 1 and lexical[5].argmax() == 0
    assert (lexical[4] < 0.5).all()
    # Deterministic given the seed; k = 1 trains the first column only.
    again = fit_token_logistic(docs, x, y, table, 2, **kwargs)
    np.testing.assert_array_equal(again[0], weights)
    first, _, _ = fit_token_logistic(docs, x, y, table, 1, **kwargs)
    assert first[:, 0].any() and not first[:, 1].any()
    # tol: it stops at the first epoch that lowers the loss by less than that share, early
    stopped = fit_token_logistic(docs, x, y, table, 2, **{**kwargs, "epochs": 1000, "tol": 1e-2})[2]
    gains = [(a - b) / a for a, b in zip(stopped[:-1], stopped[1:], strict=True)]
    assert len(stopped) < 1000 and gains[-1] < 1e-2 and min(gains[:-1]) >= 1e-2
    with pytest.raises(ValueError, match="k must be in"):
        fit_token_logistic(docs, x, y, table, 3, **kwargs)
    with pytest.raises(ValueError, match="documents"):
        fit_token_logistic(docs[:-1], x[:-1], y, table, 2, **kwargs)


def test_soft_targets_weigh_the_token_rows_and_are_what_the_logistic_form_fits():
    # Aggregated data's imputed labels carry a weight in (0, 1]: "a" is seen with label 0 in
    # three documents at 0.2 each and with label 1 in two at 1: label 1 shares more of it.
    docs = np.array([[1], [1], [1], [1], [1]])
    y = sp.csr_matrix((np.array([0.2, 0.2, 0.2, 1, 1], np.float32), np.array([0, 0, 0, 1, 1]), np.arange(6)),
                      shape=(5, 2))
    table, shares = fit_token_shortlist(docs, y, np.zeros((2, 1), np.int64), 2, 2)
    assert table[1].tolist() == [1, 0]
    np.testing.assert_allclose(shares[1], [2 / 5, 0.6 / 5], rtol=1e-6)
    # The logistic form fits P(label | "a") to the weights: every document holds label 0 at 0.3.
    docs = np.ones((64, 1), np.int64)
    x = np.ones((64, 1), np.float32)
    soft = sp.csr_matrix((np.full(64, 0.3, np.float32), np.zeros(64, np.int64), np.arange(65)), shape=(64, 1))
    kwargs = dict(epochs=1000, lr=0.01, l2=0.0, batch_size=64, seed=0, device=torch.device("cpu"))
    table = np.array([[-1], [0]], np.int32)
    weights, bias, _ = fit_token_logistic(docs, x, soft, table, 1, **kwargs)
    assert abs(1 / (1 + np.exp(-(weights[1, 0] + bias[0]))) - 0.3) < 0.01
    hard, hard_bias, _ = fit_token_logistic(docs, x, (soft > 0).astype(np.float32), table, 1, **kwargs)
    assert 1 / (1 + np.exp(-(hard[1, 0] + hard_bias[0]))) > 0.95


def test_merged_shortlist_sums_each_labels_terms_and_is_the_same_alone_and_in_a_batch():
    # two sources per row: label ids with repeats and empty (-1) slots, and their terms
    ids = np.array([[3, -1, 1, 3, 7], [-1, -1, -1, -1, -1], [0, 0, 2, -1, 5]], dtype=np.int64)
    terms = np.array([[0.5, 0, 0.25, 0.5, 1.0], [0, 0, 0, 0, 0], [0.1, 0.2, 0, 0, 0.3]], dtype=np.float32)
    cands, summed = merge_shortlists(ids, terms, num_labels=8)
    np.testing.assert_array_equal(cands, [[1, 3, 7], [-1, -1, -1], [0, 2, 5]])
    np.testing.assert_allclose(summed, [[0.25, 1.0, 1.0], [0, 0, 0], [0.3, 0, 0.3]], rtol=1e-6)
    for row in range(3):
        alone, alone_terms = merge_shortlists(ids[row : row + 1], terms[row : row + 1], num_labels=8)
        width = max(1, int((cands[row] >= 0).sum()))
        np.testing.assert_array_equal(alone[0], cands[row, :width])
        np.testing.assert_array_equal(alone_terms[0], summed[row, :width])
    only_ids, none = merge_shortlists(ids, None, num_labels=8)
    assert none is None
    np.testing.assert_array_equal(only_ids, cands)
    # the largest label id and a row of nothing but empty slots
    np.testing.assert_array_equal(merge_shortlists(np.array([[7, -1, 7]]), None, 8)[0], [[7]])
    np.testing.assert_array_equal(merge_shortlists(np.array([[-1, -1]]), None, 8)[0], [[-1]])


def test_served_lexical_scoring_equals_brute_force_when_the_shortlist_holds_every_label(bundle_root):
    bundle = Predictor.load(bundle_root / "v1").bundle
    texts = [*bundle.labels.titles[:30], "", "zzqx unknown"]
    every = bundle.manifest.num_labels
    everything = Predictor(bundle, PredictorOptions(k_head=every, head="always", lexical_weight=0.5))
    served_ids, served_scores = everything.predict_ids(texts, k=5)
    exact_ids, exact_scores = everything.predict_exact_ids(texts, k=5)
    np.testing.assert_allclose(served_scores, exact_scores, atol=1e-6)
    assert np.mean(served_ids == exact_ids) > 0.97  # only exact ties may order differently
    # and the lexical term moves scores: the same texts without it score differently
    without = Predictor(bundle, PredictorOptions(k_head=every, head="always", lexical_weight=0.0))
    _, plain = without.predict_ids(texts, 5)
    assert not np.allclose(plain, served_scores)


def test_lexical_weight_is_checked(bundle_root, bundle_root_copy):
    bundle = Predictor.load(bundle_root / "v1").bundle
    Predictor(bundle, PredictorOptions(lexical_weight=0.0))
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lexical_weight"):
            Predictor(bundle, PredictorOptions(lexical_weight=bad))
    with pytest.raises(ValueError, match="needs a token shortlist"):
        Predictor(bundle, PredictorOptions(lexical_weight=0.2, k_tok=0))
    # without the token rows the bundle's own weight does not apply (nothing to read it from)
    assert bundle.manifest.scoring.lexical_weight > 0
    assert Predictor(bundle, PredictorOptions(k_tok=0)).scoring.lexical_weight == 0.0
    bundle_dir = bundle_root_copy / "v1"
    weights = np.load(bundle_dir / TOKEN_SHORTLIST_WEIGHTS)
    bias = np.load(bundle_dir / TOKEN_SHORTLIST_BIAS)
    labels = np.load(bundle_dir / TOKEN_SHORTLIST)
    assert (weights < 0).any() and (weights > 0).any()  # signed: not shares
    for name, bad in [
        (TOKEN_SHORTLIST_WEIGHTS, np.where(weights != 0, np.nan, weights).astype(np.float32)),
        (TOKEN_SHORTLIST_WEIGHTS, weights[:, :1]),
        (TOKEN_SHORTLIST_WEIGHTS, np.where(labels < 0, 0.5, weights).astype(np.float32)),
        (TOKEN_SHORTLIST_WEIGHTS, weights.astype(np.float64)),
        (TOKEN_SHORTLIST_BIAS, bias[:-1]),
        (TOKEN_SHORTLIST_BIAS, np.where(bias == bias.max(), np.inf, bias).astype(np.float32)),
    ]:
        _write_table(bundle_dir, bad, name=name)
        with pytest.raises(BundleError, match=name):
            Predictor.load(bundle_dir)
        _write_table(bundle_dir, weights if name == TOKEN_SHORTLIST_WEIGHTS else bias, name=name)
    Predictor.load(bundle_dir)
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    manifest["scoring"]["lexical_weight"] = 0.3
    del manifest["files"][TOKEN_SHORTLIST_BIAS]
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="lexical_form 'logistic' needs token_shortlist_bias.npy"):
        Predictor.load(bundle_dir)
    del manifest["files"][TOKEN_SHORTLIST_WEIGHTS]
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="lexical_weight > 0 but token_shortlist_weights.npy is not listed"):
        Predictor.load(bundle_dir)
    # another form's file in a logistic bundle: refused, not silently ignored
    _write_table(bundle_dir, np.zeros(labels.shape, np.float32), name=TOKEN_SHORTLIST_SHARES)
    with pytest.raises(BundleError, match="token_shortlist_shares.npy is not a file of lexical_form 'logistic'"):
        Predictor.load(bundle_dir)
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    manifest["scoring"]["lexical_weight"] = -0.1
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="lexical_weight"):
        Predictor.load(bundle_dir)
    manifest["scoring"].update(lexical_weight=0.1, lexical_form="softmax")
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="lexical_form"):
        Predictor.load(bundle_dir)


def test_a_shares_bundle_still_loads_and_scores_its_shares(bundle_root_copy):
    """Bundles written before the logistic form: P(label | token) in [0, 1], no lexical_form field."""
    bundle_dir = bundle_root_copy / "v1"
    labels = np.load(bundle_dir / TOKEN_SHORTLIST)
    shares = np.where(labels >= 0, 0.5, 0.0).astype(np.float32)
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    for name in LEXICAL_FILES["logistic"]:
        del manifest["files"][name]
        (bundle_dir / name).unlink()
    del manifest["scoring"]["lexical_form"]
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    for bad in (shares * 0 + 1.5, shares - 0.75):
        _write_table(bundle_dir, bad.astype(np.float32), name=TOKEN_SHORTLIST_SHARES)
        with pytest.raises(BundleError, match="shares must be in"):
            Predictor(Bundle.open(bundle_dir))
    _write_table(bundle_dir, shares, name=TOKEN_SHORTLIST_SHARES)
    # The canaries were recorded with the logistic scores.
    bundle = Bundle.open(bundle_dir)
    assert bundle.manifest.scoring.lexical_form == bundle.token_table().form == "shares"
    predictor = Predictor(bundle, PredictorOptions(k_w=0, k_mu=0, k_head=0))
    text = bundle.labels.titles[4]
    tokens, weights = bundle.tokenizer.encode_batch([text])
    cands, lexical = predictor.sources(tokens, weights, predictor.encode([text]))
    k_tok = predictor.scoring.shortlist.k_tok
    dense = bundle.token_table().dense_scores(tokens, weights, bundle.manifest.num_labels, k_tok)
    np.testing.assert_allclose(lexical[0], dense[0, cands[0]], rtol=1e-6)
    assert (lexical > 0).all()  # every label of the rows has a share, and only those are listed


def test_head_joins_only_texts_whose_tokens_point_nowhere_by_default(bundle_root, bundle_root_copy):
    bundle = Predictor.load(bundle_root / "v1").bundle
    assert bundle.manifest.scoring.shortlist.head == "fallback"  # export's choice with a token table
    head = set(np.argsort(-np.asarray(bundle.classifier_bias), kind="stable")[:32].tolist())
    assert len(head) == bundle.manifest.scoring.shortlist.k_head == 32
    labels = bundle.token_table().labels
    k_tok = bundle.manifest.scoring.shortlist.k_tok
    fallback = Predictor(bundle, PredictorOptions(k_w=0, k_mu=0))
    always = Predictor(bundle, PredictorOptions(k_w=0, k_mu=0, head="always"))
    texts = [bundle.labels.titles[5], "zzqx unknown", bundle.labels.titles[11], ""]
    rows = {int(x) for t in bundle.tokenizer.encode(texts[0])[0] for x in labels[t, :k_tok] if x >= 0}
    assert rows and not head <= rows
    served = fallback.shortlist(texts)
    assert set(served[0].tolist()) == rows  # words with labels in their rows: no head
    assert set(always.shortlist(texts)[0].tolist()) == rows | head
    assert set(served[1].tolist()) == set(served[3].tolist()) == head  # no known word: the prior
    # alone and in a batch, the same
    for row, text in enumerate(texts):
        assert fallback.shortlist([text])[0].tolist() == served[row].tolist()
    ids, _ = fallback.predict_ids(["zzqx unknown"], k=40)
    assert set(ids[0][ids[0] >= 0].tolist()) == head
    # a manifest without the field (bundles written before it) keeps the head in every shortlist
    bundle_dir = bundle_root_copy / "v1"
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    del manifest["scoring"]["shortlist"]["head"]
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    assert Bundle.open(bundle_dir).manifest.scoring.shortlist.head == "always"
    manifest["scoring"]["shortlist"]["head"] = "sometimes"
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="head"):
        Bundle.open(bundle_dir)


@pytest.mark.parametrize("head", [0, 4])
def test_token_only_batches_equal_single_queries(bundle_root, head):
    bundle = Predictor.load(bundle_root / "v1").bundle
    predictor = Predictor(bundle, PredictorOptions(k_w=0, k_mu=0, k_head=head))
    texts = [bundle.labels.titles[1], "zzqx unknown", "", bundle.labels.titles[9] + " " + bundle.labels.titles[4]]
    batch_ids, batch_scores = predictor.predict_ids(texts, k=6)
    shortlists = predictor.shortlist(texts)
    for row, text in enumerate(texts):
        ids, scores = predictor.predict_ids([text], k=6)
        assert ids[0].tolist() == batch_ids[row].tolist()
        np.testing.assert_allclose(scores[0], batch_scores[row], atol=1e-6)
        (alone,) = predictor.shortlist([text])
        assert alone.tolist() == shortlists[row].tolist() == sorted(set(alone.tolist()))
    assert (batch_ids[1] >= 0).sum() == head  # an unknown text gets the head only
