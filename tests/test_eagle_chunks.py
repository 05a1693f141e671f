"""EAGLE scores (group, label, member) in chunks: the same imputation, memory bounded by the chunk
rather than by the groups' sizes times their labels (audit 5 B11: groups of 500 took 6-7 GB)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import scipy.sparse as sp

from training import data as xc_data
from training import eagle_space
from training.aggregate_data import aggregate
from training.aggregated import member_probability, tfidf_spaces
from training.config import TrainConfig
from training.eagle import SCORE_CHUNK, EagleImputer, carrier_posteriors
from training.grouped import load_grouped
from training.synthetic import generate


@pytest.fixture(scope="module")
def grouped_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Per grouping, (TF-IDF rows, label texts, members, group labels): 400 documents in groups of 20
    and 800 in groups of 200 (each group carrying most of the 100 labels)."""
    root = tmp_path_factory.mktemp("eagle_chunks")
    out = {}
    for name, docs, size, grouping in (("random20", 400, 20, "random"), ("clustered20", 400, 20, "clustered"),
                                       ("random200", 800, 200, "random")):
        generate(root / f"data{docs}", num_labels=100, train_docs=docs, test_docs=10, seed=5)
        labels = xc_data.load_labels(root / f"data{docs}")
        aggregate(root / f"data{docs}", root / name, size, grouping, seed=1)
        grouped = load_grouped(root / name, "title", len(labels))
        x, z = tfidf_spaces(grouped.texts, labels.texts, TrainConfig())
        out[name] = (x, z, grouped.members(), grouped.group_labels(len(labels)))
    return out


