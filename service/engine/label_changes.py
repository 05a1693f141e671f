"""Labels added and retired after training: a new bundle derived from a served one, no retraining.

The encoder reads label text, so a label never seen in training has a meaningful vector the
moment its text is known (SiameseXML's Module I: E(z_l) is where a label's classifier starts).
An added label gets, from its text z (title, and content where the bundle was trained on
title+content):
- a classifier w = s E(z), s the median length of the trained classifiers (1 for the paper's
  unit classifiers), and a bias b: the `prior_quantile` quantile of the trained labels' biases
  (a label with no training data gets a typical prior, not the head's nor the tail's);
- a centroid mu = E(z) (what training gives a label with no documents: centroid_label_weight
  adds the label's own embedding to the mean of none);
- a row in both HNSW indices (hnswlib insertion into a copy of the parent's graphs);
- with a token table: a slot in the overflow row of every token of z. The table's rows are
  fixed at training (20 labels, full for frequent words), so added labels get rows of their
  own beside it, served in full beside the first k_tok of the table's rows: per token at most
  `overflow_width` added labels, the ones whose texts weigh that token most. A slot's weight is
  x_t s_lex (x_t: the token's tf-idf weight in z, s_lex: the `lexical_quantile` quantile of the
  table's positive served weights), and the logistic form's bias for the label is the
  `prior_quantile` quantile of the trained labels' lexical biases.
The tree scorer (/v1/predict/tree) is not extended: it serves the labels it was trained on
(manifest lineage.tree_labels) until the next training.

A retired label keeps its row (label ids never move) and is listed in labels_retired.npy: no
scorer returns it. Its uid is never reused for another label. Ids and uids given out on another
version derived from the same base (one rolled back) are filled in as retired rows first, with
zero vectors (`given_out`, service.engine.label_ledger): an id never names two labels.

Every change writes a whole new bundle through a staging directory renamed into place, files
the change leaves alone shared with the parent by hard link (a copy where the filesystem
cannot link), never written: the parent stays as it was, and the new bundle passes every check
an exported one does, its canaries recorded again.
"""

from __future__ import annotations

import json
import shutil
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service.engine import canary, schema, store, vectors
from service.engine.bundle import Bundle
from service.engine.predictor import Predictor, check_staged
from service.engine.small_files import save_array
from service.engine.tokenizer import is_blank

GIVEN_OUT_TITLE = "(given out on another version derived from the same base)"
OVERFLOW_FILES = (schema.TOKEN_OVERFLOW, schema.TOKEN_OVERFLOW_WEIGHTS)


@dataclass(frozen=True)
class NewLabel:
    """A label to add. prior: how common it is expected to be, as a quantile of the trained labels'
    priors (None: the editor's prior_quantile); a label's text says what it is, not how often it
    will be used."""

    uid: str
    title: str
    content: str | None = None
    prior: float | None = None


@dataclass(frozen=True)
class LabelChange:
    """Labels to add (by text) and to retire (by uid), applied together as one new version."""

    add: Sequence[NewLabel] = ()
    retire: Sequence[str] = ()


