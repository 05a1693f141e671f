"""One epoch of minibatch gradient steps, shown as progress: the loop Modules I and III share."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from training.progress import Progress


class Stepper(Protocol):
    """What run_epoch asks of an optimizer (torch's, or training.classifiers' row-wise Adam)."""

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def step(self) -> None: ...


def run_epoch(order: np.ndarray, batch_size: int, loss_of: Callable[[np.ndarray], torch.Tensor],
              opts: Sequence[Stepper], desc: str, progress: bool = True) -> float:
    """A step of every optimizer in `opts` on `loss_of(batch)` for each run of `batch_size` rows
    of `order`; the epoch's mean loss per row (weighted by batch size). A batch whose loss is not
    finite ends the epoch at once, its loss returned: the fit diverged, and steps on NaN
    gradients only spend time (the caller stops, training.divergence names the setting)."""
    total, count = 0.0, 0
    bar = Progress(range(0, len(order), batch_size), desc, enabled=progress)
    for start in bar:
        batch = order[start : start + batch_size]
        loss = loss_of(batch)
        if not math.isfinite(float(loss.detach())):
            return float(loss.detach())
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in opts:
            opt.step()
        total += float(loss.detach()) * len(batch)
        count += len(batch)
        bar.postfix(loss=f"{total / count:.4f}")
    return total / max(count, 1)
