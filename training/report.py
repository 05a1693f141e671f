"""What a training run reports: each stage's wall time, test metrics after Modules I and III
(all labels scored exactly, when the data has a test split), the tuned validation metrics and
the losses; logged as they come and kept for the checkpoint's metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from service.engine.metrics import Truths
from service.engine.scorers import Calibration, LabelScorer
from training.dataset import TrainingSet
from training.encoder import EncodedTexts, SiameseEncoder, embed
from training.tuning import ScoringTuner, exact_metrics

log = logging.getLogger("shortlist.training")
_IDENTITY = Calibration("identity")
# Test metrics score (query, label) pairs exactly, at most this many: 5.4 x 10^8 (debian-deps: 12,710
# of its 16,976 test documents; 10^6 labels: 536).
TEST_SCORES = 1 << 29


class Report:
    def __init__(self) -> None:
        self.metrics: dict[str, Any] = {"times": {}}
        self._start = time.perf_counter()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Times the stage and, where Linux says, the process's peak resident memory during it."""
        reset = _reset_peak_rss()
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        self.metrics["times"][f"{name}_s"] = round(seconds, 2)
        self.metrics["times"]["total_s"] = round(time.perf_counter() - self._start, 2)
        peak = _peak_rss_mib()
        if peak is not None:
            # Without a reset (an older kernel) the peak is the process's so far, not the stage's.
            key = "peak_rss_mib" if reset else "peak_rss_mib_so_far"
            self.metrics.setdefault(key, {})[name] = round(peak, 1)
        log.info("%s done in %.1fs%s", name, seconds, "" if peak is None else f", peak RSS {peak:.0f} MiB")

    def test_module1(self, data: TrainingSet, encoder: SiameseEncoder, label_emb: np.ndarray, mu: np.ndarray,
                     device: torch.device) -> None:
        """Label embeddings (alpha 1) and centroids (alpha 0) as classifiers, raw similarities."""
        if data.tst is None:
            return
        q, truths = _test_sample(data, encoder, device)
        self.metrics["test_documents_scored"] = len(q)
        scorer = LabelScorer(label_emb, np.zeros(data.num_labels, np.float32), mu, _IDENTITY, _IDENTITY)
        self.metrics["module1"] = {"label_embeddings": exact_metrics(scorer, q, truths, 1.0),
                                   "centroids": exact_metrics(scorer, q, truths, 0.0)}
        for name, m in self.metrics["module1"].items():
            log.info("after Module I (test): %s %s", name, m)

    def test_module3(self, data: TrainingSet, encoder: SiameseEncoder, scorer: LabelScorer,
                     device: torch.device, alpha: float) -> None:
        """The classifiers alone and the tuned mixture (without the lexical term)."""
        if data.tst is None:
            return
        q, truths = _test_sample(data, encoder, device)
        self.metrics["module3"] = {"classifiers": exact_metrics(scorer, q, truths, 1.0),
                                   "combined": exact_metrics(scorer, q, truths, alpha)}
        for name, m in self.metrics["module3"].items():
            log.info("after Module III (test, all labels, no lexical score): %s %s", name, m)

    def validation(self, tuner: ScoringTuner) -> None:
        self.metrics["validation"] = {k: round(v, 3) for k, v in tuner.metrics_.items()}
        self.metrics["shortlists_tried"] = tuner.tried_
        s = tuner.scoring_
        log.info("tuned on validation (served shortlists, mean %.1f labels, lexical form %s): alpha=%s %s "
                 "lexical_weight=%s -> %s", tuner.mean_candidates_, s.lexical_form, s.alpha,
                 s.calibration.model_dump(), s.lexical_weight, self.metrics["validation"])

    def losses(self, module1: list[float], module3: list[float], lexical: list[float] | None,
               module3_validation: list[float] | None = None) -> None:
        self.metrics["losses"] = {"module1": [round(x, 5) for x in module1],
                                  "module3": [round(x, 5) for x in module3]}
        if module3_validation:  # the objective Module III's early stop watched, after each epoch
            self.metrics["module3_validation"] = [round(x, 3) for x in module3_validation]
        if lexical is not None:
            self.metrics["losses_lexical"] = [round(x, 5) for x in lexical]


def _test_sample(data: TrainingSet, encoder: SiameseEncoder, device: torch.device) -> tuple[np.ndarray, Truths]:
    """Embeddings and truths of the first test documents: as many as TEST_SCORES (query, label)
    scores allow (exact scoring costs N L D: a sample, not all of a large test split)."""
    n = min(len(data.tst), max(1, TEST_SCORES // data.num_labels))
    texts = data.tst_texts if n == len(data.tst) else EncodedTexts(data.tst_texts.ids[:n], data.tst_texts.weights[:n])
    return embed(encoder, texts, device), data.truths(data.tst.subset(list(range(n))))


def _reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS count of this process (Linux >= 4.0: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mib() -> float | None:
    """VmHWM of /proc/self/status (the peak resident set since the last reset), in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None
