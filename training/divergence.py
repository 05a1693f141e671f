"""A training stage that diverged (a learning rate or a weight set far too high) stops there.

Each stage of training (training/pipeline.py: Module I, the centroids, Module III, the token
table, the tree's parts) ends with check_fitted on what it learned: before it, a diverged fit
ran on to the end, saved a checkpoint of NaN (whose checkpoint.json its own reader refused),
or one that export refused naming a derived file (ONNX parity, an HNSW index, tree.npz), or
stopped in a later stage's linear algebra ("Eigenvalues did not converge").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

# The largest magnitude a learned value may take, by the dtype it is stored in. float32: one
# whose square overflows (|x| > 1.8e19) makes the norms and dot products training and serving
# take over it infinite (the encoder's L2 step then gives 0 or NaN): as unusable as a NaN, and
# far past anything a converging fit reaches. float16: its own range (65504), past which the
# stored value is infinite.
MAX_MAGNITUDE = {"float32": float(np.sqrt(np.finfo(np.float32).max)), "float16": float(np.finfo(np.float16).max)}

Learned = np.ndarray | torch.Tensor | Sequence[float]


class DivergedError(ValueError):
    """A stage's fit ran off: a ValueError, so the CLI reports it as one line and exits 2."""


def check_fitted(stage: str, advice: str, arrays: Mapping[str, Learned], dtype: str = "float32") -> None:
    """DivergedError "STAGE: training diverged: NaN in NAME (ADVICE)" unless every value of
    every array (a loss history counts) is finite and within MAX_MAGNITUDE[dtype] (int8 is
    quantised from float32: checked as float32)."""
    limit = MAX_MAGNITUDE.get(dtype, MAX_MAGNITUDE["float32"])
    for name, values in arrays.items():
        problem = _problem(_numpy(values), limit, dtype)
        if problem is not None:
            raise DivergedError(f"{stage}: training diverged: {problem.format(name)} ({advice})")


def _numpy(values: Learned) -> np.ndarray:
    """The values as a numpy array: an array or a CPU tensor's memory itself, never a copy (an
    [L, D] array is 1 GB at 10^6 labels); a loss history (a list) as float64."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    return values if isinstance(values, np.ndarray) else np.asarray(values, dtype=np.float64)


def _problem(values: np.ndarray, limit: float, dtype: str) -> str | None:
    """What is wrong with `values`, a format string for the array's name (None: nothing)."""
    if not values.size:
        return None
    # max and min, not abs(): no temporary the size of the array; a NaN propagates through both.
    high, low = float(values.max()), float(values.min())
    if math.isnan(high) or math.isnan(low):
        return "NaN in {}"
    peak = max(high, -low)
    if math.isinf(peak):
        return "an infinite value in {}"
    if peak > limit:
        return f"a value of {peak:.3g} in {{}}, past the {limit:.3g} usable in {dtype}"
    return None
