"""What a sink is: the record it receives, the result it returns, and how sinks are found by name.

The core never imports the ``sinks`` package directly: built-in sinks are named by
"module:attribute" strings and third-party ones come from the entry-point group
``scheduled_events_forwarder.sinks``, so an Azure SDK is imported only when a sink that needs it
is configured.
"""
from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import orjson

from forwarder.common.logs import redact

ENTRY_POINT_GROUP = "scheduled_events_forwarder.sinks"

# Built-in sinks, imported lazily by name. This table is the ONE registry of built-ins: pyproject
# declares no entry points for them (tests/unit/test_sink_registry.py checks the table names every
# sink class in sinks/ and that no entry point duplicates it). Third-party sinks use the group.
BUILTIN_SINKS: dict[str, str] = {
    "stdout": "sinks.stdout:StdoutSink",
    "file": "sinks.file:FileSink",
    "webhook": "sinks.webhook:WebhookSink",
    "eventhubs": "sinks.eventhubs:EventHubsSink",
    "loganalytics": "sinks.loganalytics:LogAnalyticsSink",
    "appinsights": "sinks.appinsights:AppInsightsSink",
    "eventgrid": "sinks.eventgrid:EventGridSink",
    "notify": "sinks.notify:NotifySink",
}


@dataclass(frozen=True, slots=True)
class Record:
    """One CloudEvents record: its id and type, and its structured-mode JSON body."""

    id: str
    type: str
    body: bytes

    def to_dict(self) -> dict[str, Any]:
        """The record as a dict (parsed from ``body``)."""
        return orjson.loads(self.body)

    @classmethod
    def from_dict(cls, event: Mapping[str, Any]) -> Record:
        """Serialize a CloudEvent dict into a record."""
        return cls(id=str(event["id"]), type=str(event["type"]), body=orjson.dumps(event))

    @classmethod
    def from_body(cls, body: bytes) -> Record:
        """Rebuild a record from its JSON body (as stored in the journal)."""
        event = orjson.loads(body)
        return cls(id=str(event["id"]), type=str(event["type"]), body=body)


@dataclass(frozen=True, slots=True)
class Ok:
    """Every record of the batch was accepted."""


@dataclass(frozen=True, slots=True)
class Retry:
    """Transient failure: send the same batch again, after ``delay`` seconds if the peer said so."""

    reason: str = "retry"
    delay: float | None = None


@dataclass(frozen=True, slots=True)
class Reject:
    """Permanent failure: the batch goes to the sink's dead letters with this snake_case reason."""

    reason: str
    detail: str = ""

    def __post_init__(self) -> None:
        # The detail is stored and shown: whatever sink wrote it, no URL secret gets that far.
        object.__setattr__(self, "detail", redact(self.detail))


Result = Ok | Retry | Reject


@dataclass(frozen=True)
class SinkContext:
    """What the agent gives every sink it builds."""

    name: str
    state_dir: Path
    # Set when delivery ends (after the agent's drain): a sink cuts its waits short then (pacing, a retry).
    # Not set while the agent drains: what is left must still go out.
    stop: threading.Event = field(default_factory=threading.Event)
    pretty: bool = False


@runtime_checkable
class Sink(Protocol):
    """A destination for records. ``send`` never raises: it maps its errors to a Result."""

    max_batch: int

    def send(self, batch: Sequence[Record]) -> Result: ...

    def close(self) -> None: ...


class SinkFactory(Protocol):
    """A sink class: checks its options, then is built from them."""

    OPTIONS: ClassVar[Mapping[str, str]]  # option name -> one-line description

    @classmethod
    def check(cls, options: Mapping[str, Any]) -> list[str]: ...

    def __call__(self, options: Mapping[str, Any], context: SinkContext) -> Sink: ...


def _import(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def available_sinks() -> dict[str, str]:
    """Every sink type by name: built-ins, then entry points (which may not shadow built-ins)."""
    found = dict(BUILTIN_SINKS)
    from importlib.metadata import entry_points  # here: importing it costs every CLI command a few ms

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def load_sink_factory(type_name: str) -> Any:
    """Import the class for a sink type; raises LookupError or ImportError with a clear message."""
    if type_name in BUILTIN_SINKS:  # no need to read every installed package's entry points (~15 ms)
        return _import(BUILTIN_SINKS[type_name])
    targets = available_sinks()
    if type_name not in targets:
        raise LookupError(
            f"unknown sink type {type_name!r} (known: {', '.join(sorted(targets))})"
        )
    return _import(targets[type_name])
