"""Pure inference: tokenizer, bundle reader, encoder session, shortlist sources, scorers.

Usable without HTTP: evaluation and benchmarks call it directly. Never imports torch.
`from service.engine import Predictor` loads onnxruntime and hnswlib only when asked for:
importing a submodule (the tokenizer, the schema) imports nothing else.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Bundle": "service.engine.bundle",
    "BundleError": "service.engine.schema",
    "Manifest": "service.engine.schema",
    "Prediction": "service.engine.predictor",
    "Predictor": "service.engine.predictor",
    "PredictorOptions": "service.engine.predictor",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'service.engine' has no attribute {name!r}")