class LabelChangeRejected(ValueError):
    """A change that cannot be applied to its parent bundle: `problems` are (field, message)
    pairs, the field as a request names it ("add[3].uid", "retire[0]")."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{f}: {m}" for f, m in problems))
        self.problems = problems


@dataclass
class ChangeReport:
    version: str
    parent: str
    added: int
    retired: int
    num_labels: int
    tree_labels: int
    seconds: float
    shared: dict[str, str] = field(default_factory=dict)  # file -> "link" | "copy"


class LabelEditor:
    """Derives bundles with labels added and retired.

    prior_quantile: the quantile of the trained labels' biases (classifier and lexical) an added
    label gets; lexical_quantile: the quantile of the token table's positive served weights that
    scales an added label's slots; overflow_width: added labels kept per token. The default
    quantiles come from grids on validation documents of debian-tags and debian-deps (10% of
    the labels held out of training and added; bench/live_labels.py --tune, bench/RESULTS.md
    "labels", "live-labels:debian-deps"): a label with no training data does best with a high
    prior, near the top of the trained labels' (debian-tags: the median lost 9 points of held-out
    recall@10, the maximum 14 of P@1); a lexical quantile of 0.5 scores as 0.9 on debian-tags
    (objective 175.71 against 175.87) and keeps debian-deps' P@1 (56.79 against 49.52 at 0.9).
    added_shortlist: k of an exact search over the added labels' w.q + b in every derived bundle
    (0: none); hinted_shortlist: that k once a label is added with a prior hint (NewLabel.prior).
    On debian-deps (4,224 labels held out, the served model's validation documents: the proxy of
    bench/live_labels_proxy.py) a hint without the search served held-out recall@10 16.15 (the
    labels' exact scores 59.20: a hinted common label sits outside its words' token rows), with
    it 59.34; without hints the search changed nothing (8.12 either way); on the model trained
    without those labels (bench/live_labels.py) hints reached 56.90 with or without it. Its cost per query is
    one [D] x [D, added] product: ~1 KB of float32 per added label.
    """

    def __init__(self, prior_quantile: float = 0.95, lexical_quantile: float = 0.5, overflow_width: int = 32,
                 text_map_l2: float | None = None, text_map_labels: int = 50_000, seed: int = 0,
                 added_shortlist: int = 0, lexical_per_token: bool = False, hinted_shortlist: int = 50) -> None:
        for name, q in (("prior_quantile", prior_quantile), ("lexical_quantile", lexical_quantile)):
            if not 0.0 <= q <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {q}")
        if overflow_width < 1:
            raise ValueError(f"overflow_width must be >= 1, got {overflow_width}")
        if text_map_l2 is not None and not text_map_l2 > 0:
            raise ValueError(f"text_map_l2 must be > 0 (or None: no map), got {text_map_l2}")
        if text_map_labels < 1:
            raise ValueError(f"text_map_labels must be >= 1, got {text_map_labels}")
        for name, k in (("added_shortlist", added_shortlist), ("hinted_shortlist", hinted_shortlist)):
            if k < 0:
                raise ValueError(f"{name} must be >= 0, got {k}")
        self.prior_quantile = prior_quantile
        self.lexical_quantile = lexical_quantile
        self.overflow_width = overflow_width
        self.text_map_l2 = text_map_l2
        self.text_map_labels = text_map_labels
        self.seed = seed
        self.added_shortlist = added_shortlist
        self.hinted_shortlist = hinted_shortlist
        self.lexical_per_token = lexical_per_token

    def derive(self, parent: Bundle, change: LabelChange, out_root: str | Path, version: str,
               given_out: Sequence[str] = (), before_commit: Callable[[], None] | None = None,
               check: bool = False) -> ChangeReport:
        """Write OUT_ROOT/VERSION: `parent` with `change` applied. Raises LabelChangeRejected
        (nothing written) when the change does not fit the parent. `given_out`: the uids of the
        ids past the parent's rows given out on other versions of its base (with labels to add:
        retired rows first, so the added labels get the next ids); `check`: the staged bundle
        passes the checks a load runs (Predictor.load), else BundleError with nothing written
        (the service checks at activation instead, in a child process, and sets a refused
        version aside); `before_commit`: called once the bundle is staged (and checked), before
        it is renamed into place."""
        t0 = time.perf_counter()
        given_out = list(given_out) if change.add else []
        retired = _check_change(parent, change, given_out)
        ids, weights = _encode_new(parent, change.add)
        ids, weights = (np.vstack((np.zeros((len(given_out), a.shape[1]), a.dtype), a)) for a in (ids, weights))
        rows = len(parent.labels) + len(given_out) + len(change.add)
        out_root = Path(out_root)
        staging = store.staging_dir(out_root, version)
        try:
            plan = _Plan(parent, staging)
            if change.add:
                self._write_added(plan, change.add, ids, weights, given_out)
            if change.add or schema.TOKEN_OVERFLOW in parent.manifest.files:
                self._write_overflow(plan, ids, weights, retired)
            old = parent.retired if parent.retired is not None else np.zeros(len(parent.labels), bool)
            all_retired = np.flatnonzero(np.concatenate((old | _mask(retired, len(old)), np.ones(len(given_out), bool),
                                                         np.zeros(len(change.add), bool))))
            if len(all_retired):
                plan.save(schema.RETIRED_LABELS, all_retired.astype(np.int32))
            shared = plan.share_the_rest()
            lineage = schema.Lineage(
                parent=parent.version, base=parent.manifest.lineage.base if parent.manifest.lineage else parent.version,
                added=len(change.add), retired=len(retired), tree_labels=parent.manifest.tree_labels)
            fields = _manifest_fields(parent, version, rows, lineage)
            if fields["num_labels"] > lineage.tree_labels:
                fields["scoring"]["shortlist"]["k_added"] = self._added_search(parent, change)
            linked = {name: parent.manifest.files[name] for name, how in shared.items() if how == "link"}
            written = store.write_manifest(staging, fields, known=linked)
            fields["canary"] = _canaries(staging, [c.text for c in parent.manifest.canary])
            store.write_manifest(staging, fields, known=written.files)
            if check:
                check_staged(staging, out_root / version)
            if before_commit is not None:
                before_commit()
            store.finalize_bundle(staging, out_root, version)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return ChangeReport(version, parent.version, len(change.add), len(retired), rows, lineage.tree_labels,
                            time.perf_counter() - t0, shared)

    def _added_search(self, parent: Bundle, change: LabelChange) -> int:
        """k of the exact search over the added labels (Shortlist.k_added). A label added with a
        prior hint may be common, and a common label reaches queries through its documents' words,
        which its own text need not share: with a hint the search is on (hinted_shortlist), and
        it stays on in every version derived from then on."""
        hinted = self.hinted_shortlist if any(label.prior is not None for label in change.add) else 0
        return max(self.added_shortlist, hinted, parent.manifest.scoring.shortlist.k_added)

    def _write_added(self, plan: _Plan, add: Sequence[NewLabel], ids: np.ndarray, weights: np.ndarray,
                     given_out: Sequence[str]) -> None:
        parent = plan.parent
        gap = len(given_out)
        emb = parent.encoder(1).run(ids[gap:], weights[gap:])
        trained = parent.manifest.tree_labels
        scales = parent.classifier_scales
        scale = float(np.median(vectors.row_norms(parent.classifiers[:trained],
                                                  None if scales is None else scales[:trained])))
        prior = float(np.quantile(parent.classifier_bias[:trained], self.prior_quantile))  # the text map's base
        new_w, new_mu = scale * emb, emb
        new_b = self._priors(parent.classifier_bias[:trained], add)
        if self.text_map_l2 is not None:
            fitted = TextMap.fit(parent, scale, prior, self.text_map_l2, self.text_map_labels, self.seed)
            new_w, new_b, new_mu = fitted.apply(_embed_titles(parent, [lab.title for lab in add]), new_w, new_b, new_mu)
        new_w, new_b, new_mu = _given_out_first(gap, float(np.min(parent.classifier_bias[:trained])),
                                                new_w, new_b, new_mu)
        # The label vectors in the parent's dtype (the parent's rows as they are); the indices
        # get the stored values, as export gives them.
        dtype = parent.manifest.vector_dtype
        w, w_scales, added_w = vectors.appended(parent.classifiers, parent.classifier_scales, new_w, dtype)
        b = np.concatenate((parent.classifier_bias, new_b)).astype(np.float32)
        mu, mu_scales, added_mu = vectors.appended(parent.centroids, parent.centroid_scales, new_mu, dtype)
        for name, array in ((schema.CLASSIFIERS, w), (schema.CLASSIFIER_BIAS, b), (schema.CENTROIDS, mu),
                            (schema.CLASSIFIER_SCALES, w_scales), (schema.CENTROID_SCALES, mu_scales)):
            if array is not None:
                plan.save(name, array)
        first, ref = len(parent.labels), np.arange(min(256, len(parent.labels)))
        for name, file, added, reference in (
            ("w", schema.HNSW_W, np.hstack((added_w, b[first:, None])),
             np.hstack((parent.vector_rows(schema.CLASSIFIERS, ref), parent.classifier_bias[ref, None]))),
            ("mu", schema.HNSW_MU, added_mu, parent.vector_rows(schema.CENTROIDS, ref)),
        ):
            # Checked as serving checks it (checksum, structure): a bundle whose scoring searches
            # no index activates without reading one, so a change may be the first to read it.
            index = parent.index_copy(name)
            index.add(added, reference)
            # A projected index keeps its parent's projection (rewritten, the same values).
            plan.written.update(p.name for p in index.save(plan.staging / file))
        labels_path = plan.staging / schema.LABELS
        _from_parent(parent.path / schema.LABELS, lambda src: shutil.copyfile(src, labels_path))
        with labels_path.open("a", encoding="utf-8") as f:
            rows = [*((uid, GIVEN_OUT_TITLE) for uid in given_out), *((lab.uid, lab.title) for lab in add)]
            f.writelines(json.dumps({"uid": uid, "title": title}, ensure_ascii=False) + "\n" for uid, title in rows)
        plan.written.add(schema.LABELS)
        table = parent.token_table()  # opened and checked as serving opens it
        if table is not None and table.bias is not None:
            c = np.asarray(table.bias)
            plan.save(schema.TOKEN_SHORTLIST_BIAS, np.concatenate((c, np.full(gap, np.min(c[:trained]), c.dtype),
                                                                   self._priors(c[:trained], add))))

    def _priors(self, trained: np.ndarray, add: Sequence[NewLabel]) -> np.ndarray:
        """Each added label's bias: its prior quantile (or the editor's) of the trained labels' biases."""
        q = [self.prior_quantile if lab.prior is None else lab.prior for lab in add]
        return np.quantile(np.asarray(trained, dtype=np.float64), q).astype(np.float32)

    def _write_overflow(self, plan: _Plan, ids: np.ndarray, weights: np.ndarray, retired: np.ndarray) -> None:
        """The overflow rows: the parent's entries (those of labels retired now dropped) and the
        added labels', strongest first, at most overflow_width per token."""
        parent = plan.parent
        table = parent.token_table()
        if table is None:
            return
        plan.overflow_rebuilt = True
        first = len(parent.labels)
        row, col = np.nonzero(ids > 0)  # added label `row`'s col-th token
        entries = [(ids[row, col].astype(np.int64), (first + row).astype(np.int64),
                    weights[row, col].astype(np.float64) * self._slot_scale(table, parent, ids[row, col]))]
        if table.overflow is not None:
            tokens, slots = np.nonzero(table.overflow >= 0)
            labels = table.overflow[tokens, slots].astype(np.int64)
            slot = (table.overflow_weights[tokens, slots] if table.overflow_weights is not None
                    else np.zeros(len(tokens))).astype(np.float64)
            keep = ~np.isin(labels, retired)
            entries.append((tokens[keep].astype(np.int64), labels[keep], slot[keep]))
        token, label, weight = (np.concatenate(parts) for parts in zip(*entries, strict=True))
        labels, slot_weights = _rows_of(token, label, weight, table.labels.shape[0], self.overflow_width)
        if labels is None:
            return
        plan.save(schema.TOKEN_OVERFLOW, labels)
        if table.weights is not None:
            plan.save(schema.TOKEN_OVERFLOW_WEIGHTS, slot_weights)

    def _slot_scale(self, table: Any, parent: Bundle, tokens: np.ndarray) -> np.ndarray | float:
        """s_lex of each slot's token: the table's quantile, or with lexical_per_token the quantile
        of the token's own served row (a word that many labels share weighs less in each)."""
        if table.weights is None:
            return 1.0  # no lexical score: the weights only rank the slots
        served = table.weights[:, : max(parent.manifest.scoring.shortlist.k_tok, 1)]
        positive = served[served > 0]
        overall = float(np.quantile(positive, self.lexical_quantile)) if positive.size else 0.0
        if not self.lexical_per_token:
            return overall
        rows = np.where(served[tokens] > 0, served[tokens], np.nan).astype(np.float64)
        known = ~np.isnan(rows).all(axis=1)
        out = np.full(len(tokens), overall)
        out[known] = np.nanquantile(rows[known], self.lexical_quantile, axis=1)
        return out


