"""Built-in sinks (``stdout``, ``file``) and the small helpers every sink shares.

A third-party sink is a class with ``OPTIONS``, ``check(options)``, a
``(options, context)`` constructor, ``max_batch``, ``send(batch)`` that never raises and
``close()``, registered under the entry-point group ``scheduled_events_forwarder.sinks``. The
types it needs are re-exported here so it can write ``from sinks import Record, Ok, Retry``.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from typing import Any

from forwarder.sinkapi import Ok, Record, Reject, Result, Retry, Sink, SinkContext
from forwarder.common.values import duration, integer

__all__ = [
    "Ok", "Record", "Reject", "Result", "Retry", "Sink", "SinkContext",
    "check_bool", "check_int_range", "check_positive_duration", "check_readable_file", "retry_for_os_error",
    "unknown_options",
]

# A sink call that takes longer than this is stuck, not slow (forwarder.common.values refuses nan and inf).
MAX_SINK_TIMEOUT = 600.0

# Local-I/O failures are retried, never dead-lettered: a full disk or a permission fixed by the
# operator comes back, and the journal keeps the records until it does.
_RETRY_REASONS = {
    errno.ENOSPC: "disk_full",
    errno.EDQUOT: "disk_full",
    errno.EIO: "io_error",
    errno.EFBIG: "file_too_large",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EROFS: "read_only_filesystem",
}


def retry_for_os_error(exc: OSError) -> Retry:
    """The Retry for a local I/O error, with a snake_case reason naming the cause."""
    return Retry(reason=_RETRY_REASONS.get(exc.errno or 0, "os_error"))


def unknown_options(options: Mapping[str, Any], known: Mapping[str, str]) -> list[str]:
    """One problem per option name the sink does not know."""
    return [
        f"unknown option {key!r} (known: {', '.join(sorted(known))})"
        for key in options
        if key not in known
    ]


def check_bool(options: Mapping[str, Any], key: str) -> list[str]:
    """A problem if ``key`` is present and not a TOML boolean (sinks read the raw value: "false" is truthy)."""
    if key in options and not isinstance(options[key], bool):
        return [f"option {key!r} must be true or false, got {options[key]!r}"]
    return []


def check_int_range(options: Mapping[str, Any], key: str, low: int, high: int) -> list[str]:
    """A problem if ``key`` is set but not an integer in [low, high]."""
    if key not in options:
        return []
    try:
        integer(low, high)(options[key])
    except ValueError as exc:
        return [f"option {key!r} {exc}"]
    return []


def check_positive_duration(options: Mapping[str, Any], key: str, high: float = MAX_SINK_TIMEOUT) -> list[str]:
    """A problem if ``key`` is set but not a duration greater than zero and at most ``high``."""
    if key not in options:
        return []
    try:
        duration(0.0, high, low_inclusive=False)(options[key])
    except ValueError as exc:
        return [f"option {key!r}: {exc}"]
    return []


def check_readable_file(options: Mapping[str, Any], key: str) -> list[str]:
    """A problem if ``key`` is set but does not name a readable file."""
    value = options.get(key)
    if value is None:
        return []
    if not isinstance(value, str) or not value.strip():
        return [f"option {key!r} must be a file path, got {value!r}"]
    path = os.path.expanduser(value)
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        return [f"option {key!r}: {value} is not a readable file"]
    return []
