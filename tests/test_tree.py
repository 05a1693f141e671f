"""The adversarial tree scorer: p_n's tree, its sampling, the engine's beam search, the classifier."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine import vectors
from service.engine.metrics import ranking_metrics
from service.engine.tree import TreeScorer, _subtree_has_label
from training.config import TrainConfig
from training.tree import LabelTree, pair_weights, sample_targets
from training.tree_config import DEFAULT_CONFIG
from training.tree_lexical import TokenRows
from training.tree_train import AdversarialTree, TreeClassifier

# The tree route on embeddings alone, from zero (no tokens, no Module III to start from).
DENSE = {"lexical": False, "start": "zero", "node_lexical": False}


def clustered_data(
    num_labels: int, num_docs: int, dim: int, noise: float, seed: int
) -> tuple[np.ndarray, list[list[int]], np.ndarray]:
    """Documents near the sum of their labels' random prototypes; a skewed label prior."""
    rng = np.random.default_rng(seed)
    protos = rng.normal(size=(num_labels, dim))
    prior = 1.0 / np.arange(1, num_labels + 1) ** 0.7
    prior = rng.permutation(prior / prior.sum())
    targets: list[list[int]] = []
    x = np.empty((num_docs, dim), dtype=np.float32)
    for i in range(num_docs):
        labels = sorted(set(rng.choice(num_labels, size=int(rng.integers(1, 4)), p=prior).tolist()))
        v = protos[labels].sum(0) + noise * rng.normal(size=dim)
        x[i] = v / np.linalg.norm(v)
        targets.append(labels)
    return x, targets, protos


def split(x: np.ndarray, targets: list[list[int]], n_train: int):
    return x[:n_train], targets[:n_train], x[n_train:], targets[n_train:]


@pytest.fixture(scope="module")
def small_tree() -> tuple[LabelTree, np.ndarray]:
    # 11 labels -> 16 leaves: 5 padding leaves, forced splits at the bottom.
    x, targets, _ = clustered_data(11, 400, 8, 0.5, seed=1)
    return LabelTree(pca_dim=4, seed=0).fit(x, targets, 11), x


@pytest.fixture(scope="module")
def scorer_and_data():
    x, targets, _ = clustered_data(60, 2400, 16, 0.8, seed=2)
    xtr, ttr, xte, tte = split(x, targets, 2000)
    arrays = AdversarialTree({"pca_dim": 8, "epochs": 8, "beam": 16, **DENSE}, seed=0).fit(xtr, ttr, 60).arrays_
    scorer = TreeScorer.from_arrays(arrays)
    return scorer, arrays, xte, tte


def test_tree_is_balanced_and_every_label_reachable(small_tree):
    tree, x = small_tree
    leaves = tree.leaf_labels_
    assert len(leaves) == 16
    assert sorted(leaves[leaves >= 0].tolist()) == list(range(11))
    # Balanced: at every level the two children of a node hold label counts differing by <= 1.
    real = (leaves >= 0).astype(int)
    for size in (1, 2, 4, 8):
        counts = real.reshape(-1, size).sum(1)
        assert np.all(np.abs(counts[0::2] - counts[1::2]) <= 1)
    logp = TreeScorer.from_arrays(
        {**tree.arrays(), "classifier_weights": np.zeros((11, 8), np.float32),
         "classifier_bias": np.zeros(11, np.float32)}
    ).log_pn(x[:50])
    assert np.isfinite(logp).all()  # every real label has p_n > 0


def test_log_pn_sums_to_one_and_padding_has_zero_mass(small_tree):
    tree, x = small_tree
    scorer = TreeScorer.from_arrays(
        {**tree.arrays(), "classifier_weights": np.zeros((11, 8), np.float32),
         "classifier_bias": np.zeros(11, np.float32)}
    )
    logp = scorer.log_pn(x[:100])
    np.testing.assert_allclose(np.exp(logp).sum(1), 1.0, atol=1e-6)
    # The training-side path log-prob agrees with the engine's level-wise computation.
    z = tree.project(x[:100])
    labels = np.tile(np.arange(11), (100, 1))
    np.testing.assert_allclose(tree.log_prob(z, labels), logp, atol=1e-5)
    # Taken in blocks of a few rows (how a 10^6-label training bounds its memory), the same values.
    np.testing.assert_array_equal(tree.log_prob(z, labels, block_bytes=1), tree.log_prob(z, labels))
    np.testing.assert_array_equal(tree.log_prob(z, labels, block_bytes=5000), tree.log_prob(z, labels))


def test_ancestral_samples_follow_pn(small_tree):
    from scipy.stats import chisquare

    tree, x = small_tree
    rng = np.random.default_rng(0)
    z = tree.project(x[:1])
    n = 40_000
    labels, logp = tree.sample(z, n, rng)
    assert labels.min() >= 0  # never a padding leaf
    expected = np.exp(tree.log_prob(z, np.arange(11)[None, :]))[0] * n
    observed = np.bincount(labels[0], minlength=11)
    assert chisquare(observed, expected).pvalue > 1e-3
    # The returned log-probs are those of the sampled labels.
    np.testing.assert_allclose(logp[0, :20], tree.log_prob(z, labels[:, :20])[0], atol=1e-6)
    # The test has power: the same samples are rejected against the p_n of a different input.
    all_p = np.exp(tree.log_prob(tree.project(x), np.tile(np.arange(11), (len(x), 1))))
    far = int(np.abs(all_p - expected / n).sum(1).argmax())
    assert np.abs(all_p[far] - expected / n).sum() > 0.2
    assert chisquare(observed, all_p[far] * n).pvalue < 1e-6


