"""`shortlist eval`: metrics of a bundle through the serving engine (what is measured is what is served).

Protocols (`--filter`):
  plain   every prediction and every true label counts;
  own     a document's own label (the label with the document's uid) is left out of its
          predictions and its truth: where documents are labels too, the Extreme Classification
          Repository scores this way (its filter_labels files list these pairs);
  FILE    a filter file of that repository: one "test_row label_row" pair a line (0-based),
          each pair left out of that document's predictions and truth.
Left-out labels are never predicted (the engine's `exclude`), so the next best move up.
A bundle's retired labels are never predicted either; as truths they are counted (`retired_truths`)
and scored as missed, or with `--leave-out-retired` left out as the activation's quality gate does.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.engine.jsonlines import iter_text_lines, strict_dumps
from service.engine.metrics import (
    answerable_truths,
    label_frequencies,
    propensities,
    ranking_metrics,
    shortlist_recall,
)
from service.engine.predictor import Predictor
from training.data import LabelSet, Split, find_split_file, load_labels, load_split, own_label_ids
from training.progress import Progress

if TYPE_CHECKING:  # imported where used (serving_text_check), as before: not by every importer of this module
    from service.api.schemas import TextCheck

EVAL_BATCH = 256
METRICS = ("P@1", "P@3", "P@5", "nDCG@1", "nDCG@3", "nDCG@5", "PSP@1", "PSP@3", "PSP@5")


def filtered_pairs(protocol: str, docs: Split, labels: LabelSet, num_labels: int) -> list[list[int]]:
    """Per document of the split the label ids its protocol leaves out ("plain", "own" or a filter
    file, whose label rows are checked against the bundle's `num_labels`)."""
    if protocol == "plain":
        return [[] for _ in range(len(docs))]
    if protocol == "own":
        return [[int(i)] if i >= 0 else [] for i in own_label_ids(docs.uids, labels.uids)]
    return read_filter_file(Path(protocol), len(docs), num_labels)


def read_filter_file(path: Path, num_docs: int, num_labels: int) -> list[list[int]]:
    """A filter file's pairs per document of the whole split (`num_docs`), each label row below
    `num_labels` (the bundle's); errors name the file and line. A pair given twice counts once."""
    out: list[list[int]] = [[] for _ in range(num_docs)]
    seen: set[tuple[int, int]] = set()  # a list's `in` was quadratic: 42,000 pairs of one row took 17 s
    for lineno, line in iter_text_lines(path, "filter file"):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split()
        # ASCII digits: str.isdigit() also takes "²" (int() refuses it) and "٣" (int() reads 3).
        if len(parts) != 2 or not all(p.isascii() and p.isdigit() for p in parts):
            raise ValueError(f"{path}:{lineno}: expected two non-negative integers 'test_row label_row', got {line!r}")
        row, label = int(parts[0]), int(parts[1])
        if row >= num_docs:
            raise ValueError(f"{path}:{lineno}: test row {row} out of range (the split has {num_docs} documents)")
        if label >= num_labels:
            raise ValueError(f"{path}:{lineno}: label row {label} out of range (the bundle has {num_labels} labels)")
        if (row, label) not in seen:
            seen.add((row, label))
            out[row].append(label)
    return out


def evaluate_bundle(
    bundle_dir: str | Path,
    data_dir: str | Path,
    split: str = "tst",
    text_field: str | None = None,
    scorer: str = "alpha",
    alpha: float | None = None,
    limit: int | None = None,
    protocol: str = "plain",
    predictor: Predictor | None = None,
    leave_out_retired: bool = False,
) -> dict[str, Any]:
    """P@1/3/5, nDCG@1/3/5, PSP@1/3/5 (propensities from trn), shortlist recall and queries/s. Truths
    that are retired labels are counted (`retired_truths`) and scored as missed (the data's truth,
    never answered); `leave_out_retired` scores the truths the bundle can answer (answerable_truths)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (documents evaluated), got {limit}")
    if scorer == "tree" and alpha is not None:
        # The tree route has no alpha mix: scored without it, the run would report numbers the
        # flag never changed.
        raise ValueError("--alpha mixes the alpha route's scores; the tree route (--scorer tree) has no alpha")
    text_check = serving_text_check()  # before any work: a bad value is refused at once
    predictor = predictor or Predictor.load(bundle_dir)
    check_scorer(predictor, scorer)  # before the data is read
    manifest = predictor.bundle.manifest
    field, num_labels = text_field or manifest.text_field, manifest.num_labels
    labels = load_labels(data_dir, field)
    check_same_labels(labels, predictor, data_dir)
    # Target rows name the data's label rows (the bundle's first ones; it may have more, added
    # since): a row past the label file is refused as training refuses it, not scored.
    docs = load_split(data_dir, split, field, num_labels=len(labels))
    # Over the whole split, then limited: a filter file names rows of the whole split, and its
    # pairs past the limit are of documents not evaluated.
    left_out = filtered_pairs(protocol, docs, labels, num_labels)
    # From the whole trn split, also when it is the one evaluated and --limit cuts it.
    inv_prop = _inverse_propensities(data_dir, split, docs, field, len(labels), num_labels)
    if limit is not None:
        docs, left_out = docs.subset(list(range(min(limit, len(docs))))), left_out[:limit]
    truths = [[t for t in truth if t not in dropped]
              for truth, dropped in zip(docs.targets, map(set, left_out), strict=True)]
    unlabelled = sum(1 for truth in truths if not truth)
    if unlabelled == len(truths):
        raise ValueError(f"{find_split_file(data_dir, split)}: no document has a label"
                         f"{'' if protocol == 'plain' else ' the filter leaves'}: every metric would be 0")
    answerable = answerable_truths(truths, predictor.bundle.retired)
    if leave_out_retired and not answerable.scored.any():
        raise ValueError(f"every labelled document's truths are retired labels of {predictor.version}: "
                         "leaving them out leaves nothing to score")
    ids, shortlists, elapsed = _predict_all(predictor, docs.texts, left_out, scorer, alpha)
    out: dict[str, Any] = {"bundle": predictor.version, "split": split, "scorer": scorer, "protocol": protocol,
                           "filtered_pairs": sum(len(d) for d in left_out), "documents": len(docs),
                           "documents_without_labels": unlabelled}
    out.update(refused_texts(docs.texts, text_check))
    out.update(retired_truths=answerable.truths_left_out, leave_out_retired=leave_out_retired,
               documents_only_retired_truths=int((~answerable.scored).sum()))
    if inv_prop is None:
        out["psp_not_measured"] = f"no trn file in {data_dir}: PSP@k's propensities come from its label frequencies"
    if leave_out_retired:
        keep = np.flatnonzero(answerable.scored)
        ids, truths = ids[keep], [answerable.truths[i] for i in keep]
        shortlists = [shortlists[i] for i in keep] if shortlists else shortlists
    out.update(_scores(ids, truths, shortlists if scorer == "alpha" else None, inv_prop))
    out["queries_per_s"] = len(docs) / elapsed if elapsed > 0 else 0.0
    return out


def _scores(ids: np.ndarray, truths: list[list[int]], shortlists: list | None,
            inv_prop: np.ndarray | None) -> dict[str, float]:
    """The ranking metrics, and with the alpha route's shortlists their recall: they hold only
    labels that can be answered (Predictor.shortlist), so a retired truth is not recalled."""
    out = ranking_metrics(ids, truths, ks=(1, 3, 5), inv_propensity=inv_prop)
    if shortlists is not None:
        out["recall@shortlist"] = shortlist_recall(shortlists, truths)
        out["shortlist_size_mean"] = float(np.mean([len(s) for s in shortlists])) if shortlists else 0.0
    return out


def _predict_all(predictor: Predictor, texts: list[str], left_out: list[list[int]], scorer: str,
                 alpha: float | None) -> tuple[np.ndarray, list, float]:
    """Each text's top 5 as the route serves it (its left-out labels excluded), the alpha route's
    shortlists, and the seconds the predictions took (the shortlists' not counted)."""
    ids = np.empty((len(texts), 5), dtype=np.int64)
    shortlists: list = []
    elapsed = 0.0
    predict = predictor.predict_tree_ids if scorer == "tree" else predictor.predict_ids
    kwargs = {} if scorer == "tree" else {"alpha": alpha}
    batches = range(0, len(texts), EVAL_BATCH)
    for start in Progress(batches, f"eval ({scorer}, {len(texts)} documents, batches of {EVAL_BATCH})"):
        batch, drop = texts[start : start + EVAL_BATCH], left_out[start : start + EVAL_BATCH]
        t0 = time.perf_counter()
        ids[start : start + len(batch)] = predict(batch, k=5, exclude=drop, **kwargs)[0]
        elapsed += time.perf_counter() - t0
        if scorer == "alpha":
            shortlists.extend(predictor.shortlist(batch))
    return ids, shortlists, elapsed


def check_scorer(predictor: Predictor, scorer: str) -> None:
    """ValueError when the bundle cannot answer on `scorer`'s route, as POST /v1/predict/tree
    answers 409 no_tree_scorer (the engine's LookupError, raised mid-run, was a traceback)."""
    if scorer != "tree":
        return
    if predictor.bundle.tree is None:
        why = "a shard carries none" if predictor.bundle.manifest.shard is not None else \
            "trained with tree_enabled false"
        raise ValueError(f"bundle {predictor.version} has no tree scorer ({why}): use --scorer alpha")
    if not predictor.tree_serves:
        raise ValueError(f"every label the tree of bundle {predictor.version} holds is retired (labels added "
                         "since training join it at the next training): use --scorer alpha")


def serving_text_check() -> TextCheck:
    """The API's check of a text under this environment's SHORTLIST_MAX_TEXT_CHARS and
    SHORTLIST_MAX_NORMALIZED_CHARS, checked as `shortlist serve` checks them (a bad value is a
    ValueError naming it), else their defaults."""
    from service.api.schemas import TextCheck
    from service.api.settings import environment_text_limits

    return TextCheck(environment_text_limits())


# Per reason (TextCheck.refusal) the key counting the evaluated documents whose text it refuses.
REFUSED_COUNTS = {"blank": "documents_blank_text", "past_max_text_chars": "documents_past_max_text_chars",
                  "past_max_normalized_chars": "documents_past_max_normalized_chars"}


def refused_texts(texts: list[str], check: TextCheck) -> dict[str, int]:
    """What is measured is what is served: the texts scored here that POST /v1/predict refuses
    (422), counted by the API's own validator, by reason, each under the first it fails (as a
    request's error names one), and the limits in force. They are scored all the same, so a
    figure stays comparable with one of the whole split."""
    reasons = Counter(check.refusal(text) for text in texts)
    out = {key: reasons[reason] for reason, key in REFUSED_COUNTS.items()}
    out["documents_refused_by_api"] = sum(out.values())
    out["max_text_chars"] = check.settings.max_text_chars
    out["max_normalized_chars"] = check.settings.normalized_text_limit
    return out


def check_same_labels(labels: LabelSet, predictor: Predictor, data_dir: str | Path) -> None:
    """The data's label rows must be the bundle's first rows, uid for uid (a bundle may have more:
    labels added since): a document's target rows name labels of the data's table, predictions
    rows of the bundle's, and another order or another label set would be scored silently
    (a permuted lbl file: P@1 82.0 -> 2.0, exit 0)."""
    path, table = find_split_file(data_dir, "lbl"), predictor.bundle.labels
    if len(labels.uids) > len(table):
        raise ValueError(f"{path}: {len(labels.uids)} labels, the bundle {predictor.version} has {len(table)}: "
                         "not the label table it was trained on")
    rows = table.ids_of(labels.uids)
    bad = next((i for i, row in enumerate(rows) if row != i), None)
    if bad is not None:
        found = "not in the bundle" if rows[bad] is None else f"the bundle's row {rows[bad]}"
        raise ValueError(f"{path}: label row {bad} (uid {labels.uids[bad]!r}) is {found}: the data's labels are "
                         f"not the bundle {predictor.version}'s, row for row (target_ind would name other labels)")


def _inverse_propensities(data_dir: str | Path, split: str, docs: Split, field: str, data_labels: int,
                          num_labels: int) -> np.ndarray | None:
    """PSP@k's weights over the bundle's `num_labels`, from the training split's label frequencies
    (its rows checked against the data's `data_labels`); None without a trn file (the other
    metrics need only the evaluated split)."""
    if split == "trn":
        trn = docs
    elif find_split_file(data_dir, "trn") is None:
        return None
    else:
        trn = load_split(data_dir, "trn", field, num_labels=data_labels)
    return 1.0 / propensities(label_frequencies(trn.targets, num_labels), len(trn))


def run_cli(args: argparse.Namespace) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(message)s")
    result = evaluate_bundle(args.bundle, args.data, args.split, args.text_field, args.scorer, args.alpha,
                             args.limit, args.filter, leave_out_retired=args.leave_out_retired)
    if args.json:
        print(strict_dumps(result, "the evaluation's record"))
        return 0
    print(f"bundle {result['bundle']}  split {result['split']}  scorer {result['scorer']}  "
          f"protocol {result['protocol']} ({result['filtered_pairs']} pairs left out)  documents {result['documents']}"
          f" ({result['documents_without_labels']} without a label: 0 in their P@k and nDCG@k)")
    for name in (*METRICS, "recall@shortlist", "queries_per_s"):
        if name in result:
            print(f"  {name:<18} {result[name]:10.2f}")
    if result["protocol"] != "plain" and not result["filtered_pairs"]:
        print(f"  protocol {result['protocol']} left nothing out"
              f"{' (no document uid is a label uid)' if result['protocol'] == 'own' else ''}: scored as plain")
    if result["documents_refused_by_api"]:
        print(f"  {_refused_note(result)}")
    if result["retired_truths"]:
        print(f"  {_retired_note(result)}")
    if "psp_not_measured" in result:
        print(f"  PSP@k not measured: {result['psp_not_measured']}")
    return 0


def _refused_note(result: dict[str, Any]) -> str:
    """How many scored texts POST /v1/predict would refuse, and why."""
    why = {"documents_blank_text": "empty or blank",
           "documents_past_max_text_chars": f"longer than MAX_TEXT_CHARS ({result['max_text_chars']})",
           "documents_past_max_normalized_chars": f"longer than MAX_NORMALIZED_CHARS "
                                                  f"({result['max_normalized_chars']}) after NFKC"}
    parts = ", ".join(f"{result[key]} {text}" for key, text in why.items() if result[key])
    return (f"{result['documents_refused_by_api']} documents have a text the API refuses (422): {parts}; "
            "scored here all the same")


def _retired_note(result: dict[str, Any]) -> str:
    """What the scores made of the truths that are retired labels of the bundle."""
    counted = (f"left out (--leave-out-retired): {result['documents_only_retired_truths']} documents with no other "
               "truth not scored" if result["leave_out_retired"] else
               "scored as missed (never answered; --leave-out-retired scores without them)")
    return (f"{result['retired_truths']} truths are labels retired in {result['bundle']} "
            f"({result['documents_only_retired_truths']} documents have only retired truths): {counted}")
