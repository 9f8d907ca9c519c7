"""The persisted cache of ``webhook-id`` values already accepted by the approval callback."""
from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from forwarder.errors import StateError

log = logging.getLogger(__name__)

# Compact the file once it holds this many more lines than live entries: appends stay cheap and
# the file stays within a small multiple of what the window can hold.
_COMPACT_SLACK = 1000


def _digest(msg_id: str) -> str:
    """A fixed-length, separator-free stand-in for an id: ids are attacker-sized header values."""
    return hashlib.sha256(msg_id.encode("utf-8", "surrogateescape")).hexdigest()


class ReplayCache:
    """Message ids seen within ``window`` seconds; an append-only ``<ts> <sha256(id)>`` file keeps them across restarts."""

    def __init__(self, path: Path, window: float, clock: Callable[[], float] = time.time) -> None:
        self._path = Path(path)
        self._window = float(window)
        self._clock = clock
        self._lock = threading.Lock()
        # Insertion order is (nearly) time order, so pruning only looks at the front.
        self._entries: dict[str, float] = {}
        self._file_lines = 0
        self._file: IO[str] | None = None
        with self._lock:
            self._load()
            self._compact()

    # -- public API -----------------------------------------------------------------------------
    def seen(self, msg_id: str) -> bool:
        """Whether ``msg_id`` was added within the window."""
        with self._lock:
            self._prune(self._clock())
            return _digest(msg_id) in self._entries

    def add(self, msg_id: str) -> None:
        """Record ``msg_id`` durably (fsync) before returning."""
        self.add_if_new(msg_id)

    def add_if_new(self, msg_id: str) -> bool:
        """Record ``msg_id`` unless already seen; True when it was new (check and add are atomic)."""
        key = _digest(msg_id)
        with self._lock:
            now = self._clock()
            self._prune(now)
            if key in self._entries:
                return False
            self._append(now, key)
            self._entries[key] = now
            if self._file_lines > 2 * len(self._entries) + _COMPACT_SLACK:
                self._compact()
            return True

    def __len__(self) -> int:
        with self._lock:
            self._prune(self._clock())
            return len(self._entries)

    def close(self) -> None:
        """Close the file; the cache must not be used afterwards."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    # -- internals (called with the lock held) --------------------------------------------------
    def _prune(self, now: float) -> None:
        horizon = now - self._window
        expired = []
        for key, ts in self._entries.items():
            if ts >= horizon:
                break
            expired.append(key)
        for key in expired:
            del self._entries[key]

    def _load(self) -> None:
        try:
            text = self._path.read_text(encoding="ascii", errors="replace")
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StateError(f"cannot read replay cache {self._path}: {exc.strerror or exc}") from None
        horizon = self._clock() - self._window
        loaded: list[tuple[float, str]] = []
        for line in text.splitlines():
            # A torn last line (crash mid-append) or any damage just drops that entry.
            ts_text, _, key = line.partition(" ")
            try:
                ts = float(ts_text)
            except ValueError:
                continue
            if len(key) != 64 or any(c not in "0123456789abcdef" for c in key) or not math.isfinite(ts):
                continue
            if ts >= horizon:
                loaded.append((ts, key))
        loaded.sort()
        for ts, key in loaded:
            self._entries.setdefault(key, ts)

    def _append(self, now: float, key: str) -> None:
        try:
            if self._file is None:
                self._file = self._open_append()
            self._file.write(f"{now:.3f} {key}\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise StateError(f"cannot write replay cache {self._path}: {exc.strerror or exc}") from None
        self._file_lines += 1

    def _open_append(self) -> IO[str]:
        fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return os.fdopen(fd, "a", encoding="ascii")

    def _compact(self) -> None:
        """Rewrite the file with the live entries only (temp file, fsync, rename)."""
        self._prune(self._clock())
        tmp = self._path.with_name(self._path.name + ".tmp")
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            if self._file is not None:
                self._file.close()
                self._file = None
            with self._open_tmp(tmp) as f:
                f.writelines(f"{ts:.3f} {key}\n" for key, ts in self._entries.items())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)
            dir_fd = os.open(self._path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise StateError(f"cannot write replay cache {self._path}: {exc.strerror or exc}") from None
        self._file_lines = len(self._entries)

    def _open_tmp(self, tmp: Path) -> IO[str]:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        return os.fdopen(fd, "w", encoding="ascii")
