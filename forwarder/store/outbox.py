"""What the poller hands records to. ``commit`` returns only when records and state are durable."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from forwarder.sinkapi import Record
from forwarder.store.database import SavedState


class Outbox(Protocol):
    """Takes records with the state they came from, in one transaction. Raises ForwarderError if not."""

    def commit(self, records: Sequence[Record], state: SavedState | None = None, *, inbox_ids: Sequence[int] = ()) -> None: ...

    def inbox(self) -> list[tuple[int, object]]:
        """Audit entries other processes queued in the store (``sefwd approve``): (row id, entry)."""
        ...

    def close(self, drain_timeout: float) -> None: ...
