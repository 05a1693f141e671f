"""How a bundle stores its [L, D] label vectors (the manifest's vector_dtype): one definition for
the writers (export, label changes, shards, training's view of what serving reads) and the
readers (service.engine.scorers, the added-label search).

float32 and float16 rows are stored as they are. int8 rows (format 4) come with a float32 scale
per row: row l stands for scales[l] * values[l], with scales[l] = max_j |x_lj| / 127 and values =
round(x_l / scales[l]) (symmetric, so a row's sign and zero are exact; an all-zero row has scale 0).
A dot product is then scales[l] * (values[l] . q): the gather reads a quarter of float32's bytes
and its cast to float32 is a plain vector instruction, where float16's needs a table lookup
(debian-deps: 41 -> 21 MiB resident, bench/RESULTS.md issue 21).
"""

from __future__ import annotations

import numpy as np

INT8_LEVELS = 127
_ROWS_AT_ONCE = 1 << 16  # rows quantised or dequantised at a time (bounded temporaries at 10^6 labels)


# Every float16 value's float32 value, by its bits. numpy's own float16 -> float32 cast has no
# vector instructions in the published wheels and slows down several-fold on some values
# (debian-deps' centroid rows: 93 us for a query's 120 rows of 256, the classifier rows 32 us);
# a lookup in this table (256 KiB) gives the same bits at ~30 us for either.
_FLOAT16_AS_FLOAT32 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def as_float32(values: np.ndarray) -> np.ndarray:
    """`values` as float32 (a new array for float16 values, exactly their value; others as they are
    when already float32)."""
    if values.dtype == np.float16:
        return _FLOAT16_AS_FLOAT32.take(values.view(np.uint16), mode="wrap")  # (every index is in range)
    return values.astype(np.float32, copy=False)


def quantize(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """x [L, D] as stored in a bundle of vector_dtype `dtype`: (values, scales [L] float32 for int8,
    else None)."""
    x = np.asarray(x)
    if dtype != "int8":
        return np.ascontiguousarray(x, dtype=dtype), None
    values = np.empty(x.shape, dtype=np.int8)
    scales = np.empty(len(x), dtype=np.float32)
    for start in range(0, len(x), _ROWS_AT_ONCE):
        part = np.asarray(x[start : start + _ROWS_AT_ONCE], dtype=np.float32)
        scale = np.abs(part).max(axis=1, initial=0.0) / INT8_LEVELS
        safe = np.where(scale > 0, scale, 1.0)[:, None]
        values[start : start + len(part)] = np.rint(part / safe).clip(-INT8_LEVELS, INT8_LEVELS)
        scales[start : start + len(part)] = scale
    return values, scales


def dequantize(values: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
    """The float32 rows that stored `values` (and int8 `scales`) stand for."""
    out = np.empty(values.shape, dtype=np.float32)
    for start in range(0, len(values), _ROWS_AT_ONCE):
        part = slice(start, start + _ROWS_AT_ONCE)
        out[part] = values[part]
        if scales is not None:
            out[part] *= np.asarray(scales[part], dtype=np.float32)[:, None]
    return out


def as_served(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 x [L, D] rounded as a bundle of vector_dtype `dtype` stores it: the values serving reads."""
    return dequantize(*quantize(x, dtype))


def appended(values: np.ndarray, scales: np.ndarray | None, rows: np.ndarray,
             dtype: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Stored `values` (and int8 `scales`) with float32 `rows` appended, the stored rows kept as
    they are: (values, scales, the new rows' float32 values as stored)."""
    new_values, new_scales = quantize(rows, dtype)
    out_scales = None if scales is None else np.concatenate((scales, new_scales)).astype(np.float32)
    return np.vstack((values, new_values)), out_scales, dequantize(new_values, new_scales)


def row_norms(values: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
    """The L2 norm of every row the stored values stand for, float64 [L], a block of rows at a time."""
    out = np.empty(len(values))
    for start in range(0, len(values), _ROWS_AT_ONCE):
        part = slice(start, start + _ROWS_AT_ONCE)
        out[part] = np.linalg.norm(dequantize(values[part], None if scales is None else scales[part]), axis=1)
    return out
