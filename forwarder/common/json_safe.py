"""Make a value from an untrusted source serializable by orjson, bounded, keeping what it said.

An audit entry may carry what a refused client sent: a number beyond 64 bits, a lone surrogate, a
NaN, a deep or huge structure. orjson refuses the first two outright; a record must never fail on
them. Numbers beyond 64 bits keep their digits as text, undecodable text its code points as
``\\uXXXX`` escapes; strings, lists and nesting are bounded.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

MAX_TEXT = 65536  # characters of one string (a hook's output limit is at most this)
MAX_ITEMS = 1000  # entries of one list or object
MAX_DEPTH = 32
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what orjson writes


def _text(value: str) -> str:
    if len(value) > MAX_TEXT:
        value = value[: MAX_TEXT - 1] + "…"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: kept visible, never a failed record
        value = value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def json_safe(value: Any, _depth: int = 0) -> Any:
    """``value`` as plain JSON types orjson always serializes: dict, list, str, int, float, bool, None."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if _INT_MIN <= value <= _INT_MAX else _text(str(value))
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return _text(value)
    if _depth >= MAX_DEPTH:
        return "…"
    if isinstance(value, Mapping):
        return {_text(str(k)): json_safe(v, _depth + 1) for k, v in list(value.items())[:MAX_ITEMS]}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, _depth + 1) for v in value[:MAX_ITEMS]]
    if isinstance(value, (bytes, bytearray)):
        return _text(bytes(value[: MAX_TEXT * 4]).decode("utf-8", "backslashreplace"))
    return _text(repr(value))