class TextMap:
    """What a label's text says about the vectors training would give it, learned from the
    trained labels: ridge maps from a label's title embedding E(z) to the residuals of its trained
    classifier, bias and centroid from what its text alone gives (s E(z), the prior, E(z)).

    A label's text may share few words with the documents that carry it (debian-deps: a library's
    description and the programs that depend on it); the trained labels show how texts of each
    kind sit relative to their documents, and an added label gets that, shrunk toward its text
    alone by l2 (per label: the solve is (X'X / n + l2 I) A = X'Y / n, X = [E(z), 1]).
    """

    def __init__(self, coef: np.ndarray, dim: int) -> None:
        self.coef, self.dim = coef, dim

    @classmethod
    def fit(cls, parent: Bundle, scale: float, prior: float, l2: float, max_labels: int, seed: int) -> TextMap:
        """Fitted on the parent's trained labels (at most max_labels of them, a seeded sample)."""
        trained = parent.manifest.tree_labels
        rows = np.arange(trained)
        if trained > max_labels:
            rows = np.sort(np.random.default_rng(seed).choice(trained, max_labels, replace=False))
        e = _embed_titles(parent, [parent.labels.titles[int(i)] for i in rows])
        w = parent.vector_rows(schema.CLASSIFIERS, rows)
        b = np.asarray(parent.classifier_bias[rows], dtype=np.float32)
        mu = parent.vector_rows(schema.CENTROIDS, rows)
        x = np.hstack((e, np.ones((len(rows), 1), np.float32))).astype(np.float64)
        y = np.hstack((w - scale * e, (b - prior)[:, None], mu - e)).astype(np.float64)
        gram = x.T @ x / len(rows) + l2 * np.eye(x.shape[1])
        return cls(np.linalg.solve(gram, x.T @ y / len(rows)).astype(np.float32), e.shape[1])

    def apply(self, title_emb: np.ndarray, w: np.ndarray, b: np.ndarray,
              mu: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """w, b, mu of added labels moved by the map of their title embeddings [N, D]."""
        d = self.dim
        delta = np.hstack((title_emb, np.ones((len(title_emb), 1), np.float32))) @ self.coef
        centroid = mu + delta[:, d + 1 :]
        centroid /= np.maximum(np.linalg.norm(centroid, axis=1, keepdims=True), 1e-12)
        return w + delta[:, :d], (b + delta[:, d]).astype(np.float32), centroid


_EMBED_AT_ONCE = 2048


def _embed_titles(parent: Bundle, titles: Sequence[str]) -> np.ndarray:
    """E(title) [N, D] float32, a block of titles at a time (a title with no known word: 0)."""
    encoder, out = parent.encoder(1), []
    for start in range(0, len(titles), _EMBED_AT_ONCE):
        ids, weights = parent.tokenizer.encode_batch(list(titles[start : start + _EMBED_AT_ONCE]))
        out.append(np.nan_to_num(encoder.run(ids, weights)))
    return np.vstack(out) if out else np.zeros((0, parent.manifest.dim), np.float32)


class _Plan:
    """The files of a bundle being derived: written ones, and the parent's shared for the rest."""

    def __init__(self, parent: Bundle, staging: Path) -> None:
        self.parent, self.staging = parent, staging
        self.written: set[str] = set()
        self.overflow_rebuilt = False

    def save(self, name: str, array: np.ndarray) -> None:
        save_array(self.staging / name, array)
        self.written.add(name)

    def share_the_rest(self) -> dict[str, str]:
        """Link (or copy) every parent file not written here (a rebuilt overflow that came out
        empty is dropped, not shared)."""
        shared = {}
        for name in self.parent.manifest.files:
            if name in self.written or (self.overflow_rebuilt and name in OVERFLOW_FILES):
                continue
            shared[name] = _from_parent(self.parent.path / name, lambda src, dst=self.staging / name:
                                        store.share_file(src, dst))
        return shared


def _from_parent(src: Path, how: Callable[[Path], Any]) -> Any:
    """how(src), a file of the parent bundle: one gone since the parent was opened (a bundle
    directory changed under the service) is the parent's fault, a BundleError naming it."""
    try:
        return how(src)
    except FileNotFoundError as exc:
        if src.exists():
            raise
        raise schema.BundleError(f"{src}: listed in the manifest but missing") from exc


def _given_out_first(gap: int, lowest: float, w: np.ndarray, b: np.ndarray,
                     mu: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Added labels' w, b, mu behind `gap` rows given out on other versions: retired, so only their
    ids and uids matter; zero vectors and the lowest prior keep them at the bottom of an index search."""
    zeros = np.zeros((gap, w.shape[1]), np.float32)
    return np.vstack((zeros, w)), np.concatenate((np.full(gap, lowest, np.float32), b)), np.vstack((zeros, mu))


def _mask(ids: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[ids] = True
    return out


def _rows_of(token: np.ndarray, label: np.ndarray, weight: np.ndarray, vocab: int,
             width: int) -> tuple[np.ndarray | None, np.ndarray]:
    """Entries (token, label, weight) as rows [vocab, W] int32 / float32, each token's entries by
    weight (then label id), at most `width`; (None, ...) when there is no entry."""
    if not len(token):
        return None, np.zeros(0, np.float32)
    order = np.lexsort((label, -weight, token))
    token, label, weight = token[order], label[order], weight[order]
    starts = np.flatnonzero(np.r_[True, token[1:] != token[:-1]])
    counts = np.diff(np.r_[starts, len(token)])
    rank = np.arange(len(token)) - np.repeat(starts, counts)
    keep = rank < width
    cols = int(rank[keep].max()) + 1
    labels = np.full((vocab, cols), -1, dtype=np.int32)
    weights = np.zeros((vocab, cols), dtype=np.float32)
    labels[token[keep], rank[keep]] = label[keep]
    weights[token[keep], rank[keep]] = weight[keep]
    return labels, weights


def _lookalike_uid(uid: str) -> str | None:
    """Why a new uid would look like another one it is not (uids are compared code point by code
    point: "caf\u00e9" and "cafe\u0301", "R1" and " R1 ", "R1\u200b", "\uff321" (fullwidth) or
    "R\u00b9" would be distinct labels that a person, or a client excluding one, cannot tell
    apart), or None. NFKC rather than NFC: compatibility characters (fullwidth and circled
    forms, super- and subscripts, ligatures, letterlike symbols) are the look-alikes NFC keeps."""
    if uid != uid.strip():
        return f"{uid[:64]!r} has leading or trailing whitespace"
    if (folded := unicodedata.normalize("NFKC", uid)) != uid:
        return (f"{uid[:64]!r} is not in Unicode normal form KC: it reads as {folded[:64]!r} (composed or "
                "compatibility forms of the same text would be other uids)")
    hidden = next((ch for ch in uid if unicodedata.category(ch) in ("Cc", "Cf", "Co", "Cn")), None)
    if hidden is not None:
        return f"{uid[:64]!r} holds a control, invisible or unassigned character (U+{ord(hidden):04X})"
    return None


# Bidi overrides show the characters after them in reverse order ("\u202eRTL" reads as "LTR"):
# a title a person reads as another's. Embeddings, isolates and marks keep each character's order.
_BIDI_OVERRIDES = "\u202d\u202e"


def _unshowable(text: str, allowed: str) -> str | None:
    """What in a label's text an answer would hand every client verbatim that shows as something
    else or drives a terminal (a control character but `allowed`, a bidi override), or None."""
    found = next((ch for ch in text if ch not in allowed and (unicodedata.category(ch) == "Cc" or
                                                              ch in _BIDI_OVERRIDES)), None)
    if found is None:
        return None
    kind = "a bidi override" if found in _BIDI_OVERRIDES else "a control character"
    return f"{kind} (U+{ord(found):04X}) at {text.index(found)}: answers would return it verbatim"


def _check_change(parent: Bundle, change: LabelChange, given_out: Sequence[str] = ()) -> np.ndarray:
    """The ids to retire; LabelChangeRejected naming every problem of the change."""
    problems: list[tuple[str, str]] = []
    table = parent.labels
    retired = parent.retired
    seen: dict[str, int] = {}
    elsewhere = {uid: len(table) + i for i, uid in enumerate(given_out)}
    for i, label in enumerate(change.add):
        row = table.ids_of([label.uid])[0]
        if label.uid in seen:
            problems.append((f"add[{i}].uid", f"{label.uid!r} is also add[{seen[label.uid]}]"))
        elif label.uid in elsewhere:
            problems.append((f"add[{i}].uid", f"{label.uid!r} was given out (id {elsewhere[label.uid]}) on another "
                             "version derived from the same base, since rolled back (uids are never reused)"))
        elif row is not None:
            state = "a retired label's uid (uids are never reused)" if retired is not None and retired[row] else \
                "already a label"
            problems.append((f"add[{i}].uid", f"{label.uid!r} is {state}"))
        seen.setdefault(label.uid, i)
        lookalike = _lookalike_uid(label.uid)
        if lookalike is not None:
            problems.append((f"add[{i}].uid", lookalike))
        if is_blank(label.title):
            problems.append((f"add[{i}].title", "empty or blank characters only (tokenizer.is_blank_char)"))
        for part, text, allowed in (("title", label.title, "\t"), ("content", label.content or "", "\t\n\r")):
            if (hidden := _unshowable(text, allowed)) is not None:
                problems.append((f"add[{i}].{part}", f"holds {hidden}"))
        if label.prior is not None and not 0.0 <= label.prior <= 1.0:
            problems.append((f"add[{i}].prior", f"must be a quantile in [0, 1], got {label.prior}"))
    ids: list[int] = []
    gone: dict[str, int] = {}
    for i, uid in enumerate(change.retire):
        row = table.ids_of([uid])[0]
        if uid in gone:
            problems.append((f"retire[{i}]", f"{uid!r} is also retire[{gone[uid]}]"))
        elif uid in seen:
            problems.append((f"retire[{i}]", f"{uid!r} is added by the same change"))
        elif row is None:
            problems.append((f"retire[{i}]", f"no label {uid!r}"))
        elif retired is not None and retired[row]:
            problems.append((f"retire[{i}]", f"{uid!r} is retired already"))
        else:
            ids.append(row)
        gone.setdefault(uid, i)
    live = len(table) - (int(retired.sum()) if retired is not None else 0) + len(change.add)
    if not problems and live - len(ids) < 1:
        problems.append(("retire", "would retire every label"))
    if not problems and not change.add and not ids:
        problems.append(("change", "nothing to add or retire"))
    if problems:
        raise LabelChangeRejected(problems)
    return np.asarray(sorted(ids), dtype=np.int64)


def label_text(label: NewLabel, text_field: str) -> str:
    """The text the encoder reads, as training read label texts (training.data.row_text)."""
    if text_field == "title+content":
        return f"{label.title}\n{label.content or ''}".strip()
    return label.title.strip()


def _encode_new(parent: Bundle, add: Sequence[NewLabel]) -> tuple[np.ndarray, np.ndarray]:
    """Padded token ids and tf-idf weights [N, T] of the added labels' texts; a text with no
    word in the vocabulary encodes to nothing, so the encoder cannot place it: refused."""
    if not add:
        return np.zeros((0, 1), np.int64), np.zeros((0, 1), np.float32)
    ids, weights = parent.tokenizer.encode_batch([label_text(lab, parent.manifest.text_field) for lab in add])
    unplaced = np.flatnonzero((ids > 0).sum(axis=1) == 0)
    if len(unplaced):
        raise LabelChangeRejected([
            (f"add[{i}].title",
             f"none of the words of {add[i].uid!r} is in the bundle's vocabulary: its text cannot place it")
            for i in unplaced])
    return ids, weights


def _canaries(staging: Path, texts: list[str]) -> list[dict[str, Any]]:
    # The checksums were computed from these files a moment ago; every load after the rename verifies them.
    staged = Bundle.open(staging, staged=True, verify_checksums=False)
    try:
        return [c.model_dump() for c in canary.record(Predictor(staged), texts)]
    finally:
        staged.close()


def _manifest_fields(parent: Bundle, version: str, num_labels: int, lineage: schema.Lineage) -> dict[str, Any]:
    fields = parent.manifest.model_dump(exclude={"format_version", "created_at", "files", "canary", "lineage"})
    return {**fields, "version": version, "num_labels": num_labels, "lineage": lineage.model_dump()}
