"""Every numeric training setting, top-level and tree.*, found by walking the config schema (never
listed by hand): a finite maximum, accepted at it and refused past it by `shortlist train` before
any data is read (exit 2 naming the setting, its value and its range)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from shortlist.cli import main as cli_main
from training.config import TrainConfig, setting_bounds
from training.tree_config import DEFAULT_CONFIG


def _numeric_settings() -> dict[str, bool]:
    """Each numeric setting of the schema by its config name -> whether it is an integer."""
    numeric = ("int", "float", "float | None")
    top = {f.name: f.type == "int" for f in dataclasses.fields(TrainConfig) if f.type in numeric}
    tree = {f"tree.{key}": type(value) is int for key, value in DEFAULT_CONFIG.items() if type(value) in (int, float)}
    return {**top, **tree}


def _config(name: str, value: Any) -> dict[str, Any]:
    """A config setting `name` to `value`, with what other settings its maximum needs."""
    bounds = setting_bounds()
    needs = {"serve_k_tok": {"token_shortlist_width": bounds["token_shortlist_width"].high},
             "tree.pca_dim": {"dim": bounds["dim"].high}}.get(name, {})
    if name.startswith("tree."):
        return {**needs, "tree": {name.removeprefix("tree."): value}}
    return {**needs, name: value}


def test_every_numeric_setting_is_walked():
    walked = set(_numeric_settings())
    assert len(walked) > 80 and {"dim", "m1_lr", "aggregated_keep_ratio", "tree.beam", "tree.lr"} <= walked
    assert walked == set(setting_bounds())  # no bound without its setting, nor a setting without


@pytest.mark.parametrize(("name", "integer"), sorted(_numeric_settings().items()))
def test_every_numeric_setting_has_a_maximum_accepted_at_and_refused_past_before_any_data(
        name: str, integer: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bounds = setting_bounds()[name]
    assert math.isfinite(bounds.low) and math.isfinite(bounds.high), name
    top = math.nextafter(bounds.high, bounds.low) if bounds.open_high else bounds.high
    top = int(top) if integer else float(top)
    cfg = TrainConfig.from_dict(_config(name, top))
    accepted = cfg.tree[name.removeprefix("tree.")] if name.startswith("tree.") else getattr(cfg, name)
    assert accepted == top
    past = top + 1 if integer else bounds.high * 10
    (tmp_path / "cfg.json").write_text(json.dumps(_config(name, past)))
    out = tmp_path / "ckpt"
    code = cli_main(["train", "--data", str(tmp_path / "no-such-data"), "--out", str(out), "--config",
                     str(tmp_path / "cfg.json")])
    err = capsys.readouterr().err
    kind = "an integer" if integer else "a finite number"
    assert code == 2 and f"cfg.json: training config '{name}' must be {kind} {bounds}, got {past!r}" in err, err
    assert "Traceback" not in err and "no-such-data" not in err and not out.exists()


@pytest.mark.parametrize("weight", [1e7, 1e308, -1.0, float("inf")])
def test_tune_objective_weights_are_bounded_as_the_other_weights(weight: float) -> None:
    assert TrainConfig.from_dict({"tune_objective": {"P@1": 1e6, "P@5": 0}}).tune_objective["P@1"] == 1e6
    with pytest.raises(ValueError, match=r"'tune_objective.P@5' must be a finite number in \[0, 1000000\]"):
        TrainConfig.from_dict({"tune_objective": {"P@1": 1.0, "P@5": weight}})
