"""The scoring a bundle serves (alpha, calibrations f and g, lexical weight), tuned on validation
documents over the candidates the bundle will serve, scored by the engine's own code
(service.engine.candidates and service.engine.scorers): what is tuned is what is served."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from service.engine.candidates import CandidateSources
from service.engine.metrics import Truths, aggregate, document_terms, ranking_metrics, resampled_metrics
from service.engine.schema import Calibrations, Scoring
from service.engine.scorers import Calibration, LabelScorer, combine_scores, exact_chunk, top_k
from training.config import DEFAULT_OBJECTIVE, check_objective

log = logging.getLogger("shortlist.training")
# A sources' tuned scoring, its metrics, objective value, per-document terms, tuned in full.
_Valued = tuple[Scoring, dict[str, float], float, dict[str, np.ndarray], bool]

ALPHAS = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
# The logistic lexical score chose 0.3-0.5 on debian-tags validation: the grid reaches past it.
LEXICAL_WEIGHTS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)
CENTROID_CALIBRATIONS = tuple(Calibration("sigmoid", a, -a) for a in (1.0, 3.0, 5.0, 10.0, 20.0))
# The reference code's exp(d (x - 1)) on the paper form's cosine classifiers; a logit otherwise.
CLASSIFIER_CALIBRATIONS = {
    "paper": tuple(Calibration("exp", a, -a) for a in (1.0, 3.0, 5.0, 10.0)),
    "scaled_bias": (Calibration("sigmoid", 1.0, 0.0),),
}


# Paired bootstrap resamples of the validation documents behind "significantly below the best"
# (seeded: a checkpoint's tuning is deterministic), drawn this many (resample, document) counts
# at a time so that memory stays bounded for any validation size.
SOURCE_RESAMPLES = 1000
_RESAMPLE_CHUNK = 1 << 22


def objective_value(metrics: dict[str, Any], objective: dict[str, float]) -> Any:
    """The weighted sum of the metrics (floats, or arrays of per-resample values)."""
    return sum(weight * metrics[name] for name, weight in objective.items())


def objective_text(objective: dict[str, float]) -> str:
    """The objective as the sum it is ("P@1 + 0.5 PSP@5"): its dict read as if P@1 were 1.0."""
    return " + ".join(name if weight == 1 else f"{weight:g} {name}" for name, weight in objective.items())


def bootstrap_counts(n: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """int [resamples, n]: how often each of n documents is drawn in each bootstrap resample."""
    draws = rng.integers(0, n, (resamples, n)) + n * np.arange(resamples)[:, None]
    return np.bincount(draws.ravel(), minlength=resamples * n).reshape(resamples, n)


def below_shares(terms: Sequence[dict[str, np.ndarray]], best: int, objective: dict[str, float],
                 resamples: int = SOURCE_RESAMPLES, seed: int = 0) -> np.ndarray:
    """float [len(terms)]: per system (its `document_terms` on the same documents), the share of
    paired bootstrap resamples of the documents on which its objective is below system `best`'s."""
    n = len(next(iter(terms[best].values())))
    rng, below, done = np.random.default_rng(seed), np.zeros(len(terms)), 0
    while done < resamples:
        counts = bootstrap_counts(n, min(resamples - done, max(1, _RESAMPLE_CHUNK // max(n, 1))), rng)
        draws = [objective_value(resampled_metrics(t, counts, list(objective)), objective) for t in terms]
        below += [np.sum(d < draws[best]) for d in draws]
        done += len(counts)
    return below / resamples


def default_scoring(form: str, alpha: float, sources: CandidateSources, lexical_form: str) -> Scoring:
    """The untuned scoring (tune off): the reference calibrations, no lexical term."""
    f, g = ((Calibration("exp", 3.0, -3.0), Calibration("sigmoid", 1.0, 0.0)) if form == "paper"
            else (Calibration("sigmoid", 1.0, 0.0), Calibration("sigmoid", 10.0, -10.0)))
    return _scoring(form, alpha, f, g, 0.0, sources, lexical_form)


def _scoring(form: str, alpha: float, f: Calibration, g: Calibration, lexical_weight: float,
             sources: CandidateSources, lexical_form: str) -> Scoring:
    return Scoring(alpha=alpha, lexical_weight=lexical_weight, lexical_form=lexical_form, classifier_form=form,
                   calibration=Calibrations(classifier=f.spec(), centroid=g.spec()), shortlist=sources.spec)


def source_cost(sources: CandidateSources) -> tuple[int, int]:
    """How much a shortlist spec costs to serve, for ordering: HNSW searches (each a search per
    query and its index in memory), then the token rows looked up per query token."""
    spec = sources.spec
    return int(spec.k_w > 0) + int(spec.k_mu > 0), spec.k_tok


class ScoringTuner:
    """Grid search maximising `objective` (metric -> weight) on validation documents, over each
    of the candidate sources given; serves the cheapest sources (source_cost) that are not
    significantly below the best of all: below its objective on fewer than `level` of
    SOURCE_RESAMPLES paired bootstrap resamples of the validation documents (each resample
    scores both; seeded by `seed`), or within `margin` points of it (level 0: margin alone). A
    costlier source is then served only where it pays beyond the validation split's noise and by
    more than `margin`. After fit: `scoring_` (a manifest's schema.Scoring), `sources_` (the
    candidate sources chosen), `metrics_`, `value_` and `tried_` (each sources' spec, lexical
    form, value, "gap" to the best and "below_share" of resamples on which it is below it)."""

    def __init__(self, classifier_form: str = "scaled_bias", objective: dict[str, float] | None = None,
                 alphas: Sequence[float] = ALPHAS, lexical_weights: Sequence[float] = LEXICAL_WEIGHTS,
                 margin: float = 0.0, level: float = 0.95, seed: int = 0) -> None:
        self.classifier_form = classifier_form
        self.objective = dict(objective or DEFAULT_OBJECTIVE)
        check_objective(self.objective)
        if not (0.0 <= level <= 1.0 and margin >= 0):
            raise ValueError(f"level must be in [0, 1] and margin >= 0, got {level} and {margin}")
        self.alphas, self.lexical_weights = tuple(alphas), tuple(lexical_weights)
        self.margin, self.level, self.seed = float(margin), float(level), int(seed)

    def fit(self, q: np.ndarray, tokens: np.ndarray, token_weights: np.ndarray, truths: Truths,
            candidates: Sequence[CandidateSources], scorer: LabelScorer, own: np.ndarray | None = None) -> ScoringTuner:
        """q [N, D], tokens / token_weights [N, T]: the validation documents as served; truths
        built with inverse propensities; candidates: the sources (shortlist specs, lexical forms)
        to choose from (the first wins ties); own: per document a label id never predicted (-1: none).

        The full grid runs on the widest sources of each lexical form; every sources is valued at
        its form's tuned scoring, and tuned in full only before it is refused (not for a scoring
        tuned on other sources) or once chosen: a grid for each of 16 sources took 263 s of a
        10^4-label training on the shared machine."""
        served = [(sources, *sources(tokens, token_weights, q)) for sources in candidates]
        widest: dict[str, int] = {}
        for i, (sources, _, _) in enumerate(served):
            form = _form(sources)
            if form not in widest or source_cost(sources) > source_cost(served[widest[form]][0]):
                widest[form] = i
        grids = {form: self._grid(q, served[i][1], served[i][2], truths, served[i][0], scorer, own)
                 for form, i in widest.items()}
        results: list[_Valued] = []
        for i, (sources, cands, lexical) in enumerate(served):
            form = _form(sources)
            if i == widest[form]:
                results.append((*grids[form], True))
            else:
                scoring = grids[form][0].model_copy(update={"shortlist": sources.spec})
                results.append((scoring, *self._evaluate(q, cands, lexical, truths, scorer, own, scoring), False))

        def tune_in_full(i: int) -> None:
            results[i] = (*self._grid(q, served[i][1], served[i][2], truths, served[i][0], scorer, own), True)

        i = self._choose([s for s, _, _ in served], results, tune_in_full)
        self.scoring_, self.metrics_, self.value_, _, _ = results[i]
        self.sources_, cands = served[i][0], served[i][1]
        self.mean_candidates_ = float(np.mean((cands >= 0).sum(axis=1)))
        return self

    def _choose(self, sources: list[CandidateSources], results: list[_Valued],
                tune_in_full: Callable[[int], None]) -> int:
        """The cheapest sources not significantly below the best, tuned in full (each one in
        `results` tuned in full before it is refused); all logged and kept in `tried_`."""
        def best() -> int:
            return int(np.argmax([r[2] for r in results]))

        def acceptable(i: int) -> bool:
            top = best()
            below = below_shares([results[top][3], results[i][3]], 0, self.objective, seed=self.seed)[1]
            return bool(below < self.level or results[i][2] >= results[top][2] - self.margin)

        order = sorted(range(len(sources)), key=lambda i: (source_cost(sources[i]), -results[i][2]))
        chosen = order[-1]
        for i in order:
            ok = acceptable(i)
            if not ok and not results[i][4]:
                tune_in_full(i)
                ok = acceptable(i)
            if ok:
                chosen = i
                break
        if not results[chosen][4]:
            tune_in_full(chosen)
        self._report(sources, results, best())
        return chosen

    def _report(self, sources: list[CandidateSources], results: list[_Valued], best: int) -> None:
        values = [r[2] for r in results]
        below = below_shares([r[3] for r in results], best, self.objective, seed=self.seed)
        self.tried_ = []
        for src, (_, _, value, _, full), share in zip(sources, results, below, strict=True):
            spec, gap = src.spec, value - values[best]
            log.info("k_w=%d k_mu=%d k_tok=%d, lexical form %s: validation %s = %.3f%s (%+.3f to the best, below "
                     "it on %.1f%% of resamples)", spec.k_w, spec.k_mu, spec.k_tok, _form(src),
                     objective_text(self.objective), value, "" if full else " at its form's scoring", gap, 100 * share)
            self.tried_.append({**spec.model_dump(), "lexical_form": _form(src), "value": round(value, 3),
                                "tuned_in_full": full, "gap": round(gap, 3), "below_share": round(float(share), 3)})

    def _evaluate(self, q: np.ndarray, cands: np.ndarray, lexical: np.ndarray | None, truths: Truths,
                  scorer: LabelScorer, own: np.ndarray | None,
                  scoring: Scoring) -> tuple[dict[str, float], float, dict[str, np.ndarray]]:
        """The metrics, objective and per-document terms of one scoring on these candidates."""
        logits, sims = scorer.dots(q, cands)
        cal = scoring.calibration
        scores = combine_scores(logits, sims, scoring.alpha, Calibration.of(cal.classifier),
                                Calibration.of(cal.centroid), lexical, scoring.lexical_weight)
        scores = np.array(scores)  # a copy: an identity calibration hands back its input
        scores[_invalid(cands, own)] = -np.inf
        terms = document_terms(_top5(cands, scores), truths, (1, 5))
        metrics = aggregate(terms)
        return {k: float(v) for k, v in metrics.items()}, objective_value(metrics, self.objective), terms

    def _grid(self, q: np.ndarray, cands: np.ndarray, lexical: np.ndarray | None, truths: Truths,
              sources: CandidateSources, scorer: LabelScorer,
              own: np.ndarray | None) -> tuple[Scoring, dict, float, dict[str, np.ndarray]]:
        logits, sims = scorer.dots(q, cands)
        invalid = _invalid(cands, own)
        lexical_form = sources.table.form if sources.table is not None else "shares"
        best: tuple[float, Scoring, dict[str, float], dict[str, np.ndarray]] | None = None
        for fi, f in enumerate(CLASSIFIER_CALIBRATIONS[self.classifier_form]):
            for g in CENTROID_CALIBRATIONS:
                for alpha in self.alphas:
                    if alpha == 0.0 and fi > 0:
                        continue  # f is irrelevant at alpha 0
                    mixed = combine_scores(logits, sims, alpha, f, g)
                    for lam in self.lexical_weights if lexical is not None else (0.0,):
                        scores = mixed + lam * lexical if lam else mixed.copy()
                        scores[invalid] = -np.inf
                        terms = document_terms(_top5(cands, scores), truths, (1, 5))
                        metrics = aggregate(terms)
                        value = objective_value(metrics, self.objective)
                        if best is None or value > best[0]:
                            best = (value, _scoring(self.classifier_form, alpha, f, g, lam, sources, lexical_form),
                                    metrics, terms)
        assert best is not None
        return best[1], {k: float(v) for k, v in best[2].items()}, best[0], best[3]


def _form(sources: CandidateSources) -> str:
    return sources.table.form if sources.table is not None else "none"


def _invalid(cands: np.ndarray, own: np.ndarray | None) -> np.ndarray:
    invalid = cands < 0
    if own is not None:
        invalid |= cands == own[:, None]
    return invalid


def _top5(cands: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """The 5 best candidates of each row as the engine ranks them (-1 where fewer are finite)."""
    idx, best = top_k(scores, 5)
    ids = cands[np.arange(len(cands))[:, None], idx]
    return np.where(np.isfinite(best), ids, -1)


def exact_metrics(scorer: LabelScorer, q: np.ndarray, truths: Truths, alpha: float) -> dict[str, float]:
    """P@k and PSP@k of the scorer over all labels (no shortlist, no lexical term), rounded."""
    ids, _ = scorer.exact_top_k(q, 5, alpha)
    m = ranking_metrics(ids, truths, (1, 3, 5))
    return {k: round(float(m[k]), 3) for k in ("P@1", "P@3", "P@5", "nDCG@5", "PSP@1", "PSP@3", "PSP@5")}


def classifier_objective(q: np.ndarray, weights: np.ndarray, bias: np.ndarray, truths: Truths,
                         objective: dict[str, float], own: np.ndarray | None = None) -> float:
    """`objective` of the classifiers alone (w_l . q + b_l) over all labels, exactly: the
    validation value Module III's early stop watches. own: per query a label never predicted."""
    ids = np.empty((len(q), 5), dtype=np.int64)
    chunk = exact_chunk(len(weights))
    for start in range(0, len(q), chunk):
        part = slice(start, start + chunk)
        scores = q[part] @ weights.T + bias
        if own is not None:
            rows = np.flatnonzero(own[part] >= 0)
            scores[rows, own[part][rows]] = -np.inf
        ids[part] = top_k(scores, 5)[0]
    return float(objective_value(ranking_metrics(ids, truths, (1, 5)), objective))
