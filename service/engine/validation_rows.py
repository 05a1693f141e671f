"""A bundle's validation rows (validation.jsonl): held-out documents and their labels, which the
activation's quality gate and `shortlist export` score the bundle on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from service.engine.schema import BundleError


def read_validation_rows(path: Path, num_labels: int) -> list[dict[str, Any]]:
    """The rows of `path`, each {"text", "target_ind"[, "target_weight"]}; BundleError naming the
    line of a row that is not one."""
    rows = []
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                rows.append(_validation_row(line, num_labels, f"{path}:{number}"))
    return rows


def _validation_row(line: bytes, num_labels: int, where: str) -> dict[str, Any]:
    try:
        row = orjson.loads(line)
        text, targets = row["text"], row["target_ind"]
    except (ValueError, KeyError, TypeError) as exc:
        raise BundleError(f"{where}: bad validation row: {exc!r}") from exc
    if not isinstance(text, str) or not isinstance(targets, list) or not all(
        type(t) is int and 0 <= t < num_labels for t in targets
    ):
        raise BundleError(f"{where}: a validation row is {{\"text\": str, \"target_ind\": [label ids < {num_labels}]}}")
    weights = row.get("target_weight")
    if weights is not None and not (isinstance(weights, list) and len(weights) == len(targets) and all(
        type(w) in (int, float) and 0.0 < w <= 1.0 for w in weights
    )):
        raise BundleError(f"{where}: a validation row's \"target_weight\" is one weight in (0, 1] per target_ind "
                          f"label ({len(targets)})")
    return row


def validation_truths(rows: list[dict[str, Any]]) -> tuple[list[list[int]], list[list[float]] | None]:
    """The truths of validation rows and their weights (None when no row has any: every label
    sure; a row without weights among rows with them weighs each label 1)."""
    truths = [list(r["target_ind"]) for r in rows]
    if not any("target_weight" in r for r in rows):
        return truths, None
    return truths, [list(r.get("target_weight") or [1.0] * len(t)) for r, t in zip(rows, truths, strict=True)]
