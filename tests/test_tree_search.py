"""The tree route's compiled search (service/engine/_tree_native.cpp) against what it stands for:
the beam search written out level by level in plain numpy (random trees with padding, forced
splits, float16 and float32 node-lexical tables, retired subtrees, batches and threads), and
xi's lexical term against its dense form."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from service.engine import _tree_native
from service.engine.tree import TreeScorer, log_sigmoid
from service.engine.tree_lexical import LexicalRows

DIM, PCA = 12, 5


def random_tree(num_labels: int, num_leaves: int, table: str | None, seed: int) -> TreeScorer:
    """A tree of random splits; padding leaves anywhere (forced splits above label-less subtrees)."""
    rng = np.random.default_rng(seed)
    leaf_labels = np.full(num_leaves, -1, dtype=np.int64)
    leaf_labels[rng.choice(num_leaves, num_labels, replace=False)] = rng.permutation(num_labels)
    arrays = {
        "pca_mean": rng.normal(size=DIM).astype(np.float32),
        "pca_components": rng.normal(size=(PCA, DIM)).astype(np.float32),
        "node_weights": rng.normal(size=(num_leaves - 1, PCA)).astype(np.float32),
        "node_bias": rng.normal(size=num_leaves - 1).astype(np.float32),
        "leaf_labels": leaf_labels,
        "classifier_weights": rng.normal(size=(num_labels, DIM)).astype(np.float32),
        "classifier_bias": rng.normal(size=num_labels).astype(np.float32),
    }
    if table is not None:
        values = rng.normal(size=1 << 10)
        values[:8] = [0.0, -0.0, 6e-8, -6e-8, 1e-5, 65504.0, -65504.0, 3.0]  # float16 zeros, subnormals, extremes
        arrays["node_lexical"] = values.astype(table)
    return TreeScorer.from_arrays(arrays)


def queries(n: int, seed: int, tokens: int = 6) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(n, DIM)).astype(np.float32)
    ids = rng.integers(0, 5000, size=(n, tokens))
    weights = rng.random((n, tokens)).astype(np.float32)
    weights[:, -2:] = 0.0  # padding
    return q, (ids, weights)


def reference_beam(scorer: TreeScorer, q: np.ndarray, beam: int, tokens, live) -> list[dict[int, float]]:
    """Each row's leaves {heap node: path log-prob}: keep the `beam` best children of the kept
    nodes, level by level, a node outside `live` at -inf."""
    z = scorer._project(q).astype(np.float64)
    internal = scorer.num_leaves - 1
    logits = z @ scorer.node_weights.T.astype(np.float64) + scorer._node_bias_eff
    if scorer.node_lexical is not None:
        lexical = scorer.node_lexical
        slots = lexical.slots(np.arange(internal)[None, :, None], lexical.token_offsets(tokens[0])[:, None, :])
        values = lexical.table[slots].astype(np.float32).astype(np.float64)
        logits += (values * tokens[1][:, None, :].astype(np.float64)).sum(-1)
    rows = []
    for row in range(len(q)):
        kept = [(0.0, 0)]
        for _ in range(scorer.depth):
            children = []
            for logp, node in kept:
                for child, sign in ((2 * node + 1, 1.0), (2 * node + 2, -1.0)):
                    value = logp + float(log_sigmoid(np.float64(sign * logits[row, node])))
                    children.append((-np.inf if live is not None and not live[child] else value, child))
            kept = sorted(children, key=lambda c: -c[0])[:beam]
        rows.append({node: logp for logp, node in kept})
    return rows


def assert_same_leaves(scorer: TreeScorer, got: tuple[np.ndarray, np.ndarray], want: list[dict[int, float]]) -> None:
    labels, logp = got
    first_leaf = scorer.num_leaves - 1
    for row, expected in enumerate(want):
        finite = {node: v for node, v in expected.items() if np.isfinite(v)}
        kept = np.isfinite(logp[row])
        assert sorted(scorer.leaf_labels[np.array(sorted(finite), dtype=np.int64) - first_leaf].tolist()) == \
            sorted(labels[row][kept].tolist()), row
        by_label = dict(zip(labels[row][kept].tolist(), logp[row][kept].tolist(), strict=True))
        for node, value in finite.items():
            assert by_label[int(scorer.leaf_labels[node - first_leaf])] == pytest.approx(value, rel=1e-9, abs=1e-12)
        assert (labels[row][~kept] == -1).all()


@pytest.mark.parametrize("table", [None, "float16", "float32"])
@pytest.mark.parametrize("num_labels, num_leaves", [(1, 2), (2, 2), (11, 16), (37, 64), (300, 512)])
def test_the_beam_keeps_the_best_children_level_by_level(table, num_labels, num_leaves):
    scorer = random_tree(num_labels, num_leaves, table, seed=num_leaves)
    q, tokens = queries(4, seed=num_labels)
    for beam in sorted({1, 2, 3, 7, 16, num_leaves, 2 * num_leaves}):
        got = scorer.beam_leaves(q, beam, tokens)
        assert got[0].shape == got[1].shape == (4, min(beam, num_leaves))
        assert_same_leaves(scorer, got, reference_beam(scorer, q, beam, tokens, None))


@pytest.mark.parametrize("share", [0.3, 0.9])
def test_a_retired_subtree_is_never_entered(share):
    scorer = random_tree(300, 512, "float16", seed=5)
    rng = np.random.default_rng(6)
    live = scorer.live_nodes(rng.random(300) < share)
    q, tokens = queries(4, seed=7)
    for beam in (1, 4, 32):
        got = scorer.beam_leaves(q, beam, tokens, live)
        assert_same_leaves(scorer, got, reference_beam(scorer, q, beam, tokens, live))
        assert not np.isin(got[0][np.isfinite(got[1])], np.flatnonzero(~_live_labels(scorer, live))).any()


def _live_labels(scorer: TreeScorer, live: np.ndarray) -> np.ndarray:
    out = np.zeros(scorer.num_labels, dtype=bool)
    real = scorer.leaf_labels >= 0
    out[scorer.leaf_labels[real]] = live[scorer.num_leaves - 1 :][real]
    return out


def test_a_batch_answers_each_row_as_alone_and_threads_as_serially():
    scorer = random_tree(300, 512, "float16", seed=8)
    q, (ids, weights) = queries(16, seed=9)
    batch = scorer.beam_leaves(q, 16, (ids, weights))
    for row in range(len(q)):
        alone = scorer.beam_leaves(q[row : row + 1], 16, (ids[row : row + 1], weights[row : row + 1]))
        order, alone_order = np.argsort(batch[0][row]), np.argsort(alone[0][0])
        assert np.array_equal(batch[0][row][order], alone[0][0][alone_order])
        # Close, not equal: the projection's float32 product is BLAS's, whose kernels differ by shape.
        np.testing.assert_allclose(batch[1][row][order], alone[1][0][alone_order], rtol=1e-5)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: scorer.beam_leaves(q, 16, (ids, weights)), range(16)))
    for labels, logp in answers:
        assert np.array_equal(labels, batch[0]) and np.array_equal(logp, batch[1])  # bit for bit


def _call(z=None, weights=None, table=None, kind=2, live=None, out=None, depth=3, beam=4, batch=1, dim=2):
    """The kernel with consistent buffers for a depth-3 tree of dim 2, one argument changed."""
    internal = 7
    z = np.zeros((batch, dim)) if z is None else z
    weights = np.zeros((internal, dim), np.float32) if weights is None else weights
    table = np.zeros(16, np.uint16) if table is None else table
    nodes = np.empty((batch, beam), np.int64) if out is None else out
    _tree_native.beam_search(z, weights, np.zeros(internal), table, np.zeros(1 << 16, np.float32),
                             np.zeros((batch, 1), np.int64), np.ones((batch, 1), np.float32),
                             np.zeros(0, np.uint8) if live is None else live, nodes, np.empty((batch, beam)),
                             batch, dim, 1, depth, beam, kind)
    return nodes


def test_the_kernel_refuses_buffers_that_disagree_with_the_sizes_it_is_given():
    leaves = _call().ravel()  # the valid call: 4 of the 8 leaves (heap nodes 7..14), all alike here
    assert len(set(leaves.tolist())) == 4 and ((leaves >= 7) & (leaves <= 14)).all()
    refused = {
        "z:": {"z": np.zeros((1, 3))},
        "node weights:": {"weights": np.zeros((6, 2), np.float32)},
        "table:": {"table": np.zeros(12, np.uint16)},
        "half_value|table:": {"kind": 3},
        "live:": {"live": np.ones(14, np.uint8)},
        "outputs:": {"out": np.empty((1, 3), np.int64)},
        "bad sizes": {"depth": 41},
    }
    for message, change in refused.items():
        with pytest.raises(ValueError, match=message):
            _call(**change)
    with pytest.raises(ValueError, match="bad sizes"):
        _call(beam=0)
    with pytest.raises(ValueError, match="node weights:"):  # depth 40 passes its own check
        _call(depth=40)
    assert _call(live=np.ones(15, np.uint8)).shape == (1, 4)  # every node of the tree: enough
    assert _call(table=np.zeros(0, np.uint16), kind=0).shape == (1, 4)  # no table: kind 0
    with pytest.raises(ValueError, match="contiguous"):
        _call(z=np.zeros((1, 4))[:, ::2])


def random_rows(vocab: int, num_labels: int, seed: int) -> LexicalRows:
    """U with rows of 0..6 ascending labels (some tokens with none) and a bias per label."""
    rng = np.random.default_rng(seed)
    rows = [np.sort(rng.choice(num_labels, int(rng.integers(0, 7)), replace=False)) for _ in range(vocab)]
    indptr = np.r_[0, np.cumsum([len(r) for r in rows])].astype(np.int64)
    labels = np.concatenate(rows).astype(np.int32) if indptr[-1] else np.zeros(0, np.int32)
    return LexicalRows(indptr, labels, rng.normal(size=len(labels)).astype(np.float32),
                       rng.normal(size=num_labels).astype(np.float32), num_labels)


@pytest.mark.parametrize("vocab, num_labels", [(1, 3), (40, 25), (300, 1000)])
def test_the_lexical_term_of_candidates_is_its_dense_form_at_them(vocab, num_labels):
    rows = random_rows(vocab, num_labels, seed=vocab)
    rng = np.random.default_rng(1)
    ids = rng.integers(-2, vocab + 3, size=(6, 9))  # padding 0, ids past the vocabulary and below 0
    ids[0, :4] = ids[0, 4]  # one token four times: each occurrence counts
    x = rng.random((6, 9)).astype(np.float32)
    x[1] = 0.0  # tokens with weight 0 still reach their rows' labels (their h)
    candidates = rng.integers(0, num_labels, size=(6, 40))
    got = rows.scores((ids, x), candidates)
    want = np.take_along_axis(rows.dense((ids, x)), candidates, 1)
    assert got.shape == candidates.shape and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert rows.scores((ids[:, :0], x[:, :0]), candidates).tolist() == np.zeros(candidates.shape).tolist()


def test_the_lexical_kernel_refuses_rows_and_arrays_that_disagree():
    rows = random_rows(40, 25, seed=2)
    ids, x = np.ones((2, 3), np.int64), np.ones((2, 3), np.float32)
    candidates, out = np.zeros((2, 4), np.int64), np.empty((2, 4))

    def call(indptr=rows.indptr, labels=rows.labels, tokens=3, count=4):
        _tree_native.lexical_scores(indptr, labels, rows.weights, rows.bias, ids, x, candidates, out, 2, tokens, count)

    call()
    outside = rows.indptr.copy()
    outside[1] = outside[-1] + 5  # token 1's run past the end (ids are all 1)
    for message, change in {"rows: indptr": {"labels": rows.labels[:-1]}, "tokens:": {"tokens": 2},
                            "candidates, out:": {"count": 5}, "bad sizes": {"indptr": np.zeros(0, np.int64)},
                            "rows: a token's run": {"indptr": outside}}.items():
        with pytest.raises(ValueError, match=message):
            call(**change)
