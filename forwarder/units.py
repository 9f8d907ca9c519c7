"""Parse the human units used in config: durations ("500ms", "5m") and sizes ("256MiB")."""
from __future__ import annotations

import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB|k|K|M|G)?\s*$")
_SIZE_UNITS = {
    "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3,
    "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "k": 1024, "K": 1024, "M": 1024**2, "G": 1024**3,
}


def parse_duration(value: object) -> float:
    """Seconds from "1s", "500ms", "5m", "2h", "1d", or a bare number of seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like '1s' or '500ms', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"duration must not be negative, got {value!r}")
        return float(value)
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            return float(m.group(1)) * _DURATION_UNITS[m.group(2) or "s"]
    raise ValueError(f"expected a duration like '1s', '500ms', '5m', got {value!r}")


def parse_size(value: object) -> int:
    """Bytes from "256MiB", "10MB", "4096", or a bare integer."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '256MiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value!r}")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or "B"])
    raise ValueError(f"expected a size like '256MiB' or '10MB', got {value!r}")


def format_duration(seconds: float) -> str:
    """The shortest config spelling of a duration."""
    if seconds and seconds < 1:
        return f"{round(seconds * 1000)}ms"
    for unit, factor in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= factor and seconds % factor == 0:
            return f"{int(seconds // factor)}{unit}"
    return f"{seconds:g}s"
