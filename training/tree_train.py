"""The bias-corrected classifier of adversarial negative sampling (Bamler & Mandt, ICLR 2020).

xi_y(x) = v_y . E(x) + c_y is trained as a binary classifier between the data's positive
pairs (x, y) and negatives y' drawn from the auxiliary tree p_n(.|x) (training/tree.py),
plus a quadratic regulariser R on every scored pair (the positive and its negatives):

    loss(x, y) = -log sigma(xi_y(x)) - sum_{y' ~ p_n(.|x)} log sigma(-xi_y'(x))
                 + lambda * [R(x, y) + sum_{y'} R(x, y')]
    R = (xi + log p_n)^2   regularise="corrected" (the issue's Eq. 6 form)
    R = xi^2               regularise="xi" (the default: pulls xi towards 0, i.e. the corrected
                           score towards log p_n, where the data says little)

At the optimum xi_y(x) = log p(y|x) - log p_n(y|x) + const, so prediction ranks by
xi_y(x) + log p_n(y|x) (service.engine.tree.TreeScorer).

Why "xi" is the default: negatives from p_n rarely hit a label where p_n gives it little
mass, so nothing stops its xi from growing there. The corrected form makes it worse: on a
positive pair with log p_n(y|x) = -15 it pulls xi_y towards +15, and v_y, c_y carry that to
every other document. Measured on 500 validation documents carved from debian-deps trn (lambda
0.01, 8 negatives, 1 epoch; log p_n alone: P@1 36.8, P@5 15.0): "xi" P@1 40.0, P@5 16.8;
"corrected" P@1 37.4, P@5 17.5. A small sample and a split verdict: the choice is P@1-driven.

Multi-label data: every (x, y) positive pair is one sample. A negative y' drawn for x that is
itself a positive of x (any of x's labels, not only y) is masked out of the loss: calling a
true label negative would teach the opposite of the data, and the tree, which mimics the
data, proposes x's other labels often. The masked draw is not replaced (replacing it would
need rejection sampling with unbounded cost); the mask rate is reported in fit_stats_.

Soft labels (aggregated data's imputed labels, training/aggregated.py, a weight in (0, 1] each):
each epoch trains on a pair with its weight's probability, so a pair imputed at 0.2 is a fifth
of a sample, as Module III and the centroids weigh it; p_n is fitted on one such draw; a soft
pair is still never anyone's negative.

The same trainer with sampler="uniform" (negatives uniform over labels, log p_n = -log L) is
the baseline of bench/tree.py.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from training.divergence import check_fitted
from training.progress import Progress
from training.tree import LabelTree, flatten_pairs, pair_weights, sample_targets
from training.tree_config import resolve_config
from training.tree_lexical import LexicalPart, LexicalStart, TokenRows, lexical_start
from training.tree_node_lexical import NodeLexicalFit

TREE_FILE = "tree.npz"
log = logging.getLogger("shortlist.training")

# Positive pairs whose log p_n is computed at once (_Run).
_POSITIVES_AT_ONCE = 1 << 18

# Called with (seconds of training so far, step, xi's arrays (TreeClassifier.arrays_; live views,
# not copies)) at the start, every callback_every steps and at the end; the time it takes is not
# counted as training time.
ProgressCallback = Callable[[float, int, dict[str, np.ndarray]], None]


def _pair_keys(pair_doc: np.ndarray, pair_label: np.ndarray, num_labels: int) -> np.ndarray:
    return np.sort(pair_doc * num_labels + pair_label)


def _is_positive(sorted_keys: np.ndarray, doc: np.ndarray, label: np.ndarray, num_labels: int) -> np.ndarray:
    keys = doc * num_labels + label
    pos = np.searchsorted(sorted_keys, keys)
    pos = np.minimum(pos, len(sorted_keys) - 1)
    return sorted_keys[pos] == keys


class TreeClassifier:
    """xi_y(x) = v_y . q + c_y (+ the lexical term of training/tree_lexical.py) trained by
    negative sampling from a LabelTree (or uniformly).

    Hyper-parameters: negatives per positive, lam and regularise (see the module docstring),
    epochs, batch_size, lr, sampler ("adversarial" | "uniform"), optimizer ("adagrad" | "sgd"),
    weight_decay, seed. fit(start=(w, b)) starts v, c at a given classifier (xi = w . q + b);
    fit(tokens, lexical=LexicalStart) adds the lexical term, started there. With either start
    the regulariser weighs the change from the starting xi instead of xi itself.
    After fit(): arrays_ (classifier_weights [L, D], classifier_bias [L], and with the lexical
    term lexical_indptr, lexical_labels, lexical_weights, lexical_bias), fit_stats_.
    """

    def __init__(
        self,
        negatives: int = 8,
        lam: float = 0.01,
        epochs: int = 6,
        batch_size: int = 512,
        lr: float = 0.2,
        sampler: str = "adversarial",
        optimizer: str = "adagrad",
        regularise: str = "xi",
        weight_decay: float = 0.0,
        seed: int = 0,
        progress: bool = False,
    ) -> None:
        self.negatives = negatives
        self.lam = lam
        self.epochs = epochs
        self.batch_size = batch_size
        self.lr = lr
        self.sampler = sampler
        self.optimizer = optimizer
        self.regularise = regularise
        self.weight_decay = weight_decay
        self.seed = seed
        self.progress = progress

    def fit(
        self,
        embeddings: np.ndarray,
        targets: Sequence[Sequence[int]],
        num_labels: int,
        tree: LabelTree | None,
        callback: ProgressCallback | None = None,
        callback_every: int = 0,
        time_budget: float | None = None,
        tokens: TokenRows | None = None,
        lexical: LexicalStart | None = None,
        start: tuple[np.ndarray, np.ndarray] | None = None,
        target_weights: Sequence[Sequence[float]] | None = None,
    ) -> TreeClassifier:
        """target_weights: per target a weight in (0, 1] (imputed labels'; None: all 1): each
        epoch trains on each pair with that probability."""
        self._check(tree, tokens, lexical)
        run = _Run(self, embeddings, targets, num_labels, tree, start, tokens)
        weights = None if target_weights is None else pair_weights(targets, target_weights, num_labels)
        if weights is not None and weights.min() >= 1:
            weights = None  # hard labels: no draws, the same run as without weights
        if lexical is not None:
            assert tokens is not None
            run.add_lexical(LexicalPart(tokens, lexical, num_labels), fitted=bool(lexical.weights.any()))
        losses: list[float] = []
        stop = False
        if callback is not None and callback_every:
            callback(run.elapsed, run.steps, run.export())  # the start: a curve begins before the first step
        for epoch in range(self.epochs):
            order = run.rng.permutation(len(run.pair_doc))
            if weights is not None:
                order = order[run.rng.random(len(order)) < weights[order]]
            total, batches = 0.0, 0
            bar = Progress(range(0, len(order), self.batch_size), f"tree classifier epoch {epoch + 1}/{self.epochs}",
                           enabled=self.progress)
            for begin in bar:
                t0 = time.perf_counter()
                total += run.step(order[begin : begin + self.batch_size])
                batches += 1
                bar.postfix(loss=f"{total / batches:.4f}")
                run.elapsed += time.perf_counter() - t0
                if callback is not None and callback_every and run.steps % callback_every == 0:
                    callback(run.elapsed, run.steps, run.export())
                # a loss that is not finite: diverged (AdversarialTree's check names the setting)
                if not math.isfinite(total) or (time_budget is not None and run.elapsed >= time_budget):
                    stop = True
                    break
            losses.append(total / max(batches, 1))
            if stop:
                break
        if callback is not None:
            callback(run.elapsed, run.steps, run.export())
        self.arrays_ = {name: np.array(a, copy=True) for name, a in run.export().items()}
        self.weights_, self.bias_ = self.arrays_["classifier_weights"], self.arrays_["classifier_bias"]
        self.fit_stats_ = {"train_seconds": run.elapsed, "steps": run.steps, "losses": losses,
                           "masked_negative_fraction": run.masked / max(run.drawn, 1)}
        return self

    def _check(self, tree: LabelTree | None, tokens: TokenRows | None, lexical: LexicalStart | None) -> None:
        if self.sampler not in ("adversarial", "uniform"):
            raise ValueError(f"sampler must be 'adversarial' or 'uniform', got {self.sampler!r}")
        if self.regularise not in ("xi", "corrected"):
            raise ValueError(f"regularise must be 'xi' or 'corrected', got {self.regularise!r}")
        if self.optimizer not in ("sgd", "adagrad"):
            raise ValueError(f"optimizer must be 'sgd' or 'adagrad', got {self.optimizer!r}")
        if self.sampler == "adversarial" and tree is None:
            raise ValueError("sampler='adversarial' needs a fitted LabelTree")
        if self.sampler == "adversarial" and tree.node_lexical_ is not None and tokens is None:
            raise ValueError("a tree with a lexical node term needs the documents' tokens")
        if lexical is not None and tokens is None:
            raise ValueError("a lexical term needs the documents' tokens")
        if self.negatives < 1 or self.epochs < 0 or self.batch_size < 1 or self.lr <= 0 or self.lam < 0:
            raise ValueError("negatives >= 1, epochs >= 0, batch_size >= 1, lr > 0 and lambda >= 0 required")


class _Run:
    """One TreeClassifier fit's state: the positive pairs, the sampler, the parameters being trained."""

    def __init__(self, clf: TreeClassifier, embeddings: np.ndarray, targets: Sequence[Sequence[int]],
                 num_labels: int, tree: LabelTree | None, start: tuple[np.ndarray, np.ndarray] | None,
                 tokens: TokenRows | None) -> None:
        self.clf, self.num_labels, self.tree = clf, num_labels, tree
        x = np.ascontiguousarray(embeddings, dtype=np.float32)
        # Encoder outputs are non-negative (ReLU), so every raw embedding shares one direction;
        # training on centred inputs keeps v_y about what distinguishes y's documents rather than
        # that common direction. xi = v.(q - m) + c = v.q + (c - v.m): the bias absorbs it on export.
        self.center = x.mean(axis=0)
        x = x - self.center
        self.pair_doc, self.pair_label = flatten_pairs(targets, num_labels)
        self.rng = np.random.default_rng(clf.seed)
        torch.manual_seed(clf.seed)
        self.keys = _pair_keys(self.pair_doc, self.pair_label, num_labels)
        self.uniform_logp = -float(np.log(num_labels))
        # p_n's tokens (its lexical node term), None without one.
        self.tokens = None
        if clf.sampler == "adversarial":
            assert tree is not None
            if tree.node_lexical_ is not None:
                assert tokens is not None
                self.tokens = (tokens.doc_ids, tokens.doc_weights)
            # The tree projects raw embeddings ((x - its mean) P), as the served route does.
            self.z = tree.project(embeddings)
            self.pos_logp = self._positives_log_pn(tree)
        else:
            self.z, self.pos_logp = None, np.full(len(self.pair_doc), self.uniform_logp)
        self.weight = torch.nn.Embedding(num_labels, x.shape[1], sparse=True)
        self.bias = torch.nn.Embedding(num_labels, 1, sparse=True)
        self.start = None
        if start is None:
            torch.nn.init.zeros_(self.weight.weight)
            torch.nn.init.zeros_(self.bias.weight)
        else:  # xi = w.q + b = w.(q - m) + (b + w.m)
            w0 = np.ascontiguousarray(start[0], dtype=np.float32)
            c0 = (np.asarray(start[1], dtype=np.float32) + w0 @ self.center)[:, None]
            self.start = (torch.from_numpy(w0), torch.from_numpy(c0))
            with torch.no_grad():
                self.weight.weight.copy_(self.start[0])
                self.bias.weight.copy_(self.start[1])
        self.lexical: LexicalPart | None = None
        self.lexical_start: list[torch.Tensor] | None = None
        self._optimizer([self.weight.weight, self.bias.weight])
        self.x = torch.from_numpy(x)
        self.masked = self.drawn = self.steps = 0
        self.elapsed = 0.0

    def _optimizer(self, params: list[torch.Tensor]) -> None:
        clf = self.clf
        self.opt: torch.optim.Optimizer = (torch.optim.Adagrad(params, lr=clf.lr) if clf.optimizer == "adagrad"
                                           else torch.optim.SGD(params, lr=clf.lr))

    def add_lexical(self, part: LexicalPart, fitted: bool) -> None:
        """Train the lexical term too; `fitted`: it starts at a fitted model (so the regulariser
        weighs its change, as it does the dense part's with a start)."""
        self.lexical = part
        self.lexical_start = [p.detach()[:, 0].clone() for p in part.parameters] if fitted else None
        self._optimizer([self.weight.weight, self.bias.weight, *part.parameters])

    def export(self) -> dict[str, np.ndarray]:
        w = self.weight.weight.detach().numpy()
        out = {"classifier_weights": w,
               "classifier_bias": (self.bias.weight.detach().numpy()[:, 0] - w @ self.center).astype(np.float32)}
        if self.lexical is not None:
            out.update(self.lexical.export())
        return out

    def _positives_log_pn(self, tree: LabelTree) -> np.ndarray:
        """log p_n of every positive pair, in chunks: each pair's copy of its document's tokens
        would be [pairs, T] at once (two gigabytes for a 10^6-label training's 5 * 10^6 pairs)."""
        out = np.empty(len(self.pair_doc))
        for begin in range(0, len(out), _POSITIVES_AT_ONCE):
            docs = self.pair_doc[begin : begin + _POSITIVES_AT_ONCE]
            labels = self.pair_label[begin : begin + _POSITIVES_AT_ONCE, None]
            out[begin : begin + len(docs)] = tree.log_prob(self.z[docs], labels, self._tokens_of(docs))[:, 0]
        return out

    def _tokens_of(self, doc: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        return None if self.tokens is None else (self.tokens[0][doc], self.tokens[1][doc])

    def _negatives(self, doc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Negatives [B, S] for each document, their log p_n, and which are not its positives."""
        s = self.clf.negatives
        if self.z is not None:
            assert self.tree is not None
            neg, neg_logp = self.tree.sample(self.z[doc], s, self.rng, self._tokens_of(doc))
        else:
            neg = self.rng.integers(0, self.num_labels, size=(len(doc), s))
            neg_logp = np.full(neg.shape, self.uniform_logp)
        keep = ~_is_positive(self.keys, np.repeat(doc, s), neg.ravel(), self.num_labels)
        keep = keep.reshape(neg.shape)
        self.masked += int((~keep).sum())
        self.drawn += keep.size
        return neg, neg_logp, keep

    def step(self, idx: np.ndarray) -> float:
        """One update on the positive pairs idx; returns the batch's loss."""
        clf = self.clf
        doc, pos = self.pair_doc[idx], self.pair_label[idx]
        neg, neg_logp, keep = self._negatives(doc)
        q = self.x[torch.from_numpy(doc)]
        label_np = np.concatenate([pos[:, None], neg], axis=1)
        labels = torch.from_numpy(label_np)
        rows = self.weight(labels)  # [B, 1 + S, D]
        xi = (rows * q[:, None, :]).sum(-1) + self.bias(labels)[..., 0]  # [B, 1 + S]
        start = None
        if self.start is not None:
            start = (self.start[0][labels] * q[:, None, :]).sum(-1) + self.start[1][labels][..., 0]
        if self.lexical is not None:
            found = self.lexical.lookup(doc, label_np)
            xi = xi + self.lexical.scores(found)
            if self.lexical_start is not None:
                lex0 = self.lexical.scores(found, *self.lexical_start)
                start = lex0 if start is None else start + lex0
        logp = torch.from_numpy(np.concatenate([self.pos_logp[idx][:, None], neg_logp], axis=1)).float()
        mask = torch.from_numpy(np.concatenate([np.ones((len(idx), 1), bool), keep], axis=1)).float()
        nll = F.softplus(-xi[:, 0]) + (F.softplus(xi[:, 1:]) * mask[:, 1:]).sum(1)
        target = xi + logp if clf.regularise == "corrected" else xi
        if start is not None:  # the change from the starting classifier is what is regularised
            target = target - start
        penalty = clf.lam * ((target**2) * mask).sum(1)
        if clf.weight_decay:  # an L2 on the rows read (without it, no second pass over them)
            penalty = penalty + clf.weight_decay * (rows**2).sum(-1).mean(1)
        loss = (nll + penalty).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        # Adagrad's sparse update warns unless invariant checks are explicitly chosen.
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            self.opt.step()
        self.steps += 1
        return float(loss.detach())


def tree_from_config(cfg: dict[str, Any], seed: int) -> LabelTree:
    return LabelTree(
        pca_dim=int(cfg["pca_dim"]),
        lambda_n=float(cfg["lambda_n"]),
        newton_steps=int(cfg["newton_steps"]),
        max_rounds=int(cfg["max_rounds"]),
        seed=seed,
    )


def fit_p_n(cfg: dict[str, Any], seed: int, doc_embeddings: np.ndarray, targets: Sequence[Sequence[int]],
             num_labels: int, tokens: TokenRows | None, progress: bool = False) -> LabelTree:
    """p_n as configured: the dense splits, then (node_lexical) its lexical node term."""
    t0 = time.perf_counter()
    tree = tree_from_config(cfg, seed).fit(doc_embeddings, targets, num_labels)
    log.info("tree p_n: %d levels fitted in %.1fs", tree.depth_, time.perf_counter() - t0)
    if cfg["node_lexical"]:
        if tokens is None:
            raise ValueError("tree config node_lexical needs the documents' tokens")
        t0 = time.perf_counter()
        pair_doc, pair_label = flatten_pairs(targets, num_labels)
        fitted = node_lexical_from_config(cfg, seed, progress).fit(
            tree, tree.project(doc_embeddings), (tokens.doc_ids, tokens.doc_weights), pair_doc, pair_label)
        tree.set_node_lexical(fitted.table_)
        log.info("tree p_n: lexical node term (2^%d slots, %d steps) in %.1fs", fitted.bits, fitted.steps_,
                 time.perf_counter() - t0)
    return tree


def node_lexical_from_config(cfg: dict[str, Any], seed: int, progress: bool = False) -> NodeLexicalFit:
    return NodeLexicalFit(bits=int(cfg["node_lexical_bits"]), epochs=int(cfg["node_lexical_epochs"]),
                          lr=float(cfg["node_lexical_lr"]), l2=float(cfg["node_lexical_l2"]),
                          batch_docs=int(cfg["node_lexical_batch"]), max_steps=int(cfg["node_lexical_max_steps"]),
                          seed=seed, progress=progress)


# The config keys the lexical term's start depends on (lexical_start_from_config).
LEXICAL_START_KEYS = ("start", "lexical_width", "lexical_epochs", "lexical_lr", "lexical_l2", "lexical_max_steps",
                      "lexical_tol")


def lexical_start_from_config(cfg: dict[str, Any], seed: int, tokens: TokenRows, targets: Sequence[Sequence[int]],
                              num_labels: int, target_weights: Sequence[Sequence[float]] | None = None
                              ) -> LexicalStart:
    """xi's lexical term's start as configured (LEXICAL_START_KEYS): its rows, and with start
    "one_vs_all" the one-vs-all logistic model of the tokens on them (soft targets: the weights)."""
    return lexical_start(tokens, targets, num_labels, int(cfg["lexical_width"]), cfg["start"] == "one_vs_all",
                         int(cfg["lexical_epochs"]), float(cfg["lexical_lr"]), float(cfg["lexical_l2"]), seed,
                         int(cfg["lexical_max_steps"]), float(cfg["lexical_tol"]), target_weights)


def one_vs_all_start(cfg: dict[str, Any], module3: tuple[np.ndarray, np.ndarray], centroids: np.ndarray | None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """xi's dense start (config start "one_vs_all"): Module III's w_l + start_centroids x mu_l, and b_l."""
    w, b = module3
    gamma = float(cfg["start_centroids"])
    if gamma == 0:
        return w, b
    if centroids is None:
        raise ValueError("tree config start_centroids > 0 needs the label centroids")
    if centroids.shape != w.shape:
        raise ValueError(f"label centroids {centroids.shape} do not match the classifiers {w.shape}")
    with np.errstate(over="ignore", invalid="ignore"):  # a start past float32 is refused by the check after it
        return np.asarray(w, dtype=np.float32) + np.float32(gamma) * np.asarray(centroids, dtype=np.float32), b


def classifier_from_config(cfg: dict[str, Any], seed: int, sampler: str = "adversarial",
                           progress: bool = False) -> TreeClassifier:
    return TreeClassifier(
        negatives=int(cfg["negatives"]),
        lam=float(cfg["lambda"]),
        regularise=str(cfg["regularise"]),
        weight_decay=float(cfg["weight_decay"]),
        epochs=int(cfg["epochs"]),
        batch_size=int(cfg["batch_size"]),
        lr=float(cfg["lr"]),
        sampler=sampler,
        seed=seed,
        progress=progress,
    )


class AdversarialTree:
    """The tree route's model: p_n (a LabelTree) and xi (a TreeClassifier) fitted on the training
    documents' embeddings; `arrays_` are service.engine.tree.TreeScorer's (the bundle's tree.npz).

    config keys (defaults in training.tree_config.DEFAULT_CONFIG): pca_dim, lambda_n, newton_steps, max_rounds,
    node_lexical and its node_lexical_* keys, negatives, lambda, regularise, weight_decay, start,
    start_centroids, lexical and its lexical_* keys, epochs, batch_size, lr, beam.
    """

    def __init__(self, config: dict[str, Any] | None = None, seed: int = 0, progress: bool = False) -> None:
        self.config = resolve_config(dict(config or {}))
        self.seed = seed
        self.progress = progress

    def fit(self, doc_embeddings: np.ndarray, targets: list[list[int]], num_labels: int,
            tokens: TokenRows | None = None, module3: tuple[np.ndarray, np.ndarray] | None = None,
            lexical: LexicalStart | None = None, centroids: np.ndarray | None = None,
            target_weights: list[list[float]] | None = None) -> AdversarialTree:
        """tokens: the documents' tokens (config lexical); module3: Module III's (w_l, b_l)
        (config start "one_vs_all"); centroids: the label centroids mu_l [L, D] (config
        start_centroids > 0); lexical: the lexical term's start when already fitted
        (lexical_start_from_config with this config), else it is fitted here; target_weights:
        per target a weight in (0, 1] (imputed labels'; None: every target 1)."""
        cfg = self.config
        start = None
        if cfg["start"] == "one_vs_all":
            if module3 is None:
                raise ValueError("tree config start 'one_vs_all' needs Module III's classifiers")
            start = one_vs_all_start(cfg, module3, centroids)
            # Module III's classifiers were checked: a start that is not finite is start_centroids'.
            check_fitted("tree classifier", "lower tree.start_centroids",
                         {"its start (Module III's classifiers + start_centroids x centroids)": start[0]})
        for key in ("lexical", "node_lexical"):
            if cfg[key] and tokens is None:
                raise ValueError(f"tree config {key} needs the documents' tokens")
        # One torch thread: the steps are small gathers and sums that a second thread does not
        # speed up, and on shared cores its spin-waits cost (a refit on debian-tags with two threads
        # beside other jobs: 8 CPU minutes in 56 minutes, unfinished; with one: 6.5 minutes).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._fit(doc_embeddings, targets, num_labels, tokens, start, lexical, target_weights)
        finally:
            torch.set_num_threads(threads)

    def _fit(self, doc_embeddings: np.ndarray, targets: list[list[int]], num_labels: int, tokens: TokenRows | None,
             start: tuple[np.ndarray, np.ndarray] | None, lexical: LexicalStart | None,
             target_weights: list[list[float]] | None) -> AdversarialTree:
        cfg = self.config
        one_vs_all = cfg["start"] == "one_vs_all"
        tree = fit_p_n(cfg, self.seed, doc_embeddings, sample_targets(targets, target_weights, self.seed), num_labels,
                       tokens, self.progress)
        check_fitted("tree p_n", "raise tree.lambda_n", tree.arrays())
        if not cfg["lexical"]:
            lexical = None
        elif lexical is None:
            assert tokens is not None
            t0 = time.perf_counter()
            lexical = lexical_start_from_config(cfg, self.seed, tokens, targets, num_labels, target_weights)
            log.info("tree classifier: lexical rows (%d pairs)%s in %.1fs", len(lexical.keys),
                     " and their one-vs-all start" if one_vs_all else "", time.perf_counter() - t0)
            check_fitted("tree lexical start", "lower tree.lexical_lr or raise tree.lexical_l2",
                         {"its weights": lexical.weights, "its bias": lexical.hit_bias})
        clf = classifier_from_config(cfg, self.seed, progress=self.progress).fit(
            doc_embeddings, targets, num_labels, tree, tokens=tokens, lexical=lexical,
            start=start, target_weights=target_weights)
        check_fitted("tree classifier", "lower tree.lr", {**clf.arrays_, "its loss": clf.fit_stats_["losses"]})
        self.arrays_ = {**tree.arrays(), **clf.arrays_, "default_beam": np.asarray(int(cfg["beam"]), dtype=np.int64)}
        return self

    def save(self, directory: Path) -> None:
        np.savez(directory / TREE_FILE, **self.arrays_)

    @classmethod
    def load(cls, directory: Path) -> AdversarialTree | None:
        if not (directory / TREE_FILE).is_file():
            return None
        out = cls()
        with np.load(directory / TREE_FILE) as z:
            out.arrays_ = {k: z[k] for k in z.files}
        return out
