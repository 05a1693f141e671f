"""The encoder's token embedding table stored as int8 with a scale per row (the export's default)
or float16 answers as the float32 table does; a table shorter than the vocabulary is refused with
a message naming it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from _api_helpers import sample_titles

from model_export.export import export_checkpoint
from service.engine import BundleError, Predictor
from service.engine.schema import ENCODER, ENCODER_DATA, MANIFEST, sha256_file


@pytest.fixture(scope="module")
def table_bundles(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """v1's checkpoint exported with each other table (`shortlist export --encoder-dtype ...`)."""
    root = tmp_path_factory.mktemp("tables")
    return {dtype: export_checkpoint(checkpoints["v1"], root, f"v1-{dtype}", n_parity=50, encoder_dtype=dtype)
            for dtype in ("float16", "float32")}


@pytest.mark.parametrize(("dtype", "size_ratio"), [("int8", 0.35), ("float16", 0.6)])
def test_a_smaller_table_answers_as_the_float32_one(bundle_root: Path, table_bundles: dict[str, Path],
                                                    synthetic_data: Path, dtype: str, size_ratio: float) -> None:
    texts = sample_titles(synthetic_data, 100)
    stored = bundle_root / "v1" if dtype == "int8" else table_bundles[dtype]  # int8: the default export
    assert json.loads((stored / MANIFEST).read_text())["metrics"]["encoder_table_dtype"] == dtype
    full = (table_bundles["float32"] / ENCODER_DATA).stat().st_size
    assert (stored / ENCODER_DATA).stat().st_size < size_ratio * full
    small, single = Predictor.load(stored), Predictor.load(table_bundles["float32"])
    assert np.abs(small.encode(texts) - single.encode(texts)).max() < 1e-2
    ids_h, scores_h = small.predict_ids(texts, k=5)
    ids_s, scores_s = single.predict_ids(texts, k=5)
    overlap = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(ids_h.tolist(), ids_s.tolist(), strict=True)])
    assert overlap >= 0.97 and np.mean(ids_h[:, 0] == ids_s[:, 0]) >= 0.97
    assert np.abs(scores_h - scores_s).max() < 2e-2


def _rewrite_table(bundle: Path, change: Callable[[np.ndarray], np.ndarray]) -> None:
    """The bundle's encoder with its table changed, the manifest's checksums updated (a fault
    of the export, not of the files after it)."""
    import onnx  # the train extra's: the service itself never imports it
    from onnx import numpy_helper

    model = onnx.load(str(bundle / ENCODER))
    table = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    table.CopyFrom(numpy_helper.from_array(change(numpy_helper.to_array(table)), table.name))
    (bundle / ENCODER_DATA).unlink()  # onnx appends to an existing data file
    onnx.save_model(model, str(bundle / ENCODER), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=ENCODER_DATA, size_threshold=1024)
    manifest = json.loads((bundle / MANIFEST).read_text())
    for name in (ENCODER, ENCODER_DATA):
        manifest["files"][name] = sha256_file(bundle / name)
    (bundle / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(("change", "message"), [
    # the start-up check encodes every token id: the last one reads past the table
    (lambda t: t[:-1], r"token ids \d+\.\.\d+: .*out of"),
], ids=["one-row-short"])
def test_a_table_shorter_than_the_vocabulary_is_refused(bundle_root: Path, tmp_path: Path,
                                                      change: Callable[[np.ndarray], np.ndarray], message: str) -> None:
    bundle = tmp_path / "v1"
    shutil.copytree(bundle_root / "v1", bundle)
    _rewrite_table(bundle, change)
    with pytest.raises(BundleError, match=message):
        Predictor.load(bundle)


@pytest.mark.parametrize(("dtype", "value", "refused"), [
    ("float16", 65504.0, False),  # float16's largest finite value: at the edge, kept
    ("float16", 65520.0, True),  # past it (rounds to inf)
    ("float16", 1e6, True),
    ("int8", 1e6, False),  # a row's scale is float32: any finite table fits
    ("int8", float("inf"), True),
    ("float32", float("inf"), False),  # stored as trained; the engine's start-up check refuses it
])
def test_a_table_the_stored_dtype_cannot_hold_is_refused_at_export(tmp_path: Path, dtype: str, value: float,
                                                                   refused: bool) -> None:
    import torch

    from model_export.onnx_export import export_encoder
    from training.encoder import SiameseEncoder

    encoder = SiameseEncoder(vocab_size=20, dim=8, seed=0)
    with torch.no_grad():
        encoder.embedding[3, 2] = value
    path = tmp_path / ENCODER
    if refused:
        with pytest.raises(ValueError, match=f"overflow {dtype}"):
            export_encoder(encoder, path, dtype)
    else:
        export_encoder(encoder, path, dtype)  # a table this small stays inside the graph
        assert path.is_file() and not (tmp_path / ENCODER_DATA).exists()
