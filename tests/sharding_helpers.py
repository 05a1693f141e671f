"""Held-out texts of the generated data set and P@5 of answers, for the sharding tests."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np

from service.engine.predictor import Prediction


def held_out(data_dir: Path) -> tuple[list[str], list[set[int]]]:
    """The test split's titles and their label ids."""
    with gzip.open(data_dir / "tst.json.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [r["title"] for r in rows], [set(r["target_ind"]) for r in rows]


def p_at_5(predictions: list[list[Prediction]] | list[list[int]], truths: list[set[int]]) -> float:
    """P@5 in percent; predictions as Prediction lists or label id lists."""
    ids = [[p if isinstance(p, int) else p.id for p in row[:5]] for row in predictions]
    return 100.0 * float(np.mean([len(set(row) & truth) / 5 for row, truth in zip(ids, truths, strict=True)]))


def rescored_copy(src: Path, root: Path, version: str, **shortlist: object) -> Path:
    """A copy of bundle `src` as ROOT/VERSION whose manifest's shortlist takes `shortlist`'s
    values (k_head=L, head="always": every label a candidate), canaries answered anew."""
    from service.engine import canary, store
    from service.engine.bundle import Bundle
    from service.engine.predictor import Predictor

    dst = root / version
    shutil.copytree(src, dst)
    fields = json.loads((dst / "manifest.json").read_text(encoding="utf-8"))
    fields["version"] = version
    fields["scoring"]["shortlist"].update(shortlist)
    for name in ("format_version", "created_at", "files"):
        del fields[name]
    store.write_manifest(dst, fields)
    staged = Bundle.open(dst, staged=True)
    texts = [c.text for c in staged.manifest.canary]
    fields["canary"] = [c.model_dump() for c in canary.record(Predictor(staged), texts)]
    staged.close()
    store.write_manifest(dst, fields)
    return dst


def assert_same_answers(got: list[list[tuple[int, str, float]]], want: list[list[Prediction]]) -> None:
    """The same (id, uid, score) per rank, scores within 1e-5; where scores tie (a text of no known
    word scores many labels alike) the order among the tied is either's own."""
    assert [len(row) for row in got] == [len(row) for row in want]
    for g, w in zip(got, want, strict=True):
        scores = np.array([p.score for p in w], dtype=np.float64)
        np.testing.assert_allclose([p[2] for p in g], scores, atol=1e-5)
        tied = np.isclose(scores[:, None], scores[None, :], rtol=0.0, atol=1e-6).sum(axis=1) > 1
        assert [p[:2] for p, t in zip(g, tied, strict=True) if not t] == \
            [(p.id, p.uid) for p, t in zip(w, tied, strict=True) if not t]
