"""Where the poller commits records: the store, behind the ``Outbox`` protocol.

``commit`` returns only when the records and the state they came from are durable; delivering them
is not the outbox's job (that is ``forwarder.delivery.dispatcher``, whose workers read the store).
"""
from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import Protocol

from forwarder.sinkapi import Record
from forwarder.store.database import SavedState, Store


class Outbox(Protocol):
    """Takes records with the state they came from, in one transaction. Raises ForwarderError if not."""

    def commit(self, records: Sequence[Record], state: SavedState | None = None, *, inbox_ids: Sequence[int] = (),
               then: Callable[[sqlite3.Connection], Sequence[Record]] | None = None) -> None: ...

    def inbox(self) -> list[tuple[int, object]]:
        """Audit entries other processes queued in the store (``sefwd approve``): (row id, entry)."""
        ...


class StoreOutbox:
    """The agent's outbox: commits go straight to the store, in one transaction each."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._inbox_pending = True  # entries queued while no agent ran

    def commit(self, records: Sequence[Record], state: SavedState | None = None, *, inbox_ids: Sequence[int] = (),
               then: Callable[[sqlite3.Connection], Sequence[Record]] | None = None) -> None:
        """The records and the state they came from are durable when this returns."""
        self.store.commit(records, state, inbox_ids=inbox_ids, then=then)

    def inbox(self) -> list[tuple[int, object]]:
        """Entries queued by other processes, looked at only when another connection wrote (or
        the last look found some: they stay until the commit that consumes them succeeds)."""
        written, self.store.inbox_written = self.store.inbox_written, False  # by this process's action workers
        if not (self.store.refresh() or self._inbox_pending or written):
            return []
        rows = self.store.inbox()
        self._inbox_pending = bool(rows)
        return rows