def numpy_samples(tree: LabelTree, z: np.ndarray, num_samples: int, rng: np.random.Generator, tokens
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Ancestral sampling written out level by level in numpy (as training sampled before the
    compiled sampler), each level's uniforms drawn for every sample at once."""
    nodes = np.zeros((len(z), num_samples), np.int64)
    logp = np.zeros((len(z), num_samples))
    for _ in range(tree.depth_):
        s = np.einsum("bsk,bk->bs", tree.node_weights_[nodes].astype(np.float64), z) + tree.bias_eff_[nodes]
        if tree.node_lexical_ is not None:
            table = tree.node_lexical_.table.astype(np.float64)
            offsets = tree.node_lexical_.token_offsets(tokens[0])[:, None, :]
            s = s + (table[tree.node_lexical_.slots(nodes[:, :, None], offsets)] * tokens[1][:, None, :]).sum(-1)
        left_logp, right_logp = -np.logaddexp(0.0, -s), -np.logaddexp(0.0, s)
        left = np.log(rng.random(nodes.shape)) < left_logp
        logp += np.where(left, left_logp, right_logp)
        nodes = 2 * nodes + np.where(left, 1, 2)
    return tree.leaf_labels_[nodes - (len(tree.leaf_labels_) - 1)], logp


@pytest.mark.parametrize("lexical", [False, True])
def test_the_compiled_sampler_draws_what_the_numpy_one_drew(lexical):
    """The same draws, the same labels, on a tree of 100 labels (128 leaves: forced splits above
    the padding) with 300 samples a document: more distinct nodes a level than the sampler shares
    logits between (32)."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(500, 8)).astype(np.float32)
    targets = [rng.choice(100, size=int(rng.integers(1, 4)), replace=False).tolist() for _ in range(500)]
    tree = LabelTree(pca_dim=4, seed=0).fit(x, targets, 100)
    ids = rng.integers(1, 300, size=(6, 5))
    weights = rng.random((6, 5)).astype(np.float32)
    weights[:, 4] = 0.0  # padding
    if lexical:
        tree.set_node_lexical(rng.normal(0.0, 0.5, 1 << 12).astype(np.float16))
    z = tree.project(x[:6])
    labels, logp = tree.sample(z, 300, np.random.default_rng(9), tokens=(ids, weights))
    want_labels, want_logp = numpy_samples(tree, z.astype(np.float64), 300, np.random.default_rng(9), (ids, weights))
    assert np.isinf(tree.bias_eff_).any() and labels.min() >= 0
    np.testing.assert_array_equal(labels, want_labels)
    np.testing.assert_allclose(logp, want_logp, rtol=1e-12)
    assert max(len(np.unique(row)) for row in labels) > 32


def test_the_compiled_sampler_refuses_draws_of_another_shape(small_tree):
    from service.engine.tree import sample_leaves

    tree, x = small_tree
    z = tree.project(x[:3])
    for shape, message in [((tree.depth_ - 1, 3, 4), "log_draws: expected"), ((tree.depth_, 2, 4), "z: expected")]:
        with pytest.raises(ValueError, match=message):
            sample_leaves(tree.node_weights_, tree.bias_eff_, None, tree.depth_, z, None, np.full(shape, 0.5))


def test_beam_equal_to_num_labels_is_exact(scorer_and_data):
    scorer, _, xte, _ = scorer_and_data
    exact = scorer.exact_scores(xte)
    ids, scores = scorer.search(xte, k=10, beam=60)
    best = -np.sort(-exact, axis=1)[:, :10]
    np.testing.assert_allclose(scores, best, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.take_along_axis(exact, ids, 1), scores, rtol=1e-5, atol=1e-4)


def test_classifier_learns_and_bias_correction_ranks_well(scorer_and_data):
    scorer, _, xte, tte = scorer_and_data
    ids, _ = scorer.search(xte, k=5)
    p1 = ranking_metrics(ids, tte, ks=(1,))["P@1"]
    chance = 100.0 * np.mean([len(t) for t in tte]) / 60
    assert p1 > 5 * chance and p1 > 50.0
    # xi + log p_n beats log p_n alone: the classifier adds information.
    logpn_top = np.argsort(-scorer.log_pn(xte), axis=1)[:, :5]
    assert p1 >= ranking_metrics(logpn_top, tte, ks=(1,))["P@1"]


def test_search_pads_and_never_returns_padding(scorer_and_data):
    scorer, _, xte, _ = scorer_and_data
    ids, scores = scorer.search(xte[:3], k=100, beam=4)
    assert ids.shape == (3, 100) and scores.shape == (3, 100)
    assert ids.dtype == np.int64 and scores.dtype == np.float32
    # beam 4 but k 100: the beam widens to k, at most 60 real labels exist.
    assert ((ids >= 0).sum(1) == 60).all()
    assert (ids[:, 60:] == -1).all() and np.isneginf(scores[:, 60:]).all()
    assert np.all(np.diff(scores[:, :60], axis=1) <= 0)


def test_bad_arrays_and_inputs_are_named(scorer_and_data):
    scorer, arrays, xte, _ = scorer_and_data
    scorer.validate(60, 16)
    with pytest.raises(ValueError, match="classifier_weights"):
        scorer.validate(61, 16)
    with pytest.raises(ValueError, match="pca_mean"):
        scorer.validate(60, 32)
    with pytest.raises(ValueError, match="missing node_bias"):
        TreeScorer.from_arrays({k: v for k, v in arrays.items() if k != "node_bias"})
    bad = dict(arrays, leaf_labels=np.where(arrays["leaf_labels"] == 3, 4, arrays["leaf_labels"]))
    with pytest.raises(ValueError, match="leaf_labels"):
        TreeScorer.from_arrays(bad)
    with pytest.raises(ValueError, match="node_weights"):
        TreeScorer.from_arrays(dict(arrays, node_weights=arrays["node_weights"][:, :3]))
    nan = arrays["classifier_bias"].copy()
    nan[0] = np.nan
    with pytest.raises(ValueError, match="classifier_bias"):
        TreeScorer.from_arrays(dict(arrays, classifier_bias=nan))
    with pytest.raises(ValueError, match="queries"):
        scorer.search(xte[:, :5], k=3)
    with pytest.raises(ValueError, match="beam"):
        scorer.search(xte[:2], k=3, beam=0)
    with pytest.raises(ValueError, match="unknown tree config keys: pca"):
        AdversarialTree({"pca": 3})


def test_int8_classifier_rows_score_as_their_values_and_need_valid_scales(scorer_and_data):
    """A bundle of vector_dtype int8 stores the tree's classifier rows as int8 with row scales
    (service.engine.vectors): the search ranks by the values they stand for."""
    scorer, arrays, xte, _ = scorer_and_data
    values, scales = vectors.quantize(arrays["classifier_weights"], "int8")
    small = TreeScorer.from_arrays(dict(arrays, classifier_weights=values, classifier_scales=scales))
    served = TreeScorer.from_arrays(dict(arrays, classifier_weights=vectors.dequantize(values, scales)))
    ids_8, scores_8 = small.search(xte, k=5)
    ids_f, scores_f = served.search(xte, k=5)
    np.testing.assert_array_equal(ids_8, ids_f)
    np.testing.assert_allclose(scores_8, scores_f, rtol=1e-5, atol=1e-5)
    assert set(small.to_arrays()) == set(arrays) | {"classifier_scales"}
    for bad, message in ((dict(arrays, classifier_weights=values), "missing for int8"),
                         (dict(arrays, classifier_scales=scales), "given for float"),
                         (dict(arrays, classifier_weights=values, classifier_scales=-scales - 1), "finite and >= 0"),
                         (dict(arrays, classifier_weights=values, classifier_scales=scales[:-1]), r"float32 \[60\]")):
        with pytest.raises(ValueError, match=f"classifier_scales: .*{message}"):
            TreeScorer.from_arrays(bad)


def test_fit_is_deterministic_given_seed():
    x, targets, _ = clustered_data(20, 300, 8, 0.8, seed=3)
    a = AdversarialTree({"pca_dim": 4, "epochs": 2, **DENSE}, seed=5).fit(x, targets, 20).arrays_
    b = AdversarialTree({"pca_dim": 4, "epochs": 2, **DENSE}, seed=5).fit(x, targets, 20).arrays_
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_soft_labels_train_each_pair_with_its_weights_probability():
    x, targets, _ = clustered_data(20, 300, 8, 0.8, seed=3)
    cfg = {"pca_dim": 4, "epochs": 2, **DENSE}
    hard = AdversarialTree(cfg, seed=5).fit(x, targets, 20).arrays_
    ones = AdversarialTree(cfg, seed=5).fit(x, targets, 20, target_weights=[[1.0] * len(t) for t in targets]).arrays_
    for name in hard:
        np.testing.assert_array_equal(ones[name], hard[name], err_msg=name)
    # A pair's weight is its target's (a repeated target's largest); p_n fits one draw of them.
    np.testing.assert_array_equal(pair_weights([[2, 0, 2], [1]], [[0.3, 1.0, 0.6], [0.5]], 3), [1.0, 0.6, 0.5])
    with pytest.raises(ValueError, match="one weight per target"):
        pair_weights([[2, 0]], [[0.3]], 3)
    drawn = sample_targets([[0, 1]] * 1000, [[1.0, 0.5]] * 1000, seed=0)
    assert all(t[0] == 0 for t in drawn) and 400 < sum(len(t) - 1 for t in drawn) < 600
    assert drawn == sample_targets([[0, 1]] * 1000, [[1.0, 0.5]] * 1000, seed=0)
    tree = LabelTree(pca_dim=4).fit(x, targets, 20)
    pairs = sum(map(len, targets))
    quarter = TreeClassifier(epochs=1, batch_size=1, negatives=2, seed=0).fit(
        x, targets, 20, tree, target_weights=[[0.25] * len(t) for t in targets])
    assert abs(quarter.fit_stats_["steps"] - pairs / 4) < 4 * np.sqrt(pairs * 0.25 * 0.75)
    # A label imputed at a weight near 0 is (nearly) never trained as its documents' positive.
    label = int(np.bincount([t for ts in targets for t in ts]).argmax())
    weights = [[1e-9 if t == label else 1.0 for t in ts] for ts in targets]
    holders = [i for i, ts in enumerate(targets) if label in ts]
    xi = {}
    for name, w in (("hard", None), ("near 0", weights)):
        clf = TreeClassifier(epochs=2, negatives=4, sampler="uniform", seed=0).fit(x, targets, 20, None,
                                                                                   target_weights=w)
        xi[name] = float((x[holders] @ clf.weights_[label] + clf.bias_[label]).mean())
    assert xi["near 0"] < 0 < xi["hard"]  # uniform negatives: xi is log p(y|x) + log L + const


def test_the_progress_callback_sees_the_start_every_few_steps_and_the_end():
    """A curve of P@1 against training time (bench/tree.py's convergence) begins at the start,
    before the first step: with a good start a sampler may be best there."""
    x, targets, _ = clustered_data(20, 300, 8, 0.8, seed=3)
    calls: list[tuple[float, int, float]] = []

    def record(elapsed: float, step: int, arrays: dict[str, np.ndarray]) -> None:
        calls.append((elapsed, step, float(np.abs(arrays["classifier_weights"]).sum())))

    clf = TreeClassifier(epochs=2, batch_size=64, negatives=4, sampler="uniform", seed=0).fit(
        x, targets, 20, None, callback=record, callback_every=3)
    steps = [step for _, step, _ in calls]
    assert steps[0] == 0 and calls[0][0] == 0.0 and calls[0][2] == 0.0  # the zero start, untrained
    assert steps[1:-1] == list(range(3, clf.fit_stats_["steps"] + 1, 3)) and steps[-1] == clf.fit_stats_["steps"]
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:], strict=False))


def one_vs_all_inputs(num_labels: int = 20, dim: int = 8, seed: int = 4):
    """Documents, their labels, Module III-like (w, b) and unit label centroids of the same labels."""
    x, targets, protos = clustered_data(num_labels, 300, dim, 0.8, seed=seed)
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(num_labels, dim)).astype(np.float32)
    b = rng.normal(size=num_labels).astype(np.float32)
    mu = (protos / np.linalg.norm(protos, axis=1, keepdims=True)).astype(np.float32)
    return x, targets, (w, b), mu


def test_xi_starts_at_the_classifiers_plus_the_weighted_label_centroids():
    """start_centroids = gamma: xi's dense part starts at (w_l + gamma mu_l) . q + b_l (no epochs:
    the start is what is exported); gamma 0 keeps Module III's w_l alone."""
    x, targets, module3, mu = one_vs_all_inputs()
    cfg = {"pca_dim": 4, "epochs": 0, **DENSE, "start": "one_vs_all"}
    for gamma in (0.0, 2.5):
        arrays = AdversarialTree({**cfg, "start_centroids": gamma}, seed=0).fit(
            x, targets, 20, module3=module3, centroids=mu).arrays_
        np.testing.assert_allclose(arrays["classifier_weights"], module3[0] + gamma * mu, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(arrays["classifier_bias"], module3[1], rtol=1e-5, atol=1e-5)

    # Trained, xi moves away from that start (the start is where training begins, not its answer).
    trained = AdversarialTree({**cfg, "epochs": 2, "start_centroids": 2.5}, seed=0).fit(
        x, targets, 20, module3=module3, centroids=mu).arrays_
    assert not np.allclose(trained["classifier_weights"], module3[0] + 2.5 * mu, atol=1e-3)


def test_a_centroid_start_needs_centroids_of_the_classifiers_shape():
    x, targets, module3, mu = one_vs_all_inputs()
    tree = AdversarialTree({"pca_dim": 4, "epochs": 0, **DENSE, "start": "one_vs_all", "start_centroids": 1.0})
    with pytest.raises(ValueError, match="start_centroids > 0 needs the label centroids"):
        tree.fit(x, targets, 20, module3=module3)
    with pytest.raises(ValueError, match=r"label centroids \(20, 7\) do not match the classifiers \(20, 8\)"):
        tree.fit(x, targets, 20, module3=module3, centroids=mu[:, :7])


def test_the_level_fit_in_blocks_of_nodes_and_rows_fits_the_same_tree(monkeypatch):
    """How a 10^6-label tree bounds its memory: each level's Newton step a block of nodes at a
    time and its scores a block of rows at a time (blocks of 3 nodes and 7 rows here), the
    same splits and the same labels at the same leaves."""
    import training.tree as tree_module

    x, targets, _ = clustered_data(40, 600, 8, 0.5, seed=3)
    whole = LabelTree(pca_dim=4, seed=0).fit(x, targets, 40)
    monkeypatch.setattr(tree_module, "_NODES_AT_ONCE", 3)
    monkeypatch.setattr(tree_module, "_ROWS_AT_ONCE", 7)
    blocks = LabelTree(pca_dim=4, seed=0).fit(x, targets, 40)
    assert whole.rounds_per_level_ == blocks.rounds_per_level_
    np.testing.assert_array_equal(whole.leaf_labels_, blocks.leaf_labels_)
    np.testing.assert_allclose(whole.node_weights_, blocks.node_weights_, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(whole.node_bias_, blocks.node_bias_, rtol=1e-6, atol=1e-7)


def test_weight_decay_shrinks_the_rows_xi_reads_and_zero_leaves_them_as_trained():
    x, targets, _ = clustered_data(8, 300, 8, 0.3, seed=4)
    tree = LabelTree(pca_dim=4).fit(x, targets, 8)
    norms = {decay: np.linalg.norm(TreeClassifier(epochs=2, negatives=4, weight_decay=decay, seed=0)
                                   .fit(x, targets, 8, tree).weights_, axis=1).mean()
             for decay in (0.0, 1.0)}
    assert norms[1.0] < 0.8 * norms[0.0]


def test_negatives_that_are_positives_are_masked():
    # Two labels always together: the tree proposes the sibling positive often; it is masked.
    x, targets, _ = clustered_data(8, 300, 8, 0.3, seed=4)
    targets = [sorted(set(t) | {0, 1}) for t in targets]
    tree = LabelTree(pca_dim=4).fit(x, targets, 8)
    clf = TreeClassifier(epochs=1, negatives=4).fit(x, targets, 8, tree)
    assert clf.fit_stats_["masked_negative_fraction"] > 0.05
    with pytest.raises(ValueError, match="sampler"):
        TreeClassifier(sampler="random").fit(x, targets, 8, tree)


def lexical_data(seed: int) -> tuple[np.ndarray, list[list[int]], TokenRows, np.ndarray, list[list[int]], tuple]:
    """Documents whose embeddings say nothing (pure noise) and whose one informative token names
    their label: only xi's lexical part can learn it. Token t (1..8) means label t - 1; token 9
    is on every document."""
    rng = np.random.default_rng(seed)
    n, labels = 1200, 8
    y = rng.integers(0, labels, n)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ids = np.stack([y + 1, np.full(n, 9)], axis=1).astype(np.int64)
    w = np.tile(np.array([[0.8, 0.6]], np.float32), (n, 1))
    targets = [[int(v)] for v in y]
    tokens = TokenRows(ids[:1000], w[:1000], None, 10)
    return x[:1000], targets[:1000], tokens, x[1000:], targets[1000:], (ids[1000:], w[1000:])


def test_lexical_part_learns_what_the_embedding_cannot_and_the_engine_scores_it():
    x, targets, tokens, xte, tte, tte_tokens = lexical_data(seed=5)
    cfg = {"pca_dim": 4, "epochs": 4, "beam": 8, "lexical": True, "start": "zero", "lexical_width": 8,
           "node_lexical": False}
    arrays = AdversarialTree(cfg, seed=0).fit(x, targets, 8, tokens=tokens).arrays_
    assert arrays["lexical_labels"].dtype == np.int32 and arrays["lexical_indptr"].shape == (11,)
    scorer = TreeScorer.from_arrays(arrays)
    ids, scores = scorer.search(xte, k=3, tokens=tte_tokens)
    assert ranking_metrics(ids, tte, ks=(1,))["P@1"] > 95.0
    # The beam over every label finds the exact top k of xi + log p_n, the lexical term included.
    exact = scorer.exact_scores(xte, tte_tokens)
    np.testing.assert_allclose(scores, -np.sort(-exact, axis=1)[:, :3], rtol=1e-5, atol=1e-4)
    dense = TreeScorer.from_arrays({k: v for k, v in arrays.items() if not k.startswith("lexical")})
    no_lexical = ranking_metrics(dense.search(xte, k=3)[0], tte, ks=(1,))["P@1"]
    assert no_lexical < 40.0  # chance is 12.5: the embedding alone knows nothing here
    with pytest.raises(ValueError, match="tokens"):
        scorer.search(xte, k=3)


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: a.update(lexical_labels=np.where(a["lexical_labels"] == 0, 8, a["lexical_labels"])),
     "lexical_labels: label ids must be in"),
    (lambda a: a.update(lexical_labels=a["lexical_labels"][::-1].copy()), "strictly ascending"),
    (lambda a: a["lexical_indptr"].__setitem__(-1, a["lexical_indptr"][-1] + 1), "lexical_labels, lexical_weights"),
    (lambda a: a["lexical_indptr"].__setitem__(3, 10**6), "lexical_indptr"),
    (lambda a: a["lexical_weights"].__setitem__(0, np.inf), "lexical_weights: contains NaN"),
    (lambda a: a.pop("lexical_weights"), "lexical_indptr without lexical_weights"),
    (lambda a: a.update(lexical_bias=a["lexical_bias"][:-1]), "lexical_bias: expected \\[8\\]"),
])
def test_bad_lexical_rows_are_named(change, message):
    x, targets, tokens, *_ = lexical_data(seed=6)
    cfg = {"pca_dim": 4, "epochs": 1, "lexical": True, "start": "zero", "lexical_width": 8, "node_lexical": False}
    arrays = AdversarialTree(cfg, seed=0).fit(x, targets, 8, tokens=tokens).arrays_
    TreeScorer.from_arrays(arrays).validate(8, 8, vocab_size=10)
    with pytest.raises(ValueError, match="lexical_indptr: rows for 10 token ids"):
        TreeScorer.from_arrays(arrays).validate(8, 8, vocab_size=11)
    bad = {k: np.array(v, copy=True) for k, v in arrays.items()}
    change(bad)
    with pytest.raises(ValueError, match=message):
        TreeScorer.from_arrays(bad)


