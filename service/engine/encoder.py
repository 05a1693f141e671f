"""The encoder at serving time: the bundle's ONNX graph run by onnxruntime."""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
from pathlib import Path

import numpy as np

# onnxruntime >= 1.29 sends usage telemetry from Linux too, and writes a device id under the
# user's home: a serving process must not talk to hosts its operator did not name. Read when
# onnxruntime loads, so set first; an operator who wants it sets ORT_DISABLE_TELEMETRY=0.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
import onnxruntime as ort  # noqa: E402

log = logging.getLogger("shortlist.engine")
ENCODER_INPUTS = ("ids", "weights")
ENCODER_OUTPUT = "embedding"


@functools.cache
def execution_providers() -> tuple[str, ...]:
    """CUDA when this onnxruntime build has it and a GPU is visible, else CPU (said once)."""
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" in available:
        # onnxruntime-gpu lists its CUDA provider whether or not there is a device, and then
        # falls back per session with a warning each time: decide once, and say so.
        if _gpu_visible():
            log.info("encoder: onnxruntime CUDA execution provider on the visible GPU")
            return ("CUDAExecutionProvider", "CPUExecutionProvider")
        log.warning("encoder: onnxruntime has the CUDA provider but no GPU is visible: serving on CPU")
    elif len(builds := _onnxruntime_builds()) > 1:
        # Both wheels install one `onnxruntime` module; the one installed last wins, silently.
        log.warning(
            "encoder: %s are both installed and share one onnxruntime module, whose files have no "
            "CUDA provider: serving on CPU (README, 'For the CUDA provider': uninstall "
            "onnxruntime, reinstall onnxruntime-gpu)", " and ".join(builds))
    return ("CPUExecutionProvider",)


def _onnxruntime_builds() -> list[str]:
    """The onnxruntime distributions installed (several is a broken install, not a choice)."""
    builds = []
    for name in ("onnxruntime", "onnxruntime-gpu"):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        builds.append(name)
    return builds


def _gpu_visible() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or any(Path("/dev").glob("nvidia[0-9]*"))


class OnnxEncoder:
    """Padded token ids int64 [B, T] + weights float32 [B, T] -> unit embeddings float32 [B, D].

    `run` is safe to call from several threads at once (onnxruntime sessions are).
    """

    def __init__(self, path: str | Path, threads: int = 1, providers: list[str] | None = None) -> None:
        opts = ort.SessionOptions()
        # Explicit threads: the service runs several requests in parallel threads, so each
        # session call must not also fan out over every core.
        opts.intra_op_num_threads = max(1, int(threads))
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.session = ort.InferenceSession(
                str(path), sess_options=opts, providers=providers or list(execution_providers())
            )
        except Exception as exc:  # onnxruntime raises its own exception types for bad graphs
            raise ValueError(f"{path}: cannot load ONNX encoder: {exc}") from exc
        names = tuple(i.name for i in self.session.get_inputs())
        if names != ENCODER_INPUTS:
            raise ValueError(f"{path}: encoder inputs are {names}, expected {ENCODER_INPUTS}")
        outputs = self.session.get_outputs()
        if len(outputs) != 1 or outputs[0].name != ENCODER_OUTPUT:
            raise ValueError(f"{path}: encoder must have one output named {ENCODER_OUTPUT!r}")
        self.dim = outputs[0].shape[-1]
        self._output_names = [ENCODER_OUTPUT]

    def run(self, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        # The output named, not None: None makes onnxruntime list the graph's outputs on every
        # call (~3 us of a ~16 us single-query run).
        return self.session.run(self._output_names, {"ids": ids, "weights": weights})[0]

