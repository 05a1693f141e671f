"""Pure inference: tokenizer, bundle reader, encoder session, indices, scorers.

Usable without HTTP: evaluation and benchmarks call it directly. Never imports torch.
"""

from service.engine.bundle import Bundle, BundleError, Manifest
from service.engine.predictor import Prediction, Predictor

__all__ = ["Bundle", "BundleError", "Manifest", "Prediction", "Predictor"]