def _result(imputer: EagleImputer) -> tuple:
    v = imputer.label_vectors_
    vectors = v if isinstance(v, np.ndarray) else (v.sparse.toarray(), v.coef)
    return (imputer.impute(), imputer.impute_weights(), vectors, imputer.iterations_, imputer.validation_scores_,
            imputer.keep_ratio_scores_)


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(_same(p, q) for p, q in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("grouping", ["random20", "clustered20"])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("assignment", [dict(assignment="closest"),
                                        dict(assignment="expected", center=True, validation=0.3),
                                        dict(assignment="relative", center=True, validation=0.3)])
def test_scoring_in_small_chunks_imputes_exactly_what_one_chunk_does(grouped_data, grouping, dense,
                                                                     assignment) -> None:
    x, z, members, group_labels = grouped_data[grouping]
    if dense:
        x, z = x.toarray(), z.toarray()
    whole = _result(EagleImputer(iterations=3, **assignment).fit(x, members, group_labels, z))
    assert sum(map(len, whole[0])) > 0
    # 150 entries: runs of 7 pairs of 20 members, a pair's members' tokens (~7 a member) in two runs,
    # a held-out group's members scored against the 100 labels one member at a time.
    chunked = _result(EagleImputer(iterations=3, chunk=150, **assignment).fit(x, members, group_labels, z))
    assert _same(whole, chunked)


def test_memory_is_bounded_by_the_chunk_not_by_group_size_times_labels(grouped_data, monkeypatch) -> None:
    # 4 groups of 200 members, each carrying most of the 100 labels: ~64,000 (pair, member)
    # entries of ~7 tokens each, scored token by token (BLOCK_FILL past any run's fill) or, by
    # default, as one product of the run's members and labels (a few bytes an entry).
    x, z, members, group_labels = grouped_data["random200"]
    peaks, results, product = {}, {}, eagle_space.BLOCK_FILL
    for fill in (product, 1e9):
        monkeypatch.setattr(eagle_space, "BLOCK_FILL", fill)
        for chunk in (SCORE_CHUNK, 4096):
            imputer = EagleImputer(iterations=2, center=True, validation=0.5, assignment="closest", chunk=chunk)
            tracemalloc.start()
            try:
                results[fill, chunk] = imputer.fit(x, members, group_labels, z).impute()
                peaks[fill, chunk] = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    assert all(r == results[1e9, 4096] for r in results.values())
    assert peaks[1e9, 4096] * 4 < peaks[1e9, SCORE_CHUNK], peaks
    assert peaks[product, 4096] * 2 < peaks[product, SCORE_CHUNK] < peaks[1e9, SCORE_CHUNK] / 2, peaks


def test_posteriors_in_chunks_are_the_same_bits_in_bounded_memory(grouped_data) -> None:
    """carrier_posteriors of a model's probabilities (the second round's labels) for chunks of 1
    entry (a pair at a time), 150, and all at once: the same matrix bit for bit; 4 groups of 200
    members carrying most of 100 labels (~64,000 entries) scored 4,096 at a time peak under half of
    all at once (which held ~70 bytes an entry beside the result's 8)."""
    _, _, members, group_labels = grouped_data["random200"]
    rng = np.random.default_rng(3)
    emb = rng.standard_normal((members.shape[1], 16)).astype(np.float32)
    weights, bias = rng.standard_normal((group_labels.shape[1], 16)).astype(np.float32), np.zeros(100, np.float32)
    probability = member_probability(emb, weights, bias)
    out, peaks = {}, {}
    for chunk in (SCORE_CHUNK, 4096, 150, 1):
        tracemalloc.start()
        try:
            out[chunk] = carrier_posteriors(members, group_labels, probability, chunk=chunk)
            peaks[chunk] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    whole = out[SCORE_CHUNK]
    assert whole.nnz > 60_000 and whole.dtype == np.float32
    for m in out.values():
        assert _same((m.indptr, m.indices, m.data), (whole.indptr, whole.indices, whole.data))
    assert peaks[4096] * 2 < peaks[SCORE_CHUNK], peaks


def test_a_chunk_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        EagleImputer(chunk=0)
    imputer = EagleImputer(iterations=0, assignment="closest", chunk=1).fit(
        np.eye(2, dtype=np.float32), sp.csr_matrix(np.ones((1, 2))), sp.csr_matrix(np.ones((1, 1))))
    assert imputer.impute() == [[0], []]


def _unsorted(m: sp.csr_matrix, rng: np.random.Generator) -> sp.csr_matrix:
    """m with each row's entries in a shuffled order, as sums of sparse rows can leave them."""
    m = sp.csr_matrix(m, copy=True)
    for i in range(m.shape[0]):
        row = slice(m.indptr[i], m.indptr[i + 1])
        order = rng.permutation(row.stop - row.start)
        m.indices[row], m.data[row] = m.indices[row][order], m.data[row][order]
    m.has_sorted_indices = False
    return m


def test_a_run_scored_by_one_product_or_token_by_token_gives_the_same_exact_dots(monkeypatch) -> None:
    """sparse_row_dots scores a run of (document, label) entries by one sparse product of its
    documents and labels when they fill it (a large group with its labels), else token by token:
    the same float64 bits either way and for any chunk, and neither input is changed (v's rows
    out of order are sorted in a copy)."""
    rng = np.random.default_rng(3)
    x = sp.random(60, 40, density=0.2, random_state=1, format="csr", dtype=np.float32)
    v = _unsorted(sp.random(15, 40, density=0.5, random_state=2, format="csr", dtype=np.float32), rng)
    docs, labels = rng.integers(0, 60, 500), rng.integers(0, 15, 500)
    given = [a.copy() for a in (x.indices, x.data, v.indices, v.data)]
    exact = np.einsum("ij,ij->i", x.toarray().astype(np.float64)[docs], v.toarray().astype(np.float64)[labels])
    results = []
    monkeypatch.setattr(eagle_space, "SPLIT_MIN", 1)  # runs may be halved down to single entries
    # every run one product where the chunk allows it / runs halved until their parts are 90% full /
    # no product
    for fill in (1e-9, 0.9, 1e9):
        monkeypatch.setattr(eagle_space, "BLOCK_FILL", fill)
        results += [eagle_space.sparse_row_dots(x, docs, v, labels, chunk) for chunk in (1, 40, 10**6)]
    assert all(np.array_equal(r, results[0]) for r in results)
    np.testing.assert_allclose(results[0], exact, rtol=1e-12)
    assert all(np.array_equal(a, b) for a, b in zip(given, (x.indices, x.data, v.indices, v.data), strict=True))


def test_a_group_label_goes_to_the_first_of_its_closest_members_when_they_tie() -> None:
    x = sp.csr_matrix(np.array([[1, 0], [0, 1], [0, 1]], np.float32))  # members 1 and 2 alike
    members, group_labels = sp.csr_matrix(np.ones((1, 3))), sp.csr_matrix(np.ones((1, 1)))
    imputer = EagleImputer(iterations=2, assignment="closest").fit(x, members, group_labels)
    assert imputer.impute() == [[], [0], []]
