"""The one config value toolkit: durations, sizes, integers, booleans, choices and URL text.

Every parser takes a raw TOML value or an environment string and returns the parsed value or
raises ValueError with a message saying what was expected. Every section of the config (and the
sinks' option checks) uses these, so ``nan``, ``inf``, negatives, exponents and values beyond a
key's documented maximum are refused the same way everywhere, before the agent starts.
"""
from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# Digits, an optional fraction, an optional unit: no sign, no exponent, no nan/inf spellings.
_DURATION = re.compile(r"^\s*([0-9]{1,15}(?:\.[0-9]{1,9})?) *(ms|s|m|h|d)?\s*$")
# Or several such parts, largest unit first, each unit once: "2m15s", "1h30m", "1d12h", "1s500ms".
_DURATION_PART = re.compile(r"([0-9]{1,15}(?:\.[0-9]{1,9})?) *(ms|s|m|h|d) *")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE = re.compile(r"^\s*([0-9]{1,15}(?:\.[0-9]{1,9})?) *(B|KB|MB|GB|KiB|MiB|GiB|k|K|M|G)?\s*$")
_SIZE_UNITS = {
    "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3,
    "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "k": 1024, "K": 1024, "M": 1024**2, "G": 1024**3,
}
# Beyond any key's maximum; keeps every later arithmetic (monotonic + timeout, Event.wait) finite.
_MAX_SECONDS = 100 * 365 * 86400.0
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _finite_number(value: object, what: str) -> float:
    # TOML booleans are ints to Python; "timeout = true" is a mistake, not 1 second.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected {what}, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"must not be negative, got {value!r}")
    return float(value)


def _compound(text: str) -> float | None:
    """Seconds of "2m15s" / "1h30m" (units largest first, each once), or None when it is not one."""
    text = text.strip()
    position, total, last = 0, 0.0, float("inf")
    while position < len(text):
        m = _DURATION_PART.match(text, position)
        if m is None:
            return None
        factor = _DURATION_UNITS[m.group(2)]
        if factor >= last:  # "15s2m", "1m1m": a typo, not a duration
            return None
        total, last, position = total + float(m.group(1)) * factor, factor, m.end()
    return total if position else None


def _seconds(value: object) -> float:
    if isinstance(value, str):
        m = _DURATION.match(value)
        if not m:
            compound = _compound(value)
            if compound is None:
                raise ValueError(f"expected a duration like '1s', '500ms', '5m' or '2m15s', got {value!r}")
            return compound
        return float(m.group(1)) * _DURATION_UNITS[m.group(2) or "s"]
    return _finite_number(value, "a duration like '1s' or '500ms'")


def parse_duration(value: object) -> float:
    """Seconds from "1s", "500ms", "5m", "2h", "1d", "2m15s", "1h30m", or a bare number of seconds (at most 100 years)."""
    seconds = _seconds(value)
    if seconds > _MAX_SECONDS:
        raise ValueError(f"must be at most {format_duration(_MAX_SECONDS)}, got {value!r}")
    return seconds


def parse_size(value: object) -> int:
    """Bytes from "256MiB", "10MB", "4096", or a bare integer."""
    if isinstance(value, str):
        m = _SIZE.match(value)
        if not m:
            raise ValueError(f"expected a size like '256MiB' or '10MB', got {value!r}")
        return int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or "B"])
    if isinstance(value, float):
        raise ValueError(f"expected a whole number of bytes or a size like '256MiB', got {value!r}")
    return int(_finite_number(value, "a size like '256MiB'"))


def format_duration(seconds: float) -> str:
    """The shortest config spelling of a duration."""
    if seconds and seconds < 1:
        return f"{round(seconds * 1000)}ms"
    for unit, factor in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= factor and seconds % factor == 0:
            return f"{int(seconds // factor)}{unit}"
    return f"{seconds:g}s"


def format_size(size: int) -> str:
    """The shortest exact config spelling of a size."""
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size}B"


# -- bounded parsers: each returns a parse(value) for one key ------------------------------------

def duration(low: float, high: float, *, low_inclusive: bool = True) -> Callable[[Any], float]:
    """A duration in [low, high] (or (low, high] with ``low_inclusive=False``); ``high`` must be finite."""
    def parse(value: Any) -> float:
        seconds = _seconds(value)
        if (seconds < low) if low_inclusive else (seconds <= low):
            word = "at least" if low_inclusive else "greater than"
            raise ValueError(f"must be {word} {format_duration(low)}, got {value!r}")
        if seconds > high:
            raise ValueError(f"must be at most {format_duration(high)}, got {value!r}")
        return seconds

    return parse


def size(low: int, high: int) -> Callable[[Any], int]:
    """A size in bytes in [low, high]."""
    def parse(value: Any) -> int:
        number = parse_size(value)
        if not low <= number <= high:
            raise ValueError(f"must be between {format_size(low)} and {format_size(high)}, got {value!r}")
        return number

    return parse


def integer(low: int, high: int) -> Callable[[Any], int]:
    """A TOML integer in [low, high]."""
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
        if not low <= value <= high:
            raise ValueError(f"must be an integer from {low} to {high}, got {value!r}")
        return value

    return parse


def boolean(value: Any) -> bool:
    """true/false (TOML), or true/false/yes/no/on/off/1/0 as text (environment overrides)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in (*_TRUE, *_FALSE):
        return value.strip().lower() in _TRUE
    raise ValueError(f"expected true or false, got {value!r}")


def suggest(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, else ``""``."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def choice(options: tuple[str, ...], *, fold_case: bool = True,
           aliases: dict[str, str] | None = None) -> Callable[[Any], str]:
    """One of ``options`` (case-folded and stripped unless ``fold_case=False``), with a did-you-mean."""
    def parse(value: Any) -> str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r} (one of {', '.join(options)})")
        text = value.strip().lower() if fold_case else value
        text = (aliases or {}).get(text, text)
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {value!r}{suggest(text, options)}")
        return text

    return parse


def control_characters(text: str) -> bool:
    """Whether ``text`` holds a control character (CR, LF, TAB, NUL, DEL, C1) or whitespace."""
    return any(ord(c) < 0x21 or 0x7F <= ord(c) < 0xA0 for c in text)


def url_text(value: Any) -> str:
    """A URL string without control characters or spaces (urlsplit silently drops CR/LF/TAB)."""
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    text = value.strip()
    if control_characters(text):
        raise ValueError("the URL contains control characters or spaces (CR, LF, TAB, NUL...); "
                         "remove them")
    return text


# -- tables: many keys at once, every problem collected --------------------------------------------

def parse_labelled(parsers: Mapping[str, Callable[[Any], Any]], raw: Mapping[str, tuple[Any, str]],
                   problems: list[str]) -> dict[str, Any]:
    """Parse each ``key: (value, label)`` of ``raw`` with ``parsers[key]``.

    Returns the values that parsed; each ValueError is appended to ``problems`` as
    ``"{label}: {message}"`` (the label says where the value came from: a key or a variable).
    """
    values: dict[str, Any] = {}
    for key, (value, label) in raw.items():
        try:
            values[key] = parsers[key](value)
        except ValueError as exc:
            problems.append(f"{label}: {exc}")
    return values


def parse_table(parsers: Mapping[str, Callable[[Any], Any]], table: Mapping[str, Any], where: str,
                problems: list[str]) -> dict[str, Any]:
    """The keys of ``parsers`` present in ``table``, parsed; problems read ``"{where}.{key}: ..."``."""
    return parse_labelled(parsers, {key: (table[key], f"{where}.{key}") for key in parsers if key in table}, problems)
