"""A training config value of the JSON kind its setting takes: one check for `shortlist
train`'s settings (training.config) and the tree route's (training.tree_config)."""

from __future__ import annotations

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
