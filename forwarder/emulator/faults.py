"""Injected faults: queued bursts of bad responses that matching requests consume in order."""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

from forwarder.emulator.model import SpecError
from forwarder.units import parse_duration

# status: an error status (500, 410, 429, 503 ...) with optional Retry-After.
# slow: answer normally after `delay` seconds.  hang: hold the request for `delay` seconds (or until
# the emulator stops), then close the connection without an answer.  drop: close at once, no answer.
# malformed: 200 with truncated JSON.  html: an HTML error page (status default 200, like a proxy
# or captive portal answering in IMDS's place).
FAULT_KINDS = ("status", "slow", "hang", "drop", "malformed", "html")
FAULT_PATHS = ("scheduledevents", "instance", "token", "versions", "any")
FAULT_KEYS = frozenset({"kind", "count", "status", "retry_after", "delay", "vm", "path", "method"})


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
        return cls(kind=kind, count=count, status=status, retry_after=retry_after, delay=delay,
                   vm=str(vm) if vm is not None else None, path=path, method=method)

    def matches(self, vm: str, path: str, method: str) -> bool:
        return ((self.vm is None or self.vm == vm)
                and (self.path == "any" or self.path == path)
                and (self.method is None or self.method == method))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
