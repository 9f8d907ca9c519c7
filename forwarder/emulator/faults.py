"""Injected faults: queued bursts of bad responses that matching requests consume in order."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from forwarder.emulator.model import SpecError
from forwarder.common.values import parse_duration, parse_size

# status: an error status (500, 410, 429, 503 ...) with optional Retry-After.
# slow: answer normally after `delay` seconds.  hang: hold the request for `delay` seconds (or until
# the emulator stops), then close the connection without an answer.  drop: close at once, no answer.
# malformed: 200 with truncated JSON.  html: an HTML error page (status default 200, like a proxy
# or captive portal answering in IMDS's place).
# Hostile answers (docs/imds-transport.md), each shaping the normal 200 answer:
# drip: sent one byte every `delay` (default 1s).  interim: preceded by 1xx answers (`statuses`,
# default [100, 103]), each in its own TCP segment, `delay` apart (default 100ms).  oversized: the
# document padded to `size` bytes (default 64MiB), streamed, never built; `chunked` drops the
# Content-Length.  nested: an unknown field nested `depth` levels deep (default 10000) in every event.
# out_of_range: numbers and times beyond what the platform sends (`field`: incarnation, duration,
# not_before or all).
FAULT_KINDS = ("status", "slow", "hang", "drop", "malformed", "html", "drip", "interim", "oversized", "nested",
               "out_of_range")
SHAPING_KINDS = frozenset({"drip", "oversized", "nested", "out_of_range"})  # applied to the answer's bytes
FAULT_PATHS = ("scheduledevents", "instance", "token", "versions", "arm", "any")  # arm: its vm = resource name
FAULT_KEYS = frozenset({"kind", "count", "status", "retry_after", "delay", "vm", "path", "method",
                        "size", "chunked", "depth", "statuses", "field"})
OUT_OF_RANGE_FIELDS = ("incarnation", "duration", "not_before", "all")
MAX_FAULT_SIZE = 16 * 1024**3
MAX_DEPTH = 1_000_000
# Values the platform never sends: beyond 64 bits, and a NotBefore whose UTC conversion leaves year 1.
_HUGE_INCARNATION = 2**64 + 1
_HUGE_DURATION = 2**70
_BAD_NOT_BEFORE = "0001-01-01T00:00:00+01:00"
_PIECE = 64 * 1024


@dataclass
class Fault:
    """One injected fault, good for ``count`` matching responses."""

    kind: str
    count: int = 1
    status: int | None = None
    retry_after: str | None = None
    delay: float | None = None
    vm: str | None = None
    path: str = "scheduledevents"
    method: str | None = None
    size: int | None = None
    chunked: bool = False
    depth: int | None = None
    statuses: list[int] = field(default_factory=list)
    field: str | None = None

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> Fault:
        """Validate a fault spec (Python kwargs, scenario step or control API JSON)."""
        unknown = set(spec) - FAULT_KEYS
        if unknown:
            raise SpecError(f"unknown fault keys {sorted(unknown)} (allowed: {', '.join(sorted(FAULT_KEYS))})")
        kind = spec.get("kind")
        if kind not in FAULT_KINDS:
            raise SpecError(f"fault kind must be one of {', '.join(FAULT_KINDS)}, got {kind!r}")
        count = spec.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise SpecError(f"fault count must be a positive integer, got {count!r}")
        status = spec.get("status")
        if kind == "status":
            if status is None:
                status = 500
        elif kind == "html" and status is None:
            status = 200
        if status is not None and (isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599):
            raise SpecError(f"fault status must be an HTTP status code, got {status!r}")
        retry_after = spec.get("retry_after")
        if retry_after is not None:
            retry_after = str(retry_after)
        elif kind == "status" and status == 429:
            retry_after = "1"
        delay = spec.get("delay")
        if delay is not None:
            try:
                delay = parse_duration(delay)
            except ValueError as exc:
                raise SpecError(f"fault delay: {exc}") from None
        elif kind == "slow":
            raise SpecError("a slow fault needs a delay")
        path = spec.get("path", "scheduledevents")
        if path not in FAULT_PATHS:
            raise SpecError(f"fault path must be one of {', '.join(FAULT_PATHS)}, got {path!r}")
        method = spec.get("method")
        if method is not None:
            method = str(method).upper()
        vm = spec.get("vm")
        size, depth = spec.get("size"), spec.get("depth")
        if kind == "oversized":
            if isinstance(size, str):  # "64MiB" in a scenario file or the control API, as in the config
                try:
                    size = parse_size(size)
                except ValueError as exc:
                    raise SpecError(f"fault size: {exc}") from None
            size = _positive_int("size", 64 * 1024 * 1024 if size is None else size, MAX_FAULT_SIZE)
        if kind == "nested":
            depth = _positive_int("depth", 10_000 if depth is None else depth, MAX_DEPTH)
        if kind == "drip" and delay is None:
            delay = 1.0
        if kind == "interim" and delay is None:
            delay = 0.1
        statuses = spec.get("statuses", [100, 103] if kind == "interim" else [])
        if not isinstance(statuses, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) and 100 <= c <= 199 and c != 101 for c in statuses):
            raise SpecError(f"fault statuses must be a list of 1xx codes other than 101, got {statuses!r}")
        chunked = spec.get("chunked", False)
        if not isinstance(chunked, bool):
            raise SpecError(f"fault chunked must be true or false, got {chunked!r}")
        which = spec.get("field", "all" if kind == "out_of_range" else None)
        if which is not None and which not in OUT_OF_RANGE_FIELDS:
            raise SpecError(f"fault field must be one of {', '.join(OUT_OF_RANGE_FIELDS)}, got {which!r}")
        return cls(kind=kind, count=count, status=status, retry_after=retry_after, delay=delay,
                   vm=str(vm) if vm is not None else None, path=path, method=method, size=size,
                   chunked=chunked, depth=depth, statuses=list(statuses), field=which)

    def matches(self, vm: str, path: str, method: str) -> bool:
        return ((self.vm is None or self.vm == vm)
                and (self.path == "any" or self.path == path)
                and (self.method is None or self.method == method))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- hostile answers: what the server sends instead of (or before) the normal one ----------------
    def interim_heads(self) -> list[bytes]:
        """The 1xx answers of an ``interim`` fault, each to be written on its own."""
        return [f"HTTP/1.1 {code} {_PHRASES.get(code, 'Informational')}\r\n\r\n".encode() for code in self.statuses]

    def reshape(self, body: bytes) -> bytes:
        """The normal JSON answer made ``nested`` or ``out_of_range`` (valid JSON either way)."""
        doc = orjson.loads(body)
        if not isinstance(doc, dict):
            return body
        if self.kind == "nested":
            return _nested(doc, self.depth or 1)
        return _out_of_range(doc, self.field or "all")

    def oversized(self, body: bytes) -> tuple[int, Iterator[bytes]]:
        """(length, pieces) of the normal JSON object padded to ``size`` bytes, produced piece by piece."""
        size = self.size or 0
        head = body.rstrip()
        if not head.endswith(b"}") or len(head) < 2:
            head = b"{}"
        opening = head[:-1] + (b',' if len(head) > 2 else b"") + b'"Padding":"'
        padding = max(0, size - len(opening) - 2)

        def pieces() -> Iterator[bytes]:
            yield opening
            left = padding
            block = b"x" * _PIECE
            while left > 0:
                yield block[:min(left, _PIECE)]
                left -= _PIECE
            yield b'"}'

        return len(opening) + padding + 2, pieces()


_PHRASES = {100: "Continue", 102: "Processing", 103: "Early Hints"}


def _positive_int(name: str, value: Any, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise SpecError(f"fault {name} must be an integer from 1 to {maximum}, got {value!r}")
    return value


def _splice(doc: dict[str, Any], events: list[bytes]) -> bytes:
    """``doc`` as JSON with its Events list replaced by already-serialized event texts."""
    head = {k: v for k, v in doc.items() if k != "Events"}
    text = orjson.dumps(head)
    return text[:-1] + (b"," if len(text) > 2 else b"") + b'"Events":[' + b",".join(events) + b"]}"


def _nested(doc: dict[str, Any], depth: int) -> bytes:
    # Built as text: no JSON library would write (or should read) this deep.
    deep = b'{"Nested":' * depth + b"null" + b"}" * depth
    events = doc.get("Events")
    if not isinstance(events, list) or not events:
        text = orjson.dumps(doc)
        return text[:-1] + (b"," if len(text) > 2 else b"") + b'"Nested":' + deep + b"}"
    out = []
    for event in events:
        text = orjson.dumps(event)
        out.append(text[:-1] + (b"," if len(text) > 2 else b"") + b'"Nested":' + deep + b"}")
    return _splice(doc, out)


def _out_of_range(doc: dict[str, Any], which: str) -> bytes:
    marks: dict[bytes, bytes] = {}
    if which in ("incarnation", "all") and "DocumentIncarnation" in doc:
        doc["DocumentIncarnation"] = "__sefwd_incarnation__"
        marks[b'"__sefwd_incarnation__"'] = str(_HUGE_INCARNATION).encode()
    for event in doc.get("Events") or []:
        if not isinstance(event, dict):
            continue
        if which in ("duration", "all"):
            event["DurationInSeconds"] = "__sefwd_duration__"
            marks[b'"__sefwd_duration__"'] = str(_HUGE_DURATION).encode()
        if which in ("not_before", "all"):
            event["NotBefore"] = _BAD_NOT_BEFORE
    text = orjson.dumps(doc)
    for mark, value in marks.items():
        text = text.replace(mark, value)
    return text


class FaultQueue:
    """FIFO of pending faults; each matching request takes one response from the first match."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []

    def add(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def take(self, vm: str, path: str, method: str) -> Fault | None:
        with self._lock:
            for i, fault in enumerate(self._faults):
                if fault.matches(vm, path, method):
                    fault.count -= 1
                    if fault.count <= 0:
                        del self._faults[i]
                    return fault
        return None

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def pending(self) -> list[dict[str, Any]]:
        with self._lock:
            return [f.to_dict() for f in self._faults]
