"""What the poller hands records to. ``append`` returns only when the records are durable."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from forwarder.sinkapi import Record


class Outbox(Protocol):
    """Takes records; when ``append`` returns they are safe. Raises ForwarderError if not."""

    def append(self, records: Sequence[Record]) -> None: ...

    def position(self) -> int:
        """Where the next appended record will go (the journal's next index)."""
        ...

    def close(self, drain_timeout: float) -> None: ...