def node_lexical_data(seed: int, n: int = 1600, labels: int = 32):
    """Embeddings of pure noise; token t (1..labels) names label t - 1, token labels + 1 is on every
    document: only a lexical term in p_n's nodes lets a narrow beam reach the true label."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, labels, n)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    # Padded as the tokenizer pads: a third of the documents carry the shared token only after a gap.
    ids = np.stack([y + 1, np.full(n, labels + 1), np.zeros(n, np.int64)], axis=1).astype(np.int64)
    w = np.tile(np.array([[0.8, 0.6, 0.0]], np.float32), (n, 1))
    targets = [[int(v)] for v in y]
    cut = n * 3 // 4
    tokens = TokenRows(ids[:cut], w[:cut], None, labels + 2)
    return x[:cut], targets[:cut], tokens, x[cut:], targets[cut:], (ids[cut:], w[cut:])


NODE_LEXICAL = {"pca_dim": 4, "epochs": 2, "beam": 2, "lexical": False, "start": "zero", "node_lexical_bits": 12,
                "node_lexical_epochs": 20, "node_lexical_batch": 64}


@pytest.fixture(scope="module")
def node_lexical_model():
    x, targets, tokens, xte, tte, tte_tokens = node_lexical_data(seed=7)
    arrays = AdversarialTree(NODE_LEXICAL, seed=0).fit(x, targets, 32, tokens=tokens).arrays_
    return arrays, xte, tte, tte_tokens


def test_the_lexical_node_term_leads_a_narrow_beam_to_the_label_the_words_name(node_lexical_model):
    arrays, xte, tte, tte_tokens = node_lexical_model
    assert arrays["node_lexical"].dtype == np.float16 and arrays["node_lexical"].shape == (1 << 12,)
    scorer = TreeScorer.from_arrays(arrays)
    ids, _ = scorer.search(xte, k=1, tokens=tte_tokens)  # beam 2 over 32 labels
    assert ranking_metrics(ids, tte, ks=(1,))["P@1"] > 90.0
    dense = TreeScorer.from_arrays({k: v for k, v in arrays.items() if k != "node_lexical"})
    assert ranking_metrics(dense.search(xte, k=1)[0], tte, ks=(1,))["P@1"] < 30.0  # chance is 3
    with pytest.raises(ValueError, match="tokens"):
        scorer.search(xte, k=1)


def test_training_and_the_engine_score_the_lexical_node_term_alike(node_lexical_model, monkeypatch):
    """p_n as training samples from and scores it (LabelTree) is the p_n the engine searches:
    the same hash and the same logits, padding columns or not."""
    arrays, xte, _, (ids, w) = node_lexical_model
    tree = LabelTree()
    tree.pca_mean_, tree.pca_components_ = arrays["pca_mean"], arrays["pca_components"]
    tree.node_weights_, tree.node_bias_, tree.leaf_labels_ = arrays["node_weights"], arrays["node_bias"], \
        arrays["leaf_labels"]
    tree._finish()
    tree.set_node_lexical(arrays["node_lexical"])
    scorer = TreeScorer.from_arrays(arrays)
    every = np.tile(np.arange(32), (len(xte), 1))
    trained = tree.log_prob(tree.project(xte), every, tokens=(ids, w))
    exact_log_pn = scorer.log_pn(xte, (ids, w))
    np.testing.assert_allclose(trained, exact_log_pn, atol=1e-4)
    np.testing.assert_allclose(trained, tree.log_prob(tree.project(xte), every, (ids[:, :2], w[:, :2])), atol=1e-9)
    # Ancestral sampling reads each document's words as (row, token) pairs, one node a row: the
    # log-probs of what it draws are log_prob's, document by document.
    labels, logp = tree.sample(tree.project(xte[:50]), 4, np.random.default_rng(0), tokens=(ids[:50], w[:50]))
    np.testing.assert_allclose(logp, np.take_along_axis(trained[:50], labels, 1), atol=1e-6)
    with pytest.raises(ValueError, match="tokens"):
        tree.sample(tree.project(xte[:50]), 4, np.random.default_rng(0))
    import service.engine.tree as engine_tree

    monkeypatch.setattr(engine_tree, "_LOG_PN_BLOCK", 100)  # rows one by one: the same log p_n
    np.testing.assert_array_equal(scorer.log_pn(xte, (ids, w)), exact_log_pn)
    # A beam over every leaf is exact, the node term included.
    full = TreeScorer.from_arrays({**arrays, "default_beam": np.asarray(32)})
    _, scores = full.search(xte, k=3, tokens=(ids, w))
    np.testing.assert_allclose(scores, -np.sort(-full.exact_scores(xte, (ids, w)), axis=1)[:, :3], atol=1e-4)


@pytest.mark.parametrize(("table", "message"), [
    (np.zeros(3, np.float16), "power-of-two length"),
    (np.zeros(1, np.float16), "power-of-two length"),
    (np.zeros((4, 4), np.float16), "power-of-two length"),
    (np.array([0, 0, np.nan, 0], np.float16), "node_lexical: contains NaN"),
    (np.array([0, np.inf], np.float16), "node_lexical: contains NaN"),
])
def test_a_bad_lexical_node_table_is_named(node_lexical_model, table, message):
    arrays = dict(node_lexical_model[0])
    TreeScorer.from_arrays({**arrays, "node_lexical": np.zeros(2, np.float16)})  # the smallest table
    with pytest.raises(ValueError, match=message):
        TreeScorer.from_arrays({**arrays, "node_lexical": table})


def test_the_lexical_node_term_needs_the_documents_tokens():
    x, targets, *_ = node_lexical_data(seed=8, n=200)
    with pytest.raises(ValueError, match="node_lexical needs the documents' tokens"):
        AdversarialTree({**NODE_LEXICAL}, seed=0).fit(x, targets, 32)


def test_the_positives_log_pn_in_chunks_trains_the_same_classifier(monkeypatch):
    """xi's training takes its positives' log p_n in chunks (a 10^6-label training's pairs would
    copy gigabytes of tokens at once): chunk boundaries must not change what it learns (the
    "corrected" regulariser reads the positives' log p_n)."""
    import training.tree_train as tree_train

    x, targets, tokens, *_ = node_lexical_data(seed=7)
    cfg = {**NODE_LEXICAL, "regularise": "corrected", "node_lexical_epochs": 2}
    whole = AdversarialTree(cfg, seed=0).fit(x, targets, 32, tokens=tokens).arrays_
    monkeypatch.setattr(tree_train, "_POSITIVES_AT_ONCE", 7)
    chunked = AdversarialTree(cfg, seed=0).fit(x, targets, 32, tokens=tokens).arrays_
    for name, array in whole.items():
        np.testing.assert_array_equal(chunked[name], array, err_msg=name)


# Every numeric tree setting at its edge: (key, the last value accepted, the first refused).
TREE_SETTING_EDGES = [
    ("pca_dim", 1, 0), ("newton_steps", 1, 0), ("max_rounds", 1, 0), ("node_lexical_bits", 1, 0),
    ("node_lexical_bits", 32, 33), ("node_lexical_epochs", 0, -1), ("node_lexical_max_steps", 0, -1),
    ("node_lexical_batch", 1, 0), ("negatives", 1, 0), ("lexical_width", 1, 0), ("lexical_epochs", 0, -1),
    ("lexical_max_steps", 1, 0), ("epochs", 0, -1), ("batch_size", 1, 0), ("beam", 1, 0),
    ("lambda_n", 1e-9, 0.0), ("node_lexical_lr", 1e-9, 0.0), ("lexical_lr", 1e-9, 0.0), ("lr", 1e-9, 0.0),
    ("node_lexical_l2", 0.0, -1e-9), ("lambda", 0.0, -1e-9), ("weight_decay", 0.0, -1e-9),
    ("start_centroids", 0.0, -1e-9), ("lexical_tol", 0.0, -1e-9), ("lexical_l2", 0.0, -1e-9),
]


def test_every_numeric_tree_setting_has_a_tested_range():
    numeric = {key for key, value in DEFAULT_CONFIG.items() if type(value) in (int, float)}
    assert numeric == {key for key, *_ in TREE_SETTING_EDGES}


@pytest.mark.parametrize(("key", "accepted", "refused"), TREE_SETTING_EDGES)
def test_tree_settings_are_checked_at_and_past_their_edges_before_any_training(key, accepted, refused):
    assert AdversarialTree({key: accepted}).config[key] == accepted
    assert TrainConfig.from_dict({"tree": {key: accepted}}).tree == {key: accepted}
    past = [refused] + ([float("inf"), float("nan")] if isinstance(DEFAULT_CONFIG[key], float) else [])
    for value in past:
        with pytest.raises(ValueError, match=f"'tree.{key}' must be an? (integer|finite number)"):
            AdversarialTree({key: value})
        with pytest.raises(ValueError, match=f"'tree.{key}' must be"):
            TrainConfig.from_dict({"tree": {key: value}})


@pytest.mark.parametrize("key", sorted(DEFAULT_CONFIG))
def test_a_tree_setting_of_another_json_kind_is_refused_naming_it(key):
    """"128" is not a beam and true is not 1: never coerced, as the training config's own settings."""
    default = DEFAULT_CONFIG[key]
    wrong = {bool: [1, "true"], int: ["1", True, 1.5], float: ["1", True, None], str: [1, ["xi"]]}[type(default)]
    for value in wrong:
        with pytest.raises(ValueError, match=f"training config 'tree.{key}' must be "):
            TrainConfig.from_dict({"tree": {key: value}})
    if isinstance(default, int) and not isinstance(default, bool):
        assert AdversarialTree({key: float(default)}).config[key] == default  # 128.0 is the integer 128


def test_tree_choices_and_the_projection_width_are_checked():
    for key, good, bad in (("regularise", "corrected", "ridge"), ("start", "zero", "warm")):
        assert AdversarialTree({key: good}).config[key] == good
        with pytest.raises(ValueError, match=f"'tree.{key}' must be one of"):
            TrainConfig.from_dict({"tree": {key: bad}})
    assert TrainConfig.from_dict({"dim": 8, "tree": {"pca_dim": 8}}).tree["pca_dim"] == 8
    with pytest.raises(ValueError, match=r"'tree.pca_dim' must be <= dim \(8\), got 9"):
        TrainConfig.from_dict({"dim": 8, "tree": {"pca_dim": 9}})
    with pytest.raises(ValueError, match="'tree' must be an object"):
        TrainConfig.from_dict({"tree": [1]})


@pytest.mark.parametrize("edges", ["smallest", "untrained"])
def test_the_tree_trains_and_answers_at_its_settings_accepted_edges(edges):
    """The accepted edges are usable, not only accepted: the smallest sizes, rates and penalties
    (lambda_n 1e-9 leaves p_n's Newton steps almost unregularised), or nothing trained."""
    x, targets, tokens, xte, _, tte_tokens = node_lexical_data(seed=9, n=240)
    rng = np.random.default_rng(0)
    module3 = rng.normal(size=(32, 8)).astype(np.float32), rng.normal(size=32).astype(np.float32)
    mu = rng.normal(size=(32, 8)).astype(np.float32)
    if edges == "smallest":
        cfg = {key: accepted for key, accepted, _ in TREE_SETTING_EDGES if key != "node_lexical_bits"}
        cfg.update(node_lexical_bits=1, node_lexical_epochs=1, lexical_epochs=1, epochs=1, node_lexical_max_steps=50)
    else:
        cfg = {"node_lexical_epochs": 0, "node_lexical_max_steps": 0, "lexical_epochs": 0, "epochs": 0}
    arrays = AdversarialTree({**cfg, "pca_dim": min(cfg.get("pca_dim", 4), 4)}, seed=0).fit(
        x, targets, 32, tokens=tokens, module3=module3, centroids=mu).arrays_
    labels, scores = TreeScorer.from_arrays(arrays).search(xte, k=3, tokens=tte_tokens)
    assert ((labels >= 0) & (labels < 32)).all() and np.isfinite(scores).all()


def test_default_beam_is_bounded_at_and_past_the_edge(scorer_and_data):
    from service.engine.tree import MAX_BEAM

    _, arrays, _, _ = scorer_and_data
    TreeScorer.from_arrays(dict(arrays, default_beam=np.asarray(MAX_BEAM))).validate(60, 16)
    with pytest.raises(ValueError, match=rf"default_beam: must be in \[1, {MAX_BEAM}\], got {MAX_BEAM + 1}"):
        TreeScorer.from_arrays(dict(arrays, default_beam=np.asarray(MAX_BEAM + 1))).validate(60, 16)


def _live_node_by_node(leaf_labels: np.ndarray, retired: np.ndarray) -> np.ndarray:
    """The reference: does each heap node's subtree hold a label not retired, one node at a time."""
    n = len(leaf_labels)
    has = np.zeros(2 * n - 1, dtype=bool)
    has[n - 1 :] = (leaf_labels >= 0) & ~retired[np.maximum(leaf_labels, 0)]
    for i in range(n - 2, -1, -1):
        has[i] = has[2 * i + 1] | has[2 * i + 2]
    return has


def test_live_nodes_made_a_level_at_a_time_match_the_tree_node_by_node():
    rng = np.random.default_rng(0)
    for num_labels, num_leaves in ((1, 2), (2, 2), (11, 16), (60, 64), (300, 512)):
        leaf_labels = np.full(num_leaves, -1, dtype=np.int64)
        leaf_labels[rng.choice(num_leaves, num_labels, replace=False)] = rng.permutation(num_labels)
        for share in (0.0, 0.5, 0.97, 1.0):
            retired = rng.random(num_labels + 3) < share  # labels added since training: past the tree's
            np.testing.assert_array_equal(_subtree_has_label(leaf_labels, retired),
                                          _live_node_by_node(leaf_labels, retired))
        np.testing.assert_array_equal(_subtree_has_label(leaf_labels),
                                      _live_node_by_node(leaf_labels, np.zeros(num_labels, bool)))


def test_a_tree_with_no_retired_label_searches_exactly_as_before(scorer_and_data):
    scorer, _, xte, _ = scorer_and_data
    assert scorer.live_nodes(None) is None
    # Only labels added since training (past the tree's 60) retired: nothing in the tree to skip.
    assert scorer.live_nodes(np.r_[np.zeros(60, bool), np.ones(5, bool)]) is None
    # The mask's code path with every node live gives the same answers, bit for bit.
    every = _subtree_has_label(scorer.leaf_labels)
    for beam in (1, 4, 16, 60):
        want = scorer.search(xte, k=5, beam=beam)
        got = scorer.search(xte, k=5, beam=beam, live=every)
        for a, b in zip(want, got, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_the_beam_holds_live_labels_wherever_the_tree_has_them(scorer_and_data):
    scorer, _, xte, _ = scorer_and_data
    rng = np.random.default_rng(3)
    retired = np.ones(60, dtype=bool)
    alive = rng.choice(60, 7, replace=False)
    retired[alive] = False
    live = scorer.live_nodes(retired)
    for beam in (1, 4, 16):
        ids, scores = scorer.search(xte, k=5, beam=beam, live=live)
        # 53 of 60 retired: a beam of 4 still holds only live leaves, so every row has 5 live labels.
        assert (ids >= 0).all() and np.isin(ids, alive).all(), beam
        assert np.isfinite(scores).all()
    ids, _ = scorer.search(xte, k=10, beam=1, live=live)
    assert ((ids >= 0).sum(1) == 7).all() and np.isin(ids[ids >= 0], alive).all()
    # A live label keeps its own score (p_n is not renormalised over the live labels): at a beam
    # of every label, the search is the exact top k of the live labels' xi + log p_n.
    exact = np.where(retired, -np.inf, scorer.exact_scores(xte))
    ids, scores = scorer.search(xte, k=5, beam=60, live=live)
    np.testing.assert_allclose(scores, -np.sort(-exact, axis=1)[:, :5], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.take_along_axis(exact, ids, 1), scores, rtol=1e-5, atol=1e-4)
    # Every label of the tree retired: nothing to answer.
    none = scorer.live_nodes(np.ones(60, dtype=bool))
    assert not none.any()
    ids, _ = scorer.search(xte, k=5, live=none)
    assert (ids == -1).all()
