"""The store's marker beside ``state.db``: which store lived in this state dir and the highest
sequence number it handed out, so that a vanished database is announced, never silent.

It lives in the lock file (``agent.lock``, one small JSON object: ``pid``, ``store``,
``sequence``), rewritten after every commit of the agent's store that moved the sequence,
without an fsync: one write of about 80 bytes. Removing ``state.db`` *and* ``agent.lock`` is a deliberate start-over.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import orjson

log = logging.getLogger(__name__)

LOCK_FILE = "agent.lock"
MAX_MARKER = 4096


@dataclass(frozen=True)
class MarkerData:
    """What the marker says: the store id and the last sequence number known to exist."""

    store: str
    sequence: int


def parse_marker(raw: bytes) -> MarkerData | None:
    """The marker in the lock file's bytes; None for anything else (an old lock file holds a pid)."""
    try:
        data = orjson.loads(raw[:MAX_MARKER])
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    store, sequence = data.get("store"), data.get("sequence")
    if not isinstance(store, str) or not store or not isinstance(sequence, int) or isinstance(sequence, bool):
        return None
    return MarkerData(store, sequence)


def read_marker(state_dir: Path) -> MarkerData | None:
    try:
        with open(state_dir / LOCK_FILE, "rb") as fh:
            return parse_marker(fh.read(MAX_MARKER))
    except OSError:
        return None


def marker_bytes(marker: MarkerData | None) -> bytes:
    body: dict[str, object] = {"pid": os.getpid()}
    if marker is not None:
        body.update(store=marker.store, sequence=marker.sequence)
    return orjson.dumps(body)


def rewrite(fd: int, payload: bytes) -> None:
    """Replace the file's content (the lock is held on another descriptor: writing is not locking)."""
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, payload)
    os.ftruncate(fd, len(payload))


class Marker:
    """Keeps the marker of one store current; failures are logged once and never stop a commit."""

    def __init__(self, state_dir: Path, store_id: str) -> None:
        self.store_id = store_id
        self._fd: int | None = None
        self._failed = False
        self._written: int | None = None  # the sequence the file holds (None: unknown, write)
        try:
            self._fd = os.open(state_dir / LOCK_FILE, os.O_WRONLY | os.O_CREAT, 0o640)
        except OSError as exc:
            log.error("cannot keep the store marker in %s: %s", state_dir / LOCK_FILE, exc)

    def write(self, sequence: int) -> None:
        if self._fd is None or sequence == self._written:
            return  # the file already says so: no write for a commit that handed out no number
        try:
            rewrite(self._fd, marker_bytes(MarkerData(self.store_id, sequence)))
            self._failed = False
            self._written = sequence
        except OSError as exc:
            if not self._failed:
                log.error("cannot update the store marker: %s", exc)
            self._failed = True
            self._written = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
