"""Export the torch encoder to ONNX and check it against torch."""

from __future__ import annotations

import copy
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from service.engine import vectors
from service.engine.encoder import ENCODER_INPUTS, ENCODER_OUTPUT, OnnxEncoder
from service.engine.schema import ENCODER_DATA
from service.engine.tokenizer import Tokenizer
from training.encoder import SiameseEncoder

ONNX_OPSET = 17
PARITY_TOLERANCE = 1e-5
# float16: the token embedding table stored in half the bytes and cast to float32 after the
# Gather (onnxruntime's CPU Gather and Cast take float16): every serving process maps half the
# pages (debian-deps: 36 -> 18 MiB). int8: a quarter, with a float32 scale per row (the label
# vectors' quantiser, service.engine.vectors), the gathered rows cast and scaled; debian-deps
# 18 -> 9 MiB more (bench/RESULTS.md, issue 21).
DEFAULT_TABLE_DTYPE = "int8"
TABLE_DTYPES = ("int8", "float16", "float32")


def export_encoder(encoder: SiameseEncoder, path: Path, table_dtype: str = DEFAULT_TABLE_DTYPE) -> None:
    """Write the encoder with dynamic batch and token axes, its token embedding table stored as
    `table_dtype` (TABLE_DTYPES); its initializers of 1 KiB and more (the table) go to
    ENCODER_DATA beside it, which onnxruntime memory-maps instead of copying: serving processes
    share those pages."""
    if table_dtype not in TABLE_DTYPES:
        raise ValueError(f"encoder table dtype {table_dtype!r}: one of {', '.join(TABLE_DTYPES)}")
    encoder = encoder.cpu().eval()
    ids = torch.ones((2, 3), dtype=torch.int64)
    weights = torch.full((2, 3), 0.5, dtype=torch.float32)
    dynamic = {"ids": {0: "batch", 1: "tokens"}, "weights": {0: "batch", 1: "tokens"}, ENCODER_OUTPUT: {0: "batch"}}
    with warnings.catch_warnings():
        # The TorchScript exporter warns that it is deprecated; it still produces the smaller,
        # faster graph for this model (no Loop node) and is what parity is checked on.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            encoder,
            (ids, weights),
            str(path),
            input_names=list(ENCODER_INPUTS),
            output_names=[ENCODER_OUTPUT],
            dynamic_axes=dynamic,
            opset_version=ONNX_OPSET,
            dynamo=False,
        )
    model = onnx.load(str(path))
    if table_dtype != "float32":
        _store_table(model.graph, table_dtype)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=ENCODER_DATA, size_threshold=1024)
    # onnx creates the data file private to its writer (0600); a bundle is read by the serving
    # user, often another one (a container's read-only volume): the same mode as the graph file.
    # (A table under the threshold stays inside the graph: no data file, an optional one.)
    if (path.parent / ENCODER_DATA).exists():
        shutil.copymode(path, path.parent / ENCODER_DATA)


def _store_table(graph: onnx.GraphProto, table_dtype: str) -> None:
    """The initializer the Gather reads rows of stored as `table_dtype` (float16, or int8 with a
    [V, 1] scale per row gathered beside it), the rows cast to float32 after the Gather (before
    the TF-IDF weights multiply them), so the rest of the graph is unchanged."""
    tables = {t.name: t for t in graph.initializer}
    gather = next(n for n in graph.node if n.op_type == "Gather" and n.input[0] in tables)
    table = tables[gather.input[0]]
    values = numpy_helper.to_array(table)
    with np.errstate(over="ignore", invalid="ignore"):  # a value out of range is refused just below
        stored, scales = vectors.quantize(values, table_dtype)
    if not np.isfinite(stored).all() or (scales is not None and not np.isfinite(scales).all()):
        raise ValueError(f"token embedding table: values up to {np.abs(values).max():.3g} overflow {table_dtype}; "
                         "export with the float32 table")
    table.CopyFrom(numpy_helper.from_array(stored, table.name))
    rows = gather.output[0]
    gather.output[0] = f"{rows}_{table_dtype}"
    cast_out = rows if scales is None else f"{rows}_unscaled"
    added = [helper.make_node("Cast", [gather.output[0]], [cast_out], to=TensorProto.FLOAT, name=f"{gather.name}_cast")]
    if scales is not None:
        graph.initializer.append(numpy_helper.from_array(scales[:, None], f"{table.name}_scales"))
        added += [helper.make_node("Gather", [f"{table.name}_scales", gather.input[1]], [f"{rows}_scales"],
                                   name=f"{gather.name}_scales"),
                  helper.make_node("Mul", [cast_out, f"{rows}_scales"], [rows], name=f"{gather.name}_scale")]
    at = list(graph.node).index(gather) + 1
    for offset, node in enumerate(added):
        graph.node.insert(at + offset, node)


def as_served(encoder: SiameseEncoder, table_dtype: str) -> SiameseEncoder:
    """The torch encoder with the values the exported graph holds (its table rounded to
    `table_dtype`): the reference the graph's parity is checked against."""
    if table_dtype == "float32":
        return encoder
    served = copy.deepcopy(encoder).cpu()
    with torch.no_grad():
        values = served.embedding.detach().numpy()
        served.embedding.copy_(torch.from_numpy(vectors.as_served(values, table_dtype)))
    return served


def parity_texts(tokenizer: Tokenizer, sample: Sequence[str], n: int = 1000, seed: int = 0) -> list[str]:
    """`n` texts for the parity check: edge cases first, then a seeded sample of real texts."""
    rng = np.random.default_rng(seed)
    vocab = tokenizer.vocab
    long_text = " ".join(vocab[int(i)] for i in rng.integers(0, len(vocab), size=4 * tokenizer.max_tokens))
    edge = ["", "   ", "zzqxj qqqvvk xxyyzz", "!!! ??? ...", long_text, long_text.upper()]
    pool = list(sample) or vocab
    picks = [pool[int(i)] for i in rng.integers(0, len(pool), size=max(0, n - len(edge)))]
    return (edge + picks)[:n]


def check_parity(
    encoder: SiameseEncoder, onnx_path: Path, tokenizer: Tokenizer, texts: Sequence[str], batch_size: int = 128
) -> float:
    """Max |onnxruntime - torch| over every coordinate of every text; raises above the tolerance."""
    session = OnnxEncoder(onnx_path, threads=1, providers=["CPUExecutionProvider"])
    encoder = encoder.cpu().eval()
    worst = 0.0
    for start in range(0, len(texts), batch_size):
        ids, weights = tokenizer.encode_batch(texts[start : start + batch_size])
        ort_out = session.run(ids, weights)
        with torch.no_grad():
            ref = encoder(torch.from_numpy(ids), torch.from_numpy(weights)).numpy()
        worst = max(worst, float(np.abs(ort_out - ref).max()))
    # Batch 1 is the serving hot path: check it on its own too (different padding width).
    for text in texts[:50]:
        ids, weights = tokenizer.encode_batch([text])
        with torch.no_grad():
            ref = encoder(torch.from_numpy(ids), torch.from_numpy(weights)).numpy()
        worst = max(worst, float(np.abs(session.run(ids, weights) - ref).max()))
    if worst > PARITY_TOLERANCE:
        raise ValueError(f"{onnx_path}: ONNX encoder differs from torch by {worst:.2e} > {PARITY_TOLERANCE:.0e}")
    return worst
