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
    """The range a numeric setting takes: low (excluded with open_low) up to high (None: no upper
    bound; excluded with open_high). Numbers must be finite."""

    low: float
    high: float | None = None
    open_low: bool = False
    open_high: bool = False

    def __str__(self) -> str:
        if self.high is None and self.low == -math.inf:
            return ""
        low = _number(self.low)
        if self.high is None:
            return f"{'>' if self.open_low else '>='} {low}"
        high = _number(self.high)
        return f"in {'(' if self.open_low else '['}{low}, {high}{')' if self.open_high else ']'}"

    def check(self, name: str, value: Any, integer: bool) -> None:
        """ValueError naming the setting unless value is a number (an integer if `integer`) in range."""
        number = isinstance(value, int) or (not integer and isinstance(value, float))
        ok = number and not isinstance(value, bool) and (isinstance(value, int) or math.isfinite(value))
        ok = ok and (value > self.low if self.open_low else value >= self.low)
        ok = ok and (self.high is None or (value < self.high if self.open_high else value <= self.high))
        if not ok:
            kind = "an integer" if integer else "a finite number"
            raise ValueError(f"training config {name!r} must be {f'{kind} {self}'.strip()}, got {value!r}")


AT_LEAST_0, AT_LEAST_1, POSITIVE = Bounds(0), Bounds(1), Bounds(0, open_low=True)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
