"""A training config value of the JSON kind its setting takes: one check for `shortlist
train`'s settings (training.config) and the tree route's (training.tree_config)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from service.engine.jsonlines import json_kind

# The JSON values each kind of setting takes (a setting of another kind is a KeyError: add it here).
JSON_KINDS: dict[str, tuple[str, tuple[type, ...]]] = {
    "int": ("an integer", (int,)), "float": ("a number", (int, float)), "bool": ("true or false", (bool,)),
    "str": ("a string", (str,)), "float | None": ("a number or null", (int, float, type(None))),
    "dict[str, float]": ("an object", (dict,)), "dict[str, Any]": ("an object", (dict,)),
}


def json_value(name: str, kind: str, value: Any) -> Any:
    """`value` if it is of `kind`, never coerced ("256" is not a dim, true is not 1); a whole number
    written with a fraction (256.0) is the integer, as JSON Schema says. ValueError naming the
    setting otherwise."""
    wanted, types = JSON_KINDS[kind]
    if kind == "int" and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) != (bool in types) or not isinstance(value, types):
        raise ValueError(f"training config {name!r} must be {wanted}, got {json_kind(value)}")
    return value


@dataclass(frozen=True)
class Bounds:
    """The range a numeric setting takes: low (excluded with open_low) up to high (excluded with
    open_high). Numbers must be finite."""

    low: float
    high: float
    open_low: bool = False
    open_high: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low <= self.high):
            raise ValueError(f"a setting's bounds must be finite, low <= high: {self.low}, {self.high}")

    def __str__(self) -> str:
        low, high = _number(self.low), _number(self.high)
        return f"in {'(' if self.open_low else '['}{low}, {high}{')' if self.open_high else ']'}"

    def check(self, name: str, value: Any, integer: bool) -> None:
        """ValueError naming the setting unless value is a number (an integer if `integer`) in range."""
        number = isinstance(value, int) or (not integer and isinstance(value, float))
        ok = number and not isinstance(value, bool) and (isinstance(value, int) or math.isfinite(value))
        ok = ok and (value > self.low if self.open_low else value >= self.low)
        ok = ok and (value < self.high if self.open_high else value <= self.high)
        if not ok:
            kind = "an integer" if integer else "a finite number"
            raise ValueError(f"training config {name!r} must be {kind} {self}, got {_shown(value)}")


# Every numeric setting has both bounds: past the maximum a value only crashes a library (a C int
# or long overflows in torch, numpy or hnswlib), asks for an allocation no machine has, or diverges.
# Counts of documents, groups, rows or tokens (min_df, max_vocab, val_max_docs, ...): a C int, the
# largest size numpy's and torch's int32 id arrays index; no data set reaches it.
MAX_COUNT = 2**31 - 1
# A document's widest vector or token list (dim, index_projection_dim, tree.pca_dim, max_tokens):
# 64x the default dim 256 (256x max_tokens 64); the embedding table alone is vocabulary x dim float32
# (200,000 x 16,384: 13 GB), and an ONNX export encodes a text of 4 x max_tokens tokens.
MAX_WIDTH = 1 << 14
# Labels kept or drawn per document or token (m2_k_*, m1_*_negatives, token_shortlist_width,
# tree.negatives, tree.lexical_width): each is a [rows, k] array, 50-200x the defaults (8-50);
# at 10^5 rows 4,096 already takes 3 GB.
MAX_PER_ROW = 1 << 12
# Documents in a mini-batch: 64-256x the defaults (256-1024); Module III's all-label batches are
# batch x labels floats (2^16 x 50,000: 13 GB).
MAX_BATCH = 1 << 16
# Epochs, steps, rounds and iterations: 10^6 is days of training on the smallest data; beyond it a
# typo (10^30) loops until killed.
MAX_STEPS = 10**6
# hnswlib caps M at 10,000 itself (a warning, then M is 10,000): a larger M is not what is built.
MAX_HNSW_M = 10_000
# torch.set_num_threads and hnswlib take a C int; more threads than cores only contend.
MAX_THREADS = 1024
# Adam, SparseAdam and Adagrad (every optimiser of training) move each weight by up to about lr a
# step whatever the gradient's size; the weights are O(1) (unit-norm embeddings and what scores
# them): 10, 50x the largest default (tree.lr 0.2), already overshoots every step and only diverges.
MAX_LEARNING_RATE = 10.0
# A weight, scale or penalty of one term of a loss (m1_d, centroid_label_weight, m3_weight_decay,
# tree.lambda_n, tune_objective's, ...): the largest default is tree.lambda_n 3000, a sum over a
# node's pairs; at 10^6 the term alone decides the fit, and its float32 products overflow sooner.
MAX_WEIGHT = 1e6
# Points of the tuning objective (tune_source_margin, m3_min_gain): at most 8 metrics x 100 points
# x a weight of MAX_WEIGHT = 8e8, so a margin or gain of 10^9 is already "any".
MAX_POINTS = 1e9
# A seed: numpy takes any non-negative integer; torch's manual_seed and hnswlib's random_seed 64 bits
# or fewer. 32 bits is the range every command that takes one (--seed) accepts.
MAX_SEED = 2**32 - 1

UNIT = Bounds(0, 1)
COUNT_0, COUNT_1 = Bounds(0, MAX_COUNT), Bounds(1, MAX_COUNT)
WIDTH_0, WIDTH_1 = Bounds(0, MAX_WIDTH), Bounds(1, MAX_WIDTH)
PER_ROW_0, PER_ROW_1 = Bounds(0, MAX_PER_ROW), Bounds(1, MAX_PER_ROW)
BATCH = Bounds(1, MAX_BATCH)
STEPS_0, STEPS_1 = Bounds(0, MAX_STEPS), Bounds(1, MAX_STEPS)
LEARNING_RATE = Bounds(0, MAX_LEARNING_RATE, open_low=True)
WEIGHT, POSITIVE_WEIGHT = Bounds(0, MAX_WEIGHT), Bounds(0, MAX_WEIGHT, open_low=True)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _shown(value: Any) -> str:
    """value as written: an integer past 2^64 was read as a float (10^30, not 1000000000000000019884624838656)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**64:
        return f"{float(value):g}"
    return repr(value)
