"""bench/peers.py's own plumbing: shared features, top-k extraction, argument parsing, RESULTS.md sections.

The peer libraries themselves are an optional extra, so these tests stop at what every system
shares; the benchmark run is what exercises the libraries.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
from _common import latency_summary, replace_section  # bench/ is on pytest's pythonpath (pyproject)
from peers import (
    _csr_topk,
    _pad_ids,
    non_negative_int,
    paired_differences,
    parse_grid,
    parse_systems,
    render_markdown,
    texts_to_csr,
    without_own_label,
)

from service.engine.tokenizer import Tokenizer
from training.data import own_label_ids

# scipy comes with the bench extra (and training); the peers' features are scipy CSR.
sp = pytest.importorskip("scipy.sparse")


def test_features_match_the_tokenizer_with_sorted_zero_based_columns() -> None:
    texts = ["zeta alpha beta", "beta beta gamma", "nothing known here", "alpha"]
    tok = Tokenizer.fit(["alpha beta gamma zeta", "beta gamma", "gamma"])
    x = texts_to_csr(tok, texts, tok.vocab_size - 1)
    assert x.shape == (4, tok.vocab_size - 1)
    assert x.has_sorted_indices
    for row, text in enumerate(texts):
        ids, weights = tok.encode(text)
        expected = dict(zip((i - 1 for i in ids), weights, strict=True))
        lo, hi = x.indptr[row], x.indptr[row + 1]
        got = dict(zip(x.indices[lo:hi].tolist(), x.data[lo:hi].tolist(), strict=True))
        assert got.keys() == expected.keys()
        assert all(abs(got[j] - expected[j]) < 1e-6 for j in got)
    assert x[2].nnz == 0  # a text with no known token is an empty row, not an error


def test_csr_topk_orders_by_score_and_pads() -> None:
    scores = sp.csr_matrix(np.array([[0.1, 0.0, 0.9, 0.5], [0.0, 0.0, 0.0, 0.0], [0.0, 0.3, 0.0, 0.0]]))
    top = _csr_topk(scores, 3)
    assert top.tolist() == [[2, 3, 0], [-1, -1, -1], [1, -1, -1]]
    assert _pad_ids([[4, 5, 6, 7], []], 2).tolist() == [[4, 5], [-1, -1]]


def test_grid_and_systems_reject_bad_input_by_name() -> None:
    assert parse_grid("100:50:50:0, 10:0:0:10") == [(100, 50, 50, 0), (10, 0, 0, 10)]
    assert parse_grid("") == []
    with pytest.raises(argparse.ArgumentTypeError, match="'100:50:50'"):
        parse_grid("100:50:50")
    with pytest.raises(argparse.ArgumentTypeError, match="K_TOK > 0"):
        parse_grid("10:0:0:0")
    with pytest.raises(argparse.ArgumentTypeError, match="EF must be"):
        parse_grid("0:0:0:10")
    assert parse_systems("napkinxc,shortlist") == ["napkinxc", "shortlist"]
    with pytest.raises(argparse.ArgumentTypeError, match="parabel"):
        parse_systems("pecos,parabel")
    assert non_negative_int("0") == 0 and non_negative_int("1000") == 1000
    for bad in ("-1", "ten"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"'{bad}' is not an integer >= 0"):
            non_negative_int(bad)


def test_replace_section_keeps_the_other_sections(tmp_path: Path) -> None:
    md = tmp_path / "RESULTS.md"
    replace_section(md, "peers:a", "table A v1")
    replace_section(md, "peers:b", "table B")
    replace_section(md, "peers:a", "table A v2")
    text = md.read_text()
    assert "table A v2" in text and "table B" in text and "v1" not in text
    assert text.index("table A v2") < text.index("table B")


def test_latency_summary_percentiles_in_ms() -> None:
    summary = latency_summary([0.001] * 98 + [0.010, 0.020])
    assert summary["p50_ms"] == pytest.approx(1.0)
    assert summary["p99_ms"] > 9.0
    with pytest.raises(ValueError):
        latency_summary([])


def test_own_label_is_found_by_uid_and_removed_with_the_rest_moving_up() -> None:
    own = own_label_ids(["pkg-b", "doc-only", "pkg-a"], ["pkg-a", "pkg-b", "pkg-c"])
    assert own.tolist() == [1, -1, 0]
    preds = np.array([[3, 1, 4, 5], [1, 2, -1, -1], [2, 3, 5, 0]])
    np.testing.assert_array_equal(without_own_label(preds, own), [[3, 4, 5, -1], [1, 2, -1, -1], [2, 3, 5, -1]])


def test_shortlist_minus_each_peer_per_protocol_with_intervals(tmp_path: Path) -> None:
    truths = [[1], [2], [3], [4]] * 25
    own = np.array([2, -1, -1, -1] * 25)  # document 0 of each four is label 2, never its own target
    ours = np.array([[1, 9, 9, 9, 9, 9], [2, 9, 9, 9, 9, 9], [3, 9, 9, 9, 9, 9], [9, 9, 9, 9, 9, 9]] * 25)
    # the peer puts the own label first on document 0, then the right one
    peer = np.array([[2, 1, 9, 9, 9, 9], [2, 9, 9, 9, 9, 9], [3, 9, 9, 9, 9, 9], [4, 9, 9, 9, 9, 9]] * 25)
    rows = []
    for name, preds in (("omikuji", peer), ("shortlist", ours)):
        np.save(tmp_path / f"{name}.npy", preds)
        rows.append({"system": name, "title": name.title(), "preds": str(tmp_path / f"{name}.npy")})
    rows.append({"system": "napkinxc", "title": "napkinXC", "error": "not installed"})
    inv = np.ones(10)
    out = paired_differences(rows, truths, inv, own, resamples=100, seed=0)
    assert [(d["peer"], d["protocol"]) for d in out] == [("Omikuji", "plain"), ("Omikuji", "own label excluded")]
    plain, excluded = (d["diff"]["P@1"] for d in out)
    # plain: each is right on three documents of four, different ones: a tie whose interval holds 0
    assert plain[0] == pytest.approx(0.0) and plain[1] < 0 < plain[2]
    # with the own label out, the peer's document 0 is right too: Shortlist is 25 points behind
    assert excluded[0] == pytest.approx(-25.0) and excluded[2] < 0
    assert paired_differences(rows[:1], truths, inv, own, resamples=100, seed=0) == []
    assert paired_differences(rows, truths, inv, own, resamples=0, seed=0) == []
    context = {"dataset": "d", "text_field": "title", "command": "c", "date": "now", "commit": "x", "cpus": 2,
               "trn_docs": 1, "tst_docs": 100, "labels": 10, "features": 5, "latency_queries": 1, "warmup": 1,
               "batch_size": 1, "train_threads": 1, "paired": out, "resamples": 100}
    md = render_markdown([], [], context)
    assert "| Shortlist | Omikuji | own label excluded | -25.00 [" in md
    # The tree route is Shortlist's too: compared with the peers, not with the alpha route.
    np.save(tmp_path / "tree.npy", peer)
    tree_row = {"system": "shortlist-tree", "title": "Tree", "preds": str(tmp_path / "tree.npy")}
    both = paired_differences([*rows, tree_row], truths, inv, own, resamples=100, seed=0)
    assert [(d["system"], d["peer"]) for d in both] == [("Shortlist", "Omikuji")] * 2 + [("Tree", "Omikuji")] * 2
    assert both[3]["diff"]["P@1"][0] == pytest.approx(0.0)
