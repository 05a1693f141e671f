"""A training that diverges (a learning rate or weight set far too high) stops at the stage that
diverged, exit 2 and one line naming it and the setting, with nothing saved; a JSON record
holding NaN or an infinity is refused, never written (audit 7, findings 1-3)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from service.engine.schema import Manifest
from shortlist.cli import main
from training.checkpoint import META, Checkpoint
from training.config_values import Bounds
from training.epochs import run_epoch
from training.token_shortlist import fit_token_logistic

# Fewer epochs than the tiny preset: a diverging setting shows in the first.
FAST = {"preset": "tiny", "threads": 1, "m1_epochs": 1, "m3_epochs": 1, "lexical_epochs": 3,
        "tree": {"epochs": 1, "node_lexical_epochs": 1, "lexical_epochs": 2}}


def _merged(base: dict, over: dict) -> dict:
    return {**base, **over, "tree": {**base["tree"], **over.get("tree", {})}}


# One diverging setting per stage class: (config override, the message's start, the setting it names).
DIVERGING = [
    ({"m1_lr": 1e30}, "Module I: training diverged: ", "lower m1_lr"),
    ({"m1_d": 1e300}, "Module I: training diverged: ", "m1_d"),
    ({"m3_lr": 1e30}, "Module III: training diverged: ", "lower m3_lr"),
    ({"m3_encoder_lr": 1e30}, "Module III: training diverged: ", "m3_encoder_lr"),
    ({"lexical_lr": 1e30}, "lexical table: training diverged: ", "lower lexical_lr"),
    ({"tree": {"lexical_lr": 1e30}}, "tree lexical start: training diverged: ", "lower tree.lexical_lr"),
    ({"tree": {"start_centroids": 1e300}}, "tree classifier: training diverged: ", "lower tree.start_centroids"),
    ({"tree": {"lr": 1e30}}, "tree classifier: training diverged: ", "lower tree.lr"),
    ({"tree": {"node_lexical_lr": 1e30}}, "tree node lexical: training diverged: ", "lower tree.node_lexical_lr"),
]


@pytest.mark.parametrize(("override", "stage", "setting"), DIVERGING,
                         ids=[json.dumps(o).replace(" ", "") for o, *_ in DIVERGING])
def test_a_diverging_setting_stops_training_at_its_stage_naming_it_and_saves_nothing(
        synthetic_data, tmp_path, capsys, monkeypatch, recwarn, override, stage, setting):
    # Every setting's maximum now refuses these values before any data is read
    # (tests/test_setting_bounds.py); the stage check stays for a fit that runs off within them.
    # The maxima are lifted here to reach it with a setting that surely diverges.
    monkeypatch.setattr(Bounds, "check", lambda self, name, value, integer: None)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_merged(FAST, override)))
    out = tmp_path / "ckpt"
    assert main(["train", "--data", str(synthetic_data), "--out", str(out), "--config", str(config)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line or "Warning" in line]
    assert len(errors) == 1 and errors[0].startswith(f"shortlist train: error: {stage}"), errors
    assert setting in errors[0] and "Eigenvalues" not in errors[0]
    # the one line is all a user sees: no numpy overflow warning before it
    assert not [str(w.message) for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_a_non_finite_loss_ends_the_epoch_and_the_fit_at_once():
    batches = []

    def loss_of(batch: np.ndarray) -> torch.Tensor:
        batches.append(len(batches))
        return (torch.tensor(float("nan")) if len(batches) == 2 else torch.tensor(1.0)) * weight.sum()

    weight = torch.ones(2, requires_grad=True)
    loss = run_epoch(np.arange(10), 2, loss_of, [torch.optim.SGD([weight], lr=0.1)], "test", progress=False)
    assert math.isnan(loss) and len(batches) == 2  # not the 5 batches of the epoch
    # The token table's fit at lr 1e30: it stops within the second epoch (it ran all 30 on NaN).
    docs = np.array([[1, 2], [2, 0], [1, 0]] * 20)
    y = sp.csr_matrix(np.array([[1, 0], [0, 1], [1, 0]] * 20, dtype=np.float32))
    table = np.array([[-1, -1], [0, 1], [1, 0]], dtype=np.int32)
    _, _, losses = fit_token_logistic(docs, (docs > 0).astype(np.float32), y, table, 2, epochs=30, lr=1e30, l2=0.0,
                                      batch_size=8, seed=0, device=torch.device("cpu"))
    assert len(losses) <= 2 and not math.isfinite(losses[-1])


def test_json_records_refuse_nan_and_infinity_naming_where():
    from service.engine.jsonlines import strict_dumps  # here: the other tests run without it

    assert strict_dumps({"losses": [1.0, 2.5]}, "x") == '{"losses": [1.0, 2.5]}'
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match=re.escape("checkpoint.json: metrics.losses.module1[1] is not a finite")):
            strict_dumps({"metrics": {"losses": {"module1": [0.5, bad]}}}, "checkpoint.json", indent=2)
    # The manifest (pydantic writes a NaN in a free-form record as null, silently): refused.
    with pytest.raises(ValueError, match=re.escape("training.loss is not a finite number")):
        Manifest.model_validate({"format_version": 2, "version": "v", "created_at": "2026-01-01T00:00:00Z", "dim": 2,
                                 "num_labels": 2, "vocab_size": 2, "scoring": {}, "hnsw": {"M": 2},
                                 "metrics": {"training": {"loss": float("nan")}}, "files": {}})


def test_a_checkpoint_holding_a_nan_metric_is_not_saved(checkpoints, tmp_path):
    ckpt = Checkpoint.load(checkpoints["v1"])
    ckpt.metrics = {**ckpt.metrics, "losses_lexical": [1.0, float("nan")]}
    with pytest.raises(ValueError, match=re.escape(f"{META}: metrics.losses_lexical[1] is not a finite number")):
        ckpt.save(tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []
