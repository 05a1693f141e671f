"""Prediction over an opened bundle: tokenise, encode, shortlist, score, top k."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from service.engine import canary
from service.engine.bundle import Bundle
from service.engine.candidates import AddedLabels, CandidateSources
from service.engine.query import EncodedQueries, QueryEncoder
from service.engine.schema import CLASSIFIERS, MAX_MANIFEST_BYTES, BundleError, HeadMode, Scoring
from service.engine.scorers import LabelScorer, top_k


class Prediction(NamedTuple):
    id: int
    uid: str
    title: str
    score: float


# Per text, label ids never to return (Predictor.predict_ids).
Exclusions = Sequence[Collection[int]]
# Queries shortlisted and scored at once: a pass holds [rows, C] candidate ids, their scores and
# lexical terms (C the rows' longest shortlist), and glibc's heap keeps what a pass grew it to.
# debian-deps, the test split in batches of 1000: the heap grew by 25 MiB at 1000 a pass, by 9
# at 128, at the same queries/s (bench/RESULTS.md, issue 21).
QUERIES_PER_PASS = 128


@dataclass(frozen=True)
class PredictorOptions:
    """How one Predictor departs from its bundle's scoring (None: the bundle's value).

    threads: onnxruntime intra-op threads of each encoder call; ef_search: HNSW search breadth
    (a Predictor with its own value searches its own copy of the index); k_w, k_mu, k_head,
    k_tok, head, k_added: the shortlist's sources (schema.Shortlist); lexical_weight: lambda (0
    by default when k_tok is 0, since the lexical score reads the token rows).
    """

    threads: int = 1
    ef_search: int | None = None
    k_w: int | None = None
    k_mu: int | None = None
    k_head: int | None = None
    k_tok: int | None = None
    head: HeadMode | None = None
    k_added: int | None = None
    lexical_weight: float | None = None
    # False: no encoder session; queries come encoded (predict_encoded_ids), as a shard's do.
    encoder: bool = True

    def scoring(self, bundle_scoring: Scoring) -> Scoring:
        """The bundle's scoring with these options applied, validated as a manifest's is."""
        shortlist = bundle_scoring.shortlist.model_dump()
        for name in ("k_w", "k_mu", "k_head", "k_tok", "head", "k_added"):
            if getattr(self, name) is not None:
                shortlist[name] = getattr(self, name)
        lexical_weight = self.lexical_weight
        if lexical_weight is None:
            lexical_weight = bundle_scoring.lexical_weight if shortlist["k_tok"] else 0.0
        fields = {**bundle_scoring.model_dump(), "shortlist": shortlist, "lexical_weight": lexical_weight}
        return Scoring.model_validate(fields)


class TreeRoute:
    """A bundle's queries encoded and its tree scorer's route (/v1/predict/tree): what loads
    without the alpha route's shortlist sources and label vectors (Predictor adds them), so
    that a load checks the tree's answers before those are in memory (Predictor.checked).

    All methods are safe to call from several threads at once.
    """

    def __init__(self, bundle: Bundle, options: PredictorOptions | None = None) -> None:
        self.bundle = bundle
        self.options = options or PredictorOptions()
        self.encoder = bundle.encoder(self.options.threads) if self.options.encoder else None
        self.queries = QueryEncoder(bundle.tokenizer, self.encoder) if self.encoder is not None else None
        # Retired labels (service.engine.label_changes) are never returned, by any scorer.
        self.retired = bundle.retired
        # The tree nodes above a live label, once per bundle (a label change is a new bundle):
        # the tree's beam never spends a place on a retired label (TreeScorer.live_nodes).
        self.tree_live = None if bundle.tree is None else bundle.tree.live_nodes(self.retired)

    @property
    def version(self) -> str:
        return self.bundle.version

    @property
    def num_labels(self) -> int:
        return self.bundle.manifest.num_labels

    @property
    def tree_serves(self) -> bool:
        """Does the tree route have a label to answer: a tree holding a label not retired? (Labels
        added since training are not in the tree: with every trained label retired, it answers
        nothing, to any text.)"""
        return self.bundle.tree is not None and (self.tree_live is None or bool(self.tree_live[0]))

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode(texts)[2]

    def _encode(self, texts: Sequence[str]) -> EncodedQueries:
        """Padded token ids [B, T], their weights [B, T] and unit embeddings [B, D]."""
        if self.queries is None:
            raise LookupError("this predictor has no encoder (PredictorOptions.encoder=False): predict_encoded_ids")
        return self.queries(texts)

    def predict_tree_ids(
        self, texts: Sequence[str], k: int = 10, beam: int | None = None, exclude: Exclusions | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        tree = self.bundle.tree
        if tree is None:
            raise LookupError(f"bundle {self.version} has no tree scorer")
        _check_k(k)
        if beam is not None and beam < 1:
            raise ValueError(f"beam must be >= 1, got {beam}")
        excluded = self._check_exclude(exclude, len(texts))
        tokens, weights, q = self._encode(texts)
        if excluded is None:
            ids, scores = tree.search(q, k, beam, (tokens, weights), self.tree_live)
            return _pad(ids, scores, k)
        # The best k + |exclusions| leaves hold the best k that are not excluded.
        ids, scores = tree.search(q, k + max(len(x) for x in excluded), beam, (tokens, weights), self.tree_live)
        scores[_excluded_mask(ids, excluded)] = -np.inf
        idx, best = top_k(scores, k)
        return _pad(ids[np.arange(len(ids))[:, None], idx], best, k)

    def _check_exclude(self, exclude: Exclusions | None, rows: int) -> list[np.ndarray] | None:
        """exclude as one int64 id array per text; None when nothing is excluded."""
        if exclude is None:
            return None
        if len(exclude) != rows:
            raise ValueError(f"exclude has {len(exclude)} rows for {rows} texts")
        out = []
        for row, ids in enumerate(exclude):
            arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
            if arr.size == 0:
                out.append(np.zeros(0, dtype=np.int64))
                continue
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise ValueError(f"exclude[{row}]: expected a list of integer label ids")
            if arr.min() < 0 or arr.max() >= self.num_labels:
                raise ValueError(f"exclude[{row}]: label ids must be in [0, {self.num_labels})")
            out.append(arr.astype(np.int64, copy=False))
        return out if any(len(ids) for ids in out) else None

    def predict_tree(
        self, texts: Sequence[str], k: int = 10, beam: int | None = None, exclude: Exclusions | None = None
    ) -> list[list[Prediction]]:
        return self._named(*self.predict_tree_ids(texts, k, beam, exclude))

    def _named(self, ids: np.ndarray, scores: np.ndarray) -> list[list[Prediction]]:
        id_rows = ids.tolist()
        named = iter(self.bundle.labels.named([i for row in id_rows for i in row if i >= 0]))
        return [
            [Prediction(i, (label := next(named))["uid"], label["title"], s)
             for i, s in zip(row_ids, row_scores, strict=True) if i >= 0]
            for row_ids, row_scores in zip(id_rows, scores.tolist(), strict=True)
        ]


class Predictor(TreeRoute):
    """Log-time top-k over a bundle (DESIGN.md, "Log-time prediction"): the candidates of
    service.engine.candidates scored by service.engine.scorers.LabelScorer; and the tree route.

    All methods are safe to call from several threads at once.
    """

    def __init__(self, bundle: Bundle, options: PredictorOptions | None = None) -> None:
        super().__init__(bundle, options)
        self.scoring = self.options.scoring(bundle.manifest.scoring)
        spec = self.scoring.shortlist
        ef = self.options.ef_search
        table = bundle.token_table() if spec.k_tok else None
        self.sources = CandidateSources(
            spec, bundle.classifier_bias,
            index_w=bundle.index("w", ef) if spec.k_w else None,
            index_mu=bundle.index("mu", ef) if spec.k_mu else None,
            table=table, lexical=bool(self.scoring.lexical_weight),
            added=_added_labels(bundle) if spec.k_added else None,
        )
        w, mu = bundle.label_vectors()
        self.scorer = LabelScorer.of(w, bundle.classifier_bias, mu, self.scoring,
                                     (bundle.classifier_scales, bundle.centroid_scales))

    @classmethod
    def load(cls, path: str | Path, options: PredictorOptions | None = None, *,
             max_manifest_bytes: int = MAX_MANIFEST_BYTES, staged: bool = False) -> Predictor:
        """Open the bundle at `path`, check it (files, shapes, sources, canaries) and predict
        with `options`; raises BundleError naming what is wrong, releasing what was opened.
        `max_manifest_bytes`: the most of manifest.json read (Bundle.open). `staged`: a bundle
        still in its staging directory, its canaries recorded (check_staged)."""
        try:
            bundle = Bundle.open(path, max_manifest_bytes=max_manifest_bytes, staged=staged)
        except BundleError:
            raise
        except Exception as exc:  # a reader's own error type on a damaged file: still a refusal
            raise BundleError(f"{path}: cannot be opened: {type(exc).__name__}: {exc}") from exc
        return cls.checked(bundle, options)

    @classmethod
    def checked(cls, bundle: Bundle, options: PredictorOptions | None = None) -> Predictor:
        """A predictor over an opened bundle, its canaries checked (what `load` does after opening);
        raises BundleError naming what is wrong, closing the bundle."""
        try:
            if bundle.tree is not None and (options or PredictorOptions()).encoder:
                # The tree route's canaries first, and its pages handed back before the index and
                # label vectors load: its searches read ~26 MiB of tree.npz (debian-deps), which
                # a load then never holds beside those (peak RSS -30 MiB).
                canary.check_tree(TreeRoute(bundle, options))
                bundle.release_pages()
            predictor = cls(bundle, options)
            if predictor.encoder is not None:  # else its caller checks them (ShardPredictor.check_canaries)
                canary.check(predictor if predictor.answers_as_exported else cls(bundle), tree=False)
                bundle.release_pages()
        except BundleError:
            bundle.close()
            raise
        except Exception as exc:  # anything else on the load path also disqualifies the bundle
            bundle.close()
            raise BundleError(f"{bundle.path}: {type(exc).__name__}: {exc}") from exc
        return predictor

    @property
    def answers_as_exported(self) -> bool:
        """Does this predictor answer as export's did (the bundle's scoring and search breadth)?"""
        ef = self.options.ef_search
        return self.scoring == self.bundle.manifest.scoring and ef in (None, self.bundle.manifest.hnsw.ef_search)

    @property
    def alpha(self) -> float:
        return self.scoring.alpha

    def shortlist(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The candidate labels S of each text (sorted label ids) that can be answered: a retired
        label the indices still find is scored out of every answer, so it is left out here too
        (shortlist recall counted it as found)."""
        tokens, weights, q = self._encode(texts)
        rows = self.sources(tokens, weights, q)[0]
        if self.retired is None:
            return [row[row >= 0] for row in rows]
        return [row[(row >= 0) & ~self.retired[np.maximum(row, 0)]] for row in rows]

    def _check_alpha(self, alpha: float | None) -> float:
        a = self.alpha if alpha is None else float(alpha)
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        return a

    def predict_ids(
        self, texts: Sequence[str], k: int = 10, alpha: float | None = None, exclude: Exclusions | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k label ids int64 [B, k] (-1 where fewer were found) and scores float32 [B, k].

        exclude: per text, label ids never to return (the text's own label when texts and labels
        are the same kind of thing, items a user has already); the rest of S is ranked as usual.
        """
        return self.predict_encoded_ids(self._encode(texts), k, alpha, exclude)

    def predict_encoded_ids(
        self, queries: EncodedQueries, k: int = 10, alpha: float | None = None, exclude: Exclusions | None = None,
        head: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """predict_ids of queries encoded already (QueryEncoder of a bundle with this one's
        tokenizer and encoder: the shards of one parent share them).

        head: bool [B], whether the head joins each query's shortlist, overriding the "fallback"
        rule's own test (no query token has a label in its row), which a shard cannot make for
        its parent: its rows hold only its own labels (service.engine.sharding).
        """
        _check_k(k)
        a = self._check_alpha(alpha)
        excluded = self._check_exclude(exclude, len(queries.q))
        n = len(queries.q)
        if n <= QUERIES_PER_PASS:
            return self._predict_pass(queries, k, a, excluded, head)
        parts = [self._predict_pass(EncodedQueries(*(x[i : i + QUERIES_PER_PASS] for x in queries)), k, a,
                                    None if excluded is None else excluded[i : i + QUERIES_PER_PASS],
                                    None if head is None else head[i : i + QUERIES_PER_PASS])
                 for i in range(0, n, QUERIES_PER_PASS)]
        return np.concatenate([ids for ids, _ in parts]), np.concatenate([scores for _, scores in parts])

    def _predict_pass(self, queries: EncodedQueries, k: int, a: float, excluded: list[np.ndarray] | None,
                      head: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        tokens, weights, q = queries
        cands, lexical = self.sources(tokens, weights, q, head)
        scores = self.scorer.score(q, cands, a, lexical)
        if excluded is not None:
            scores[_excluded_mask(cands, excluded)] = -np.inf
        if self.retired is not None:
            scores[self.retired[np.maximum(cands, 0)]] = -np.inf
        idx, best = top_k(scores, k)
        return _pad(cands[np.arange(len(cands))[:, None], idx], best, k)

    def predict_exact_ids(
        self, texts: Sequence[str], k: int = 10, alpha: float | None = None, exclude: Exclusions | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The same scores over all L labels (brute force): the baseline the shortlist approximates."""
        _check_k(k)
        a = self._check_alpha(alpha)
        excluded = self._check_exclude(exclude, len(texts))
        tokens, weights, q = self._encode(texts)
        table, k_tok = self.sources.table, self.scoring.shortlist.k_tok

        def lexical(rows: slice) -> np.ndarray:
            return table.dense_scores(tokens[rows], weights[rows], self.num_labels, k_tok)

        if self.retired is not None:
            retired = np.flatnonzero(self.retired)
            excluded = [np.concatenate((retired, row)) for row in excluded or [np.zeros(0, np.int64)] * len(texts)]
        ids, best = self.scorer.exact_top_k(q, k, a, lexical if table is not None else None, excluded)
        return _pad(ids, best, k)

    def predict(
        self, texts: Sequence[str], k: int = 10, alpha: float | None = None, exclude: Exclusions | None = None
    ) -> list[list[Prediction]]:
        return self._named(*self.predict_ids(texts, k, alpha, exclude))


def _added_labels(bundle: Bundle) -> AddedLabels:
    """The live labels a derived bundle added after training (rows tree_labels..L-1)."""
    ids = np.arange(bundle.manifest.tree_labels, bundle.manifest.num_labels)
    if bundle.retired is not None:
        ids = ids[~bundle.retired[ids]]
    return AddedLabels(ids, bundle.vector_rows(CLASSIFIERS, ids), bundle.classifier_bias[ids])


def _check_k(k: int) -> None:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")


def _excluded_mask(ids: np.ndarray, excluded: list[np.ndarray]) -> np.ndarray:
    """True where a row of label ids [B, C] holds one of that row's excluded ids."""
    mask = np.zeros(ids.shape, dtype=bool)
    for row, drop in enumerate(excluded):
        if len(drop):
            mask[row] = np.isin(ids[row], drop)
    return mask


def _pad(ids: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad to width k with id -1; turn -inf (duplicates, empty slots) into -1 as well.

    Changes ids and scores in place: callers pass arrays they have just made.
    """
    ids = ids.astype(np.int64, copy=False)
    scores = scores.astype(np.float32, copy=False)
    finite = np.isfinite(scores)
    if not finite.all():
        invalid = ~finite
        ids[invalid] = -1
        scores[invalid] = 0.0
    if ids.shape[1] < k:  # (np.pad does the same with a dozen calls more)
        rows, width = ids.shape
        padded_ids = np.full((rows, k), -1, dtype=np.int64)
        padded_scores = np.zeros((rows, k), dtype=np.float32)
        padded_ids[:, :width], padded_scores[:, :width] = ids, scores
        return padded_ids, padded_scores
    return ids, scores


def check_staged(staging: Path, final: Path) -> None:
    """The bundle written in `staging` passes the checks a load runs (Predictor.load), before its
    writer renames it to `final`: one the service would refuse is never left under its final name
    (`serve` would then start on a fallback). The BundleError names it by `final`, since its writer
    removes the staging directory."""
    try:
        Predictor.load(staging, staged=True).bundle.close()
    except BundleError as exc:
        raise BundleError(f"{str(exc).replace(str(staging), str(final))} (refused before the rename: nothing was "
                          "written)") from exc
