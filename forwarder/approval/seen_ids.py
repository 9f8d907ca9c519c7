"""``webhook-id`` values already accepted by the approval callback, kept in the store across restarts."""
from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from forwarder.errors import StateError
from forwarder.store.database import Store, connect


def _digest(msg_id: str) -> str:
    """A fixed-length stand-in for an id: ids are attacker-sized header values."""
    return hashlib.sha256(msg_id.encode("utf-8", "surrogateescape")).hexdigest()


class ReplayCache:
    """Message ids seen within ``window`` seconds, in the ``webhook_ids`` table of the database at ``path``."""

    def __init__(self, path: Path, window: float, clock: Callable[[], float] = time.time) -> None:
        self._window = float(window)
        self._clock = clock
        self._lock = threading.Lock()
        try:
            self._store: Store | None = Store(connect(Path(path)), Path(path), clock=clock)
        except sqlite3.Error as exc:
            raise StateError(f"cannot open replay cache {path}: {exc}") from None
        # Set when the ids remembered may have been lost (a salvaged or vanished database,
        # forwarder.store.recovery): nothing signed before it is accepted, or a request accepted
        # before the loss could be replayed within its tolerance.
        floor = self._store.meta().get("replay_floor")
        try:
            self.floor = float(floor) if floor is not None else None
        except (TypeError, ValueError):
            self.floor = float("inf")  # unreadable: refuse rather than reopen a window

    def signed_before_loss(self, signed_at: float) -> bool:
        """Whether a request signed at ``signed_at`` predates a loss of the remembered ids."""
        return self.floor is not None and signed_at < self.floor

    def seen(self, msg_id: str) -> bool:
        """Whether ``msg_id`` was added within the window."""
        return bool(self._db().query("SELECT 1 FROM webhook_ids WHERE digest = ? AND expires >= ?",
                                     (_digest(msg_id), self._clock())))

    def add(self, msg_id: str) -> None:
        """Record ``msg_id`` durably before returning."""
        self.add_if_new(msg_id)

    def add_if_new(self, msg_id: str) -> bool:
        """Record ``msg_id`` unless already seen; True when it was new (check and add are one transaction)."""
        return self._db().add_webhook_id(_digest(msg_id), self._clock() + self._window)

    def __len__(self) -> int:
        return int(self._db().query("SELECT count(*) FROM webhook_ids WHERE expires >= ?", (self._clock(),))[0][0])

    def _db(self) -> Store:
        if self._store is None:
            raise StateError("replay cache is closed")
        return self._store

    def close(self) -> None:
        """Close the connection; the cache must not be used afterwards."""
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
