"""Shared fixtures: a generated dataset and a bundle root built by real training and export.

Everything is made here from generated data, so the suite needs nothing outside the repo.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from model_export.export import export_checkpoint
from training.config import TrainConfig
from training.pipeline import retune, train
from training.synthetic import generate

SYNTHETIC = {"num_labels": 300, "train_docs": 1500, "test_docs": 300, "seed": 0}


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data")
    generate(out, **SYNTHETIC)
    return out


@pytest.fixture(scope="session")
def checkpoints(synthetic_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two checkpoints of the same data with different seeds ("v1" and "v2")."""
    out = {}
    for version, seed in (("v1", 1), ("v2", 2)):
        ckpt_dir = tmp_path_factory.mktemp(f"ckpt-{version}")
        train(synthetic_data, TrainConfig.tiny(), seed=seed).save(ckpt_dir)
        out[version] = ckpt_dir
    return out


@pytest.fixture(scope="session")
def bundle_root_template(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bundles")
    for version, ckpt_dir in checkpoints.items():
        export_checkpoint(ckpt_dir, root, version)
    return root


@pytest.fixture(scope="session")
def bundle_root(bundle_root_template: Path) -> Path:
    """A bundle root with valid bundles "v1" and "v2"; tests must not modify it (use bundle_root_copy)."""
    return bundle_root_template


@pytest.fixture
def bundle_root_copy(bundle_root_template: Path, tmp_path: Path) -> Path:
    """A private copy of the bundle root that a test may modify (corrupt, add versions)."""
    dst = tmp_path / "bundles"
    shutil.copytree(bundle_root_template, dst)
    return dst


# The projection of the projected fixture bundle: half the tiny preset's dim (32).
PROJECTION_DIM = 16


@pytest.fixture(scope="session")
def projected_bundle(checkpoints: dict[str, Path], synthetic_data: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoint "v1" with its indices built again over a projection (`shortlist train --retune` with
    index_projection_dim), its scoring tuned over them and exported as bundle "p1"; tests must not modify it."""
    ckpt_dir = tmp_path_factory.mktemp("ckpt-projected")
    retune(checkpoints["v1"], synthetic_data, {"index_projection_dim": PROJECTION_DIM}).save(ckpt_dir)
    return export_checkpoint(ckpt_dir, tmp_path_factory.mktemp("bundles-projected"), "p1")
