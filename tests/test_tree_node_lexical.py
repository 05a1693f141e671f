"""The fit of p_n's lexical node term (training/tree_node_lexical.py), whose step is compiled
(service/engine/_tree_native.cpp, node_lexical_step), against the step written out in plain
Python: rows per (document, node) weighted by their pairs left and right, the forced splits
skipped, every slot's gradient summed over the batch before its Adagrad update; and the step's
refusals of arrays that do not fit together."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.tree_lexical import NodeLexical
from service.engine.tree_native import node_lexical_step
from training.tree import LabelTree, flatten_pairs
from training.tree_node_lexical import FitArrays, NodeLexicalFit, new_state

NUM_LABELS, LR, L2 = 37, 0.5, 0.01


@pytest.fixture(scope="module")
def problem():
    """A fitted dense tree over 37 labels (64 leaves: forced splits above the padding) and
    documents of 1-4 labels with a few words each, padding between and after."""
    rng = np.random.default_rng(3)
    n = 150
    targets = [sorted(set(rng.integers(0, NUM_LABELS, int(rng.integers(1, 5))).tolist())) for _ in range(n)]
    targets[7] = []  # a document without labels: in no batch of the fit
    x = rng.normal(size=(n, 8)).astype(np.float32)
    tree = LabelTree(pca_dim=4, seed=0).fit(x, targets, NUM_LABELS)
    ids = rng.integers(1, 400, size=(n, 7))
    ids[:, 2] = ids[:, 0]  # a word twice in a document: two entries, one slot
    weights = rng.random((n, 7)).astype(np.float32)
    weights[:, 3] = 0.0
    weights[rng.random((n, 7)) < 0.2] = 0.0
    pair_doc, pair_label = flatten_pairs(targets, NUM_LABELS)
    return tree, tree.project(x), (ids, weights), pair_doc, pair_label


def reference_step(tree: LabelTree, table: np.ndarray, sum_sq: np.ndarray, z, tokens, pair_doc, pair_label,
                   docs, lr: float, l2: float) -> float:
    """The step in plain Python (float64 sums; sum_sq and the table in float32)."""
    lexical = NodeLexical(table)
    rows: dict[tuple[int, int], list[int]] = {}
    for d in docs:
        for y in pair_label[pair_doc == d]:
            for n, sign in zip(tree.path_nodes_[y], tree.path_signs_[y], strict=True):
                rows.setdefault((int(d), int(n)), [0, 0])[0 if sign > 0 else 1] += 1
    grad: dict[int, float] = {}
    loss = 0.0
    for (d, n), (left, right) in rows.items():
        if not np.isfinite(tree.bias_eff_[n]):
            continue
        kept = tokens[1][d] != 0
        offsets = lexical.token_offsets(tokens[0][d][kept])
        words = list(zip(lexical.slots(np.full(len(offsets), n), offsets).tolist(), tokens[1][d][kept].tolist(),
                         strict=True))
        s = float(tree.node_weights_[n].astype(np.float64) @ z[d].astype(np.float64)) + tree.bias_eff_[n]
        s += sum(float(table[slot]) * w for slot, w in words)
        loss += left * np.logaddexp(0.0, -s) + right * np.logaddexp(0.0, s)
        d_s = right / (1.0 + np.exp(-s)) - left / (1.0 + np.exp(s))
        for slot, w in words:
            v = float(table[slot])
            loss += l2 * (left + right) * v * v
            grad[slot] = grad.get(slot, 0.0) + d_s * w + 2.0 * l2 * (left + right) * v
    for slot, g in grad.items():
        sum_sq[slot] = np.float32(float(sum_sq[slot]) + g * g)
        table[slot] -= np.float32(lr * g / float(np.sqrt(sum_sq[slot]) + np.float32(1e-10)))
    return loss


def batches(problem, count: int, size: int, seed: int) -> list[np.ndarray]:
    with_pairs = np.unique(problem[3])
    rng = np.random.default_rng(seed)
    return [rng.choice(with_pairs, size, replace=False) for _ in range(count)]


@pytest.mark.parametrize("bits", [5, 12])  # 32 slots: most (node, word) pairs share one
def test_the_compiled_step_is_the_step_written_out(problem, bits):
    tree, z, tokens, pair_doc, pair_label = problem
    state = new_state(bits)
    arrays = FitArrays.of(tree, NodeLexical(state[:, 0]), z, tokens, pair_doc, pair_label)
    table, sum_sq = np.zeros(1 << bits, np.float32), np.zeros(1 << bits, np.float32)
    assert np.isinf(tree.bias_eff_).any()  # forced splits are on some rows' paths
    for docs in batches(problem, 6, 40, seed=bits):
        want = reference_step(tree, table, sum_sq, z, tokens, pair_doc, pair_label, docs, LR, L2)
        got = arrays.step(docs, state, LR, L2)
        assert got == pytest.approx(want, rel=1e-9)
        np.testing.assert_allclose(state[:, 0], table, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(state[:, 1], sum_sq, rtol=1e-5, atol=1e-9)
        assert not state[:, 2:].any() and not arrays.node_counts.any()  # the scratch is left zero between steps
    assert np.count_nonzero(table) > (1 << bits) // 8


def test_the_fit_is_deterministic_and_learns_from_zero(problem):
    tree, z, tokens, pair_doc, pair_label = problem
    fits = [NodeLexicalFit(bits=10, epochs=3, batch_docs=32, seed=4).fit(tree, z, tokens, pair_doc, pair_label)
            for _ in range(2)]
    np.testing.assert_array_equal(fits[0].table_, fits[1].table_)
    assert fits[0].table_.dtype == np.float16 and fits[0].table_.any()
    assert fits[0].losses_[-1] < fits[0].losses_[0]
    assert fits[0].steps_ == 3 * -(-len(np.unique(pair_doc)) // 32)
    untrained = NodeLexicalFit(bits=10, epochs=0).fit(tree, z, tokens, pair_doc, pair_label)
    assert not untrained.table_.any() and untrained.steps_ == 0


def corrupt(arrays: FitArrays, name: str, change) -> FitArrays:
    fields = {k: np.array(v, copy=True) for k, v in vars(arrays).items()}
    change(fields[name])
    return FitArrays(**fields)


@pytest.mark.parametrize(("name", "change"), [
    ("pair_label", lambda a: a.__setitem__(5, NUM_LABELS)),
    ("pair_label", lambda a: a.__setitem__(-1, -1)),
    ("path_nodes", lambda a: a.__setitem__((3, 2), 1 << 20)),
    ("doc_start", lambda a: a.__setitem__(slice(40, None), a[40:] + len(a))),
    ("word_start", lambda a: a.__setitem__(-1, a[-1] + 1)),
])
def test_an_index_out_of_range_is_refused_and_changes_nothing(problem, name, change):
    tree, z, tokens, pair_doc, pair_label = problem
    state = new_state(8)
    arrays = FitArrays.of(tree, NodeLexical(state[:, 0]), z, tokens, pair_doc, pair_label)
    every = np.unique(pair_doc)
    arrays.step(every[:20], state, LR, L2)
    before = state.copy()
    corrupted = corrupt(arrays, name, change)
    with pytest.raises(ValueError, match="outside its array"):
        corrupted.step(every, state, LR, L2)
    np.testing.assert_array_equal(state, before)
    assert not corrupted.node_counts.any()
    for doc in (-1, len(z)):
        with pytest.raises(ValueError, match="outside its array"):
            arrays.step(np.array([every[0], doc]), state, LR, L2)
    np.testing.assert_array_equal(state, before)
    assert not arrays.node_counts.any()
    arrays.step(every[20:40], state, LR, L2)  # and the fit goes on
    assert not state[:, 2:].any() and not arrays.node_counts.any()


def test_arrays_that_do_not_fit_together_are_refused(problem):
    tree, z, tokens, pair_doc, pair_label = problem
    state = new_state(6)
    a = FitArrays.of(tree, NodeLexical(state[:, 0]), z, tokens, pair_doc, pair_label)
    dim, depth = a.z.shape[1], a.path_nodes.shape[1]
    docs = np.unique(pair_doc)[:4]

    def step(**change):
        args = {**vars(a), "docs": docs, "state": state, "dim": dim, "depth": depth}
        args.update(change)
        return node_lexical_step(args["docs"], args["doc_start"], args["pair_label"], args["path_nodes"],
                                 args["path_signs"], args["node_weights"], args["bias"], args["z"],
                                 args["word_start"], args["word_offsets"], args["word_weights"], args["state"],
                                 args["node_counts"], args["dim"], args["depth"], LR, L2)

    assert np.isfinite(step())
    refusals = [
        ({"state": new_state(6)[:48]}, "state"), ({"state": np.zeros((64, 3), np.float32)}, "state"),
        ({"state": np.zeros((1, 4), np.float32)}, "state"),
        ({"z": a.z[:-1]}, "z"), ({"dim": dim + 1}, "z|node weights"), ({"node_weights": a.node_weights[:-1]},
                                                                       "node weights"),
        ({"word_start": a.word_start[:-1]}, "word_start"), ({"word_weights": a.word_weights[:-1]}, "words"),
        ({"path_signs": a.path_signs[:-1]}, "paths"), ({"depth": depth + 1}, "paths"), ({"depth": 41}, "bad sizes"),
        ({"dim": 0}, "bad sizes"), ({"docs": docs.astype(np.int32)[:3]}, "8-byte"),
        ({"node_counts": a.node_counts[:-1]}, "node counts"),
    ]
    for change, message in refusals:
        with pytest.raises(ValueError, match=message):
            step(**change)
    with pytest.raises(TypeError):
        step(state=np.zeros((64, 4), np.float32)[::2])  # not contiguous: no buffer to write
