"""Per-document labels imputed from group labels: EAGLE (Shen, Yu, Sanghavi, Dhillon, ICML 2020).

Algorithm 1 (GROUP_ROBUST_LABEL_REPR): a label's vector starts at the normalised sum of the
members of the groups that carry it; then T times, in each of those groups the member closest
to the vector is picked, and the vector moves towards the normalised sum of the picks with step
lambda and is renormalised. Members that do not have the label pull less and less: the vector
settles on what the label's true members share.
Algorithm 2: each (group, label) pair goes to the group's member closest to the label's vector.

Four choices beyond the paper (all off, with T given and the closest member, is the paper's
method; training/config.py says which are on by default and bench/RESULTS.md what each is worth):
- center: the features are centred on the documents' mean before the rows are normalised. TF-IDF
  rows are non-negative, so every document shares a large common direction; a frequent label's
  sum of members is mostly that direction, and its "closest" member is then the most generic
  document, not the one that carries the label. Centring removes what all documents share (a
  statistic of the documents alone, no labels).
- label_features: each label's own text, where the data has one, joins as one more group that
  carries the label, with the text as its only member: a known positive that anchors labels
  carried by one or two groups, whose members alone cannot say which of them has the label.
- validation (the number of iterations): a share of the groups is held out, the vectors are
  learnt without their labels, and the number of iterations in 0..T kept is the one whose
  vectors rank the held-out groups' labels best by their members' best scores (group-level
  P@1): tuned on a group-level split, not on per-document labels. The best number differs:
  centred, random groups peak at 0 and clustered groups later (bench/RESULTS.md).
- the relative assignment: a (group, label) pair goes to every member whose score reaches r
  times the closest member's. Members of a group of alike documents share most of their labels;
  one member per label drops most of them, and a model trained on the rest learns those labels
  as absent where they are common (on clustered groups that loses to the naive group labels).
  With r = 1 this is Algorithm 2, with r = 0 the naive group labels. r is chosen on the held-out
  groups (_choose_keep_ratio): the r whose imputed labels, read off each held-out member's
  nearest documents of other groups, rank the held-out groups' own labels first.
  impute_weights gives each kept label the member's score over the closest member's (soft
  labels; training/aggregated.py passes them to training when aggregated_soft_labels): the
  member ranking is weak in groups of alike documents (bench/RESULTS.md: on clustered groups of
  debian-tags a member holding the label outscores one without it 75% of the time), so a label
  kept on a farther member is kept, but less surely.

Features are rows of a matrix fixed before training: sparse TF-IDF (the first round) or the
trained encoder's embeddings (a second round). Everything is vectorised over the (group,
label) pairs: scores of the pairs' members in chunks (sparse lookups or dense products; a
chunk's pairs whole), picks by one sort a chunk, updates by one sparse product. Centred sparse features stay
sparse: a row is a_i (x_i - m) and a label vector S_l - c_l m, so every product is a sparse one
plus rank-one corrections.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from training.eagle_space import (
    SCORE_CHUNK,
    Features,
    Space,
    Vectors,
    runs,
    space_of,
)
from training.progress import Progress

# Algorithm 2 as in the paper ("closest"), or beyond it ("expected", "relative"): see EagleImputer.impute.
ASSIGNMENTS = ("closest", "expected", "relative")
# The keep ratios a group-level validation chooses among for the "relative" assignment.
KEEP_RATIOS = tuple(round(0.1 * k, 1) for k in range(10, -1, -1))
_VALIDATION_CHUNK = 256  # held-out members compared with every document of other groups at once
_PATIENCE = 3  # iterations without a better group-level P@1 before the validation stops
_NEIGHBOURS = 20  # the neighbours (documents of other groups) a held-out member's labels are read from


# The keep ratio where none is given and none can be chosen: each group's label goes to its closest
# member (and members tied with it), the paper's Algorithm 2.
CLOSEST_ONLY = 1.0


@dataclass(frozen=True)
class SkippedChoice:
    """Why fit made no choice on held-out groups: `held` of the `labelled` groups with a label were
    held out, fewer than `needed` (none: nothing to score; one: one group's luck)."""

    held: int
    labelled: int
    needed: int


def held_out_groups(group_labels: sp.csr_matrix, validation: float, seed: int) -> np.ndarray:
    """The groups whose labels a validation hides (sorted; none without validation): a share
    `validation` of the groups that carry a label (an unlabelled group has nothing to score),
    leaving at least one of them to learn the label vectors from."""
    labelled = np.flatnonzero(np.diff(sp.csr_matrix(group_labels).indptr) > 0)
    count = min(max(1, int(round(validation * len(labelled)))), len(labelled) - 1)
    if validation == 0 or count <= 0:
        return np.zeros(0, np.int64)
    # With every group labelled this draws what a choice among all groups drew (same seed, same count).
    return np.sort(labelled[np.random.default_rng(seed).choice(len(labelled), count, replace=False)])


class EagleImputer:
    """fit(features [N, F], members [G, N], group_labels [G, L]) -> label_vectors_ [L, F];
    impute() -> per-document label ids (Algorithm 2).

    iterations (T) and step (lambda): Algorithm 1's. seed: the start of a label whose initial
    sum is zero (its groups' members cancel out, as in the paper's +x / -x example): then a
    member of one of its groups drawn with this seed. center: centre the features on the
    documents' mean (module docstring). validation: the share of groups held out to choose the
    number of iterations iterations_ in 0..T by group-level P@1 (0: T as given, the paper's) and,
    for the "relative" assignment, keep_ratio_ (EagleImputer.impute) when keep_ratio is None.
    min_held_out: the fewest held-out groups with a label such a choice is made on; with fewer,
    fit chooses nothing (choice_skipped_ says why): iterations_ is T and keep_ratio_ keep_ratio,
    else CLOSEST_ONLY (the paper's method).
    chunk: the most (pair, member) scores, (pair, member, token) products or (member, label)
    validation scores computed at once (the results do not depend on it).
    """

    def __init__(self, iterations: int = 10, step: float = 0.5, seed: int = 0, assignment: str = "expected",
                 center: bool = False, validation: float = 0.0, keep_ratio: float | None = None,
                 min_held_out: int = 1, chunk: int = SCORE_CHUNK) -> None:
        if iterations < 0:
            raise ValueError(f"iterations must be >= 0, got {iterations}")
        if not 0.0 < step <= 1.0:
            raise ValueError(f"step must be in (0, 1], got {step}")
        if assignment not in ASSIGNMENTS:
            raise ValueError(f"assignment must be one of {ASSIGNMENTS}, got {assignment!r}")
        self.iterations = int(iterations)
        self.step = float(step)
        self.seed = int(seed)
        self.assignment = assignment
        self.center = bool(center)
        if not 0.0 <= validation < 1.0:
            raise ValueError(f"validation must be in [0, 1), got {validation}")
        self.validation = float(validation)
        if keep_ratio is not None and not 0.0 <= keep_ratio <= 1.0:
            raise ValueError(f"keep_ratio must be in [0, 1], got {keep_ratio}")
        if assignment == "relative" and keep_ratio is None and self.validation == 0:
            raise ValueError("the relative assignment needs a keep_ratio or a validation share to choose it on")
        self.keep_ratio = keep_ratio
        self.min_held_out = max(1, int(min_held_out))
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.chunk = int(chunk)

    @property
    def chooses_on_held_out(self) -> bool:
        """Whether fit chooses the iterations or the keep ratio on held-out groups."""
        choose_ratio = self.assignment == "relative" and self.keep_ratio is None
        return self.validation > 0 and (self.iterations > 0 or choose_ratio)

    def fit(self, features: Features, members: sp.csr_matrix, group_labels: sp.csr_matrix,
            label_features: Features | None = None) -> EagleImputer:
        """label_features [L, F] (optional, same space as features): each label's text, added as
        a group of one that carries the label (labels that no group carries are left out).
        With validation > 0, iterations_ (<= iterations) is chosen first on held-out groups."""
        members, group_labels = sp.csr_matrix(members), sp.csr_matrix(group_labels)
        num_docs, num_groups = features.shape[0], members.shape[0]
        held = held_out_groups(group_labels, self.validation, self.seed)
        self.choice_skipped_ = None
        if self.chooses_on_held_out and len(held) < self.min_held_out:
            self.choice_skipped_ = SkippedChoice(len(held), int((np.diff(group_labels.indptr) > 0).sum()),
                                                 self.min_held_out)
        if label_features is not None:
            features, members, group_labels = _with_label_groups(features, members, group_labels, label_features)
        space = space_of(features, num_docs, self.center, self.chunk)
        self.iterations_, self.validation_scores_ = self.iterations, []
        self.keep_ratio_, self.keep_ratio_scores_ = self.keep_ratio, []
        if self.choice_skipped_ is not None:
            self.keep_ratio_ = CLOSEST_ONLY if self.keep_ratio is None else self.keep_ratio
        elif self.validation > 0 and self.iterations > 0:
            self.validation_scores_ = self._validate(space, members, group_labels, held)
            self.iterations_ = int(np.argmax(self.validation_scores_))  # the fewest iterations on ties
        if self.choice_skipped_ is None and self.assignment == "relative" and self.keep_ratio is None:
            self.keep_ratio_scores_ = self._choose_keep_ratio(space, members, group_labels, held, num_groups)
            self.keep_ratio_ = KEEP_RATIOS[int(np.argmax(self.keep_ratio_scores_))]  # the highest on ties
        v = self._group_robust(space, members, group_labels, self.iterations_, stage="imputing")
        real = self.pair_group_ < num_groups  # the labels' own texts shaped the vectors; documents get labels
        self.pair_group_, self.pair_label_ = self.pair_group_[real], self.pair_label_[real]
        self._pair_source = members[:num_groups]
        self.label_vectors_ = v
        self._space, self._members, self._num_docs = space, members[:num_groups], num_docs
        self._assignment: sp.csr_matrix | None = None
        return self

    def _group_robust(self, space: Space, members: sp.csr_matrix, group_labels: sp.csr_matrix, iterations: int,
                      after_step: Callable[[Vectors], bool] | None = None, stage: str = "") -> Vectors:
        """Algorithm 1 for every label at once; after_step(v) sees the start and each iteration
        and stops them by returning True. Its iterations show progress as `stage` (an iteration
        takes seconds with large groups: 20,000 documents in groups of 500, ~10 s)."""
        self.pair_group_, self.pair_label_ = _pairs(group_labels)
        self._pair_source = members
        v = space.normalize(space.pool(sp.csr_matrix(group_labels.T) @ members))
        v = self._seed_empty(space, v, group_labels)
        for step in Progress(range(iterations + 1), f"aggregated, {stage}: label vector iterations"):
            if (after_step is not None and after_step(v)) or step == iterations:
                break
            picks, _ = self._closest(space, v)
            u = space.normalize(space.pool(_label_by_doc(self.pair_label_, picks, group_labels.shape[1],
                                                         space.num_rows)))
            v = space.normalize(space.mix(1.0 - self.step, v, self.step, u))
        return v

    def _validate(self, space: Space, members: sp.csr_matrix, group_labels: sp.csr_matrix,
                  held: np.ndarray) -> list[float]:
        """Group-level P@1 after 0..T iterations: the labels of a held-out share of the groups are
        hidden while the vectors are learnt, then each held-out group's labels are ranked by the
        best score among its members (no per-document label is needed). Iterations stop once
        _PATIENCE of them in a row have not beaten the best."""
        visible = _without(group_labels, held)
        unknown = np.diff(sp.csc_matrix(visible).indptr) == 0
        truth, held_members = group_labels[held], members[held]
        scores: list[float] = []

        def score(v: Vectors) -> bool:
            top = self._top_labels(space, held_members, v, unknown)
            scores.append(int(np.asarray(truth[np.arange(len(held)), top]).sum()) / len(held))
            return len(scores) - 1 - int(np.argmax(scores)) >= _PATIENCE

        self._group_robust(space, members, visible, self.iterations, score, stage="choosing the iterations")
        return scores

    def _top_labels(self, space: Space, groups: sp.csr_matrix, v: Vectors, unknown: np.ndarray) -> np.ndarray:
        """Each group's (a row of a members matrix) top label: of the labels not `unknown`, the one
        a member scores highest (the lowest such label on ties; 0 for a group without members),
        scoring at most `chunk` (member, label) at once. Each member's best label is kept, not
        each group's best score per label (a [groups, labels] array a run, and most of the time)."""
        docs = groups.indices.astype(np.int64)
        score, label = np.full(len(docs), -np.inf, np.float32), np.zeros(len(docs), np.int64)
        for a, b in runs(np.ones(len(docs), np.int64), max(1, self.chunk // max(v.shape[0], 1))):
            scores = space.all_dots(docs[a:b], v)
            scores[:, unknown] = -np.inf
            label[a:b] = np.argmax(scores, axis=1)
            score[a:b] = scores[np.arange(b - a), label[a:b]]
        group_of = np.repeat(np.arange(groups.shape[0]), np.diff(groups.indptr))
        order = np.lexsort((label, -score, group_of))  # per group: the highest score, then the lowest label
        first = order[np.r_[True, group_of[order][1:] != group_of[order][:-1]]] if len(order) else order
        top = np.zeros(groups.shape[0], np.int64)
        top[group_of[first]] = label[first]
        return top

    def _choose_keep_ratio(self, space: Space, members: sp.csr_matrix, group_labels: sp.csr_matrix,
                           held: np.ndarray, num_groups: int) -> list[float]:
        """Per candidate in KEEP_RATIOS, how well labels imputed with it find the held-out groups'
        labels: the vectors are learnt with those hidden (iterations_ iterations), the other groups'
        labels imputed, and each held-out member's label probabilities read off its _NEIGHBOURS
        nearest documents of other groups (a stand-in for the model trained on the imputed labels);
        a group's labels are ranked by their largest probability among its members. The score is
        the mean share of a held-out group's labels among its top |labels| (R-precision): group
        labels only, no per-document label. Too few members keeping a label and neighbours miss
        it; too many and they push other groups' labels up."""
        visible = _without(group_labels, held)
        v = self._group_robust(space, members, visible, self.iterations_, stage="choosing the keep ratio")
        held_members = members[held]
        others = np.setdiff1d(members[:num_groups].indices, held_members.indices)
        weights = _neighbour_weights(space, held_members.indices.astype(np.int64), others)
        member_group = np.repeat(np.arange(len(held)), np.diff(held_members.indptr))
        docs, labels, scores, best = self._neighbours_pairs(space, v, weights.indices, num_groups)
        scores_by_ratio = []
        for ratio in KEEP_RATIOS:
            keep = scores >= _keep_threshold(best, ratio)
            imputed = sp.csr_matrix((np.ones(int(keep.sum()), np.float32), (docs[keep], labels[keep])),
                                    shape=(space.num_rows, group_labels.shape[1]))
            imputed.sum_duplicates()
            imputed.data[:] = 1.0  # a document and label once, however many pairs gave it
            scores_by_ratio.append(_r_precision(sp.csr_matrix(weights @ imputed), member_group, group_labels[held]))
        return scores_by_ratio

    def _neighbours_pairs(self, space: Space, v: Vectors, neighbours: np.ndarray, num_groups: int
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(document, label, its score, its pair's best member's score) of every (pair, member) of
        a document group (not a label's text) whose member is in `neighbours`: only their imputed
        labels are read. Scored chunk by chunk and kept as 16 bytes each (the neighbours of
        held-out members are most documents when groups are large: all (pair, member) entries at
        once, with their pairs, labels and masks, took ~60 bytes each)."""
        wanted = np.zeros(space.num_rows, bool)
        wanted[neighbours] = True
        kept: list[tuple[np.ndarray, ...]] = []
        for run, starts, docs, scores in self._scored_pairs(space, v):
            pair_of = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
            if not len(docs):
                continue
            best = _best_per_pair(scores, starts)[pair_of]
            use = (self.pair_group_[run][pair_of] < num_groups) & wanted[docs]
            kept.append((docs[use].astype(np.int32), self.pair_label_[run][pair_of[use]].astype(np.int32),
                         scores[use], best[use]))
        return _concatenated(kept, 4)

    def impute(self) -> list[list[int]]:
        """Each document's labels: every (group, label) pair given to the group's closest member
        ("closest", the paper's Algorithm 2), to as many of its closest members as a group
        holding the label is expected to have ("expected"), or to every member whose score reaches
        keep_ratio_ times the closest member's ("relative": all of a homogeneous group's members,
        the closest alone when the others are far)."""
        assigned = self._assigned()
        return [assigned.indices[assigned.indptr[i] : assigned.indptr[i + 1]].tolist() for i in range(self._num_docs)]

    def impute_weights(self) -> list[list[float]]:
        """Per document, a weight in (0, 1] for each of impute()'s labels (same order): with the
        relative assignment the member's score over its group's closest member's (1 for the
        closest, and for all where the closest does not score above 0), else 1. Members of a
        group of alike documents score alike, and the one that carries a label is often not the
        closest: a soft label keeps it on all of them, surer on the closer ones."""
        assigned = self._assigned()
        return [assigned.data[assigned.indptr[i] : assigned.indptr[i + 1]].tolist() for i in range(self._num_docs)]

    def _assigned(self) -> sp.csr_matrix:
        """[documents, labels]: the imputed labels, valued by their weights (impute_weights); made
        once a fit (impute and impute_weights both read it)."""
        if self._assignment is None:
            self._assignment = self._assign()
        return self._assignment

    def _assign(self) -> sp.csr_matrix:
        if self.assignment == "relative":
            picks, labels, weights = self._relative(self._space, self.label_vectors_, self.keep_ratio_)
        else:
            counts = self._expected_counts() if self.assignment == "expected" else None
            picks, labels = self._closest(self._space, self.label_vectors_, counts)
            weights = np.ones(len(picks), np.float32)
        assigned = sp.csr_matrix((weights.astype(np.float32), (picks, labels)),
                                 shape=(self._num_docs, self.label_vectors_.shape[0]))
        assigned.sum_duplicates()  # a document is in one group: no (document, label) twice
        assigned.data = np.minimum(assigned.data, 1.0)
        return assigned

    def scores(self, docs: np.ndarray) -> np.ndarray:
        """[len(docs), L]: each document's inner product with every label vector (a group-level
        validation ranks a held-out group's labels by its members' best score)."""
        return self._space.all_dots(np.asarray(docs, dtype=np.int64), self.label_vectors_)

    def _scored_pairs(self, space: Space, v: Vectors) -> Iterator[tuple[slice, np.ndarray, np.ndarray, np.ndarray]]:
        """Consecutive runs of pairs with at most `chunk` (pair, member) entries (a larger pair
        alone): (the run, starts [len + 1] into docs, docs, each member's score with its pair's label)."""
        sizes = np.diff(self._pair_source.indptr)[self.pair_group_]
        for lo, hi in runs(sizes, self.chunk):
            run = slice(lo, hi)
            starts, docs = _pair_members(self._pair_source, self.pair_group_[run])
            yield run, starts, docs, space.dots(docs, v, np.repeat(self.pair_label_[run], sizes[run]))

    def _closest(self, space: Space, v: Vectors, counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per pair, the member of its group with the largest inner product with its label's vector
        (the first such member on ties), or its `counts[pair]` closest: (documents, their labels)."""
        picked: list[tuple[np.ndarray, np.ndarray]] = []
        for run, starts, docs, scores in self._scored_pairs(space, v):
            pair_of = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
            if counts is None:  # no sort: a sort of every (pair, member) was ~1/4 of large groups' imputation
                at = _first_best(scores, starts, pair_of)
                picked.append((docs[at], self.pair_label_[run][pair_of[at]]))
                continue
            order = np.lexsort((np.arange(len(docs)), -scores, pair_of))
            rank = np.arange(len(order)) - starts[pair_of[order]]  # 0 = the pair's closest member
            keep = rank < counts[run][pair_of[order]]
            picked.append((docs[order[keep]], self.pair_label_[run][pair_of[order[keep]]]))
        return _concatenated(picked, 2)

    def _relative(self, space: Space, v: Vectors, ratio: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per pair, every member whose score reaches ratio times the best member's: (documents,
        labels, their scores over the best's, in [0, 1]; 1 where the best is not positive)."""
        kept: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for run, starts, docs, scores in self._scored_pairs(space, v):
            pair_of = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
            if not len(docs):
                continue
            best = _best_per_pair(scores, starts)[pair_of]
            keep = scores >= _keep_threshold(best, ratio)
            relative = np.where(best > 0, np.clip(scores / np.where(best > 0, best, 1.0), 0.0, 1.0), 1.0)
            kept.append((docs[keep], self.pair_label_[run][pair_of[keep]], relative[keep]))
        return _concatenated(kept, 3)

    def _expected_counts(self) -> np.ndarray:
        """Per pair, how many members of a group of its size hold its label, given that one does:
        E[n | n >= 1] = s p / (1 - (1 - p)^s), with p the label's per-document rate estimated from
        the share f of groups carrying it (f = 1 - (1 - p)^s at the mean group size). Group-level
        statistics only: the setting has no per-document labels to tune on."""
        group_sizes = np.diff(self._members.indptr).astype(np.float64)
        share = np.bincount(self.pair_label_, minlength=self.label_vectors_.shape[0]) / len(group_sizes)
        p = 1.0 - (1.0 - np.minimum(share, 1.0 - 1e-9)) ** (1.0 / group_sizes.mean())
        sizes, p_pair = group_sizes[self.pair_group_], p[self.pair_label_]
        expected = sizes * p_pair / (1.0 - (1.0 - p_pair) ** sizes)
        return np.clip(np.rint(expected), 1, sizes).astype(np.int64)

    def _seed_empty(self, space: Space, v: Vectors, group_labels: sp.csr_matrix) -> Vectors:
        empty = np.flatnonzero((space.norms(v) < 1e-6) & (np.diff(sp.csc_matrix(group_labels).indptr) > 0))
        if not len(empty):
            return v
        rng = np.random.default_rng(self.seed)
        indptr, indices = self._pair_source.indptr, self._pair_source.indices
        chosen = []
        for label in empty:  # rare (members that cancel out exactly): a loop is fine
            pairs = np.flatnonzero(self.pair_label_ == label)
            group = self.pair_group_[pairs[rng.integers(len(pairs))]]
            chosen.append(indices[indptr[group] + rng.integers(indptr[group + 1] - indptr[group])])
        keep = np.ones(v.shape[0], np.float32)
        keep[empty] = 0.0
        fix = space.pool(_label_by_doc(empty, np.asarray(chosen), v.shape[0], space.num_rows))
        return space.normalize(space.mix(keep, v, 1.0, fix))


def carrier_posteriors(members: sp.csr_matrix, group_labels: sp.csr_matrix,
                       probability: Callable[[np.ndarray, np.ndarray], np.ndarray],
                       floor: float = 0.0, chunk: int = SCORE_CHUNK) -> sp.csr_matrix:
    """[documents, labels]: for every (group, label) pair and member i of the group, the posterior
    that i carries the label given that at least one member does, q_i / (1 - prod_j (1 - q_j)),
    with q = probability(documents, labels) a model's per-document probability (members carrying
    a label independently, the E-step of EM for "a group carries a label iff a member does").
    A member the model finds likelier than its group-mates weighs more; a label the model finds
    unlikely on every member is scaled up, since the group says one of them carries it.
    Posteriors below `floor` are left out, except each pair's likeliest member's (the first of
    those tied): the group label stays on one member at least. Computed for at most `chunk`
    (pair, member) entries at once (whole pairs; the result does not depend on it): large groups
    have a member for each of their labels, tens of millions of entries, and all at once took
    ~70 bytes each beside the result's 8."""
    members, group_labels = sp.csr_matrix(members), sp.csr_matrix(group_labels)
    pair_group, pair_label = _pairs(group_labels)
    sizes = np.diff(members.indptr)[pair_group]
    parts = []
    for lo, hi in runs(sizes, chunk):
        starts, docs = _pair_members(members, pair_group[lo:hi])
        pair_of = np.repeat(np.arange(hi - lo), sizes[lo:hi])
        labels = pair_label[lo:hi][pair_of]
        q = np.clip(np.asarray(probability(docs, labels), np.float64), 1e-6, 1.0 - 1e-6)
        if not len(q):
            continue
        none = np.exp(np.add.reduceat(np.log1p(-q), starts[:-1]))[pair_of]  # every group has a member
        posterior = np.minimum(q / (1.0 - none), 1.0)
        keep = posterior >= floor
        keep[_first_best(posterior, starts, pair_of)] = True
        parts.append((docs[keep].astype(np.int32), labels[keep].astype(np.int32), posterior[keep].astype(np.float32)))
    docs, labels, posterior = _concatenated(parts, 3)
    out = sp.csr_matrix((posterior.astype(np.float32), (docs, labels)),
                        shape=(members.shape[1], group_labels.shape[1]))
    out.sum_duplicates()  # a document is in one group: no (document, label) twice
    return out


def _with_label_groups(features: Features, members: sp.csr_matrix, group_labels: sp.csr_matrix,
                       label_features: Features) -> tuple[Features, sp.csr_matrix, sp.csr_matrix]:
    """The data plus, per label some group carries, a group of one: the label's text, carrying it."""
    num_docs, num_labels = features.shape[0], group_labels.shape[1]
    carried = np.flatnonzero(np.diff(sp.csc_matrix(group_labels).indptr) > 0)
    k = len(carried)
    if isinstance(features, np.ndarray):
        stacked: Features = np.vstack([features, np.asarray(label_features, dtype=features.dtype)[carried]])
    else:
        stacked = sp.vstack([features, sp.csr_matrix(label_features)[carried]]).tocsr()
    ones = np.ones(k, np.float32)
    text_members = sp.csr_matrix((ones, (np.arange(k), num_docs + np.arange(k))), shape=(k, num_docs + k))
    wide = sp.csr_matrix((members.data, members.indices, members.indptr), shape=(members.shape[0], num_docs + k))
    text_labels = sp.csr_matrix((ones, (np.arange(k), carried)), shape=(k, num_labels))
    return stacked, sp.vstack([wide, text_members]).tocsr(), sp.vstack([group_labels, text_labels]).tocsr()


def _without(group_labels: sp.csr_matrix, held: np.ndarray) -> sp.csr_matrix:
    """group_labels with the held groups' rows emptied."""
    keep = np.ones(group_labels.shape[0], np.float32)
    keep[held] = 0.0
    visible = sp.csr_matrix(sp.diags(keep) @ group_labels)
    visible.eliminate_zeros()
    return visible


def _best_per_pair(scores: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per pair, the highest of its members' scores (scores[starts[p]:starts[p + 1]], not empty)."""
    # a pair without members (none in a valid grouping) would index past the end: clipped, unused
    return np.maximum.reduceat(scores, np.minimum(starts[:-1], len(scores) - 1))


def _first_best(scores: np.ndarray, starts: np.ndarray, pair_of: np.ndarray) -> np.ndarray:
    """Per pair with members (scores[starts[p]:starts[p + 1]], pair_of each entry's pair), the
    index of its highest score, the first of those tied with it."""
    if not len(scores):
        return np.zeros(0, np.int64)
    at = np.flatnonzero(scores == _best_per_pair(scores, starts)[pair_of])
    return at[np.r_[True, pair_of[at][1:] != pair_of[at][:-1]]]


def _keep_threshold(best: np.ndarray, ratio: float) -> np.ndarray:
    """The score a member needs to keep its group's label: ratio times the best member's (the best
    alone when that is not positive)."""
    return np.where(best > 0, ratio * best, best)


def _neighbour_weights(space: Space, queries: np.ndarray, pool: np.ndarray) -> sp.csr_matrix:
    """[len(queries), rows]: each query's _NEIGHBOURS most similar pool rows, weighted by their
    (non-negative) similarity, each row summing to 1 (0 without a positive similarity)."""
    k = min(_NEIGHBOURS, len(pool))
    rows, cols, vals = [], [], []
    for s in range(0, len(queries), _VALIDATION_CHUNK):
        sims = space.row_dots(queries[s : s + _VALIDATION_CHUNK], pool)
        top = (np.argpartition(-sims, k - 1, axis=1)[:, :k] if k < len(pool)
               else np.tile(np.arange(len(pool)), (len(sims), 1)))
        w = np.maximum(np.take_along_axis(sims, top, axis=1), 0.0)
        w /= np.maximum(w.sum(axis=1, keepdims=True), 1e-12)
        rows.append(np.repeat(np.arange(s, s + len(sims)), k))
        cols.append(pool[top].ravel())
        vals.append(w.ravel())
    return sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                         shape=(len(queries), space.num_rows))


def _r_precision(member_probs: sp.csr_matrix, member_group: np.ndarray, truth: sp.csr_matrix) -> float:
    """Mean over groups of the share of a group's labels (truth rows) among its top |labels| when
    labels are ranked by their largest probability among the group's members; labels tied at the
    cut share its last places (the expected share under a random order of the ties)."""
    num_groups, num_labels = truth.shape
    coo = member_probs.tocoo()
    if not coo.nnz:  # no held-out member has a neighbour with a label: nothing ranked, nothing found
        return 0.0
    keys = member_group[coo.row].astype(np.int64) * num_labels + coo.col
    order = np.argsort(keys, kind="stable")
    keys, probs = keys[order], coo.data[order].astype(np.float64)
    first = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, np.int64)
    group_max, keys = (np.maximum.reduceat(probs, first), keys[first]) if len(keys) else (probs, keys)
    group, wanted = keys // num_labels, np.diff(truth.indptr)
    carried = _lookup(truth, group, keys % num_labels) > 0
    # per group, how many labels rank strictly above a label, and how many share its probability
    by_rank = np.lexsort((-group_max, group))
    group_s, prob_s, carried_s = group[by_rank], group_max[by_rank], carried[by_rank]
    tie_start = np.flatnonzero(np.r_[True, (group_s[1:] != group_s[:-1]) | (prob_s[1:] != prob_s[:-1])])
    tie_size = np.diff(np.r_[tie_start, len(prob_s)])
    group_start = np.searchsorted(group_s, group_s[tie_start])
    above = tie_start - group_start  # labels of the group ranked before the tie
    slots = np.clip(wanted[group_s[tie_start]] - above, 0, tie_size)
    tie_hits = np.add.reduceat(carried_s.astype(np.float64), tie_start) if len(tie_start) else np.zeros(0)
    hits = np.bincount(group_s[tie_start], weights=tie_hits * slots / tie_size, minlength=num_groups)
    return float(np.mean(hits / np.maximum(wanted, 1)))


def _lookup(m: sp.csr_matrix, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """m[rows[k], cols[k]] for every k (0 where m has no entry), by binary search over m's keys."""
    m = sp.csr_matrix(m)
    m.sort_indices()
    width = np.int64(m.shape[1])
    keys = np.repeat(np.arange(m.shape[0], dtype=np.int64), np.diff(m.indptr)) * width + m.indices
    if not len(keys):
        return np.zeros(len(rows), np.float64)
    wanted = np.asarray(rows, np.int64) * width + np.asarray(cols, np.int64)
    at = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    return np.where(keys[at] == wanted, m.data[at], 0.0).astype(np.float64)


def _pairs(group_labels: sp.csr_matrix) -> tuple[np.ndarray, np.ndarray]:
    """(group, label) of every nonzero of the group x label matrix, grouped by group."""
    coo = group_labels.tocoo()
    order = np.lexsort((coo.col, coo.row))
    return coo.row[order].astype(np.int64), coo.col[order].astype(np.int64)


def _pair_members(members: sp.csr_matrix, pair_group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR-like (starts [P + 1], docs) of each pair's group members."""
    sizes = np.diff(members.indptr)[pair_group]
    starts = np.r_[0, np.cumsum(sizes)]
    offsets = np.arange(int(starts[-1])) - np.repeat(starts[:-1], sizes)
    docs = members.indices[np.repeat(members.indptr[pair_group], sizes) + offsets].astype(np.int64)
    return starts, docs


def _concatenated(parts: list[tuple[np.ndarray, ...]], width: int) -> tuple[np.ndarray, ...]:
    """The chunks' arrays joined column by column (width empty int64 arrays without a chunk)."""
    if not parts:
        return tuple(np.zeros(0, np.int64) for _ in range(width))
    return tuple(np.concatenate(column) for column in zip(*parts, strict=True))


def _label_by_doc(labels: np.ndarray, docs: np.ndarray, num_labels: int, num_docs: int) -> sp.csr_matrix:
    return sp.csr_matrix((np.ones(len(docs), np.float32), (labels, docs)), shape=(num_labels, num_docs))


