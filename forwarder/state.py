"""The agent's small persistent state: last document, sequence counter, VM identity."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from forwarder.errors import StateError

log = logging.getLogger(__name__)
STATE_FILE = "state.json"
LOCK_FILE = "agent.lock"
FORMAT_VERSION = 1


@dataclass
class AgentState:
    """What must survive a restart. ``document`` is the last good document's raw body."""

    sequence: int = 0
    document: str | None = None
    api_version: str | None = None
    vm: dict[str, str] = field(default_factory=dict)
    saved_at: float | None = None
    # Write-ahead: records of the last commit and the journal index they start at.
    pending: list[str] = field(default_factory=list)
    pending_index: int | None = None
    # forwarder.evidence.evidence_to_dict(): boot id the document was seen at, accepted approvals.
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "format": FORMAT_VERSION,
                "sequence": self.sequence,
                "document": self.document,
                "api_version": self.api_version,
                "vm": self.vm,
                "saved_at": self.saved_at,
                "pending": self.pending,
                "pending_index": self.pending_index,
                "evidence": self.evidence,
            }
        )


def atomic_write(path: Path, data: bytes) -> None:
    """Write temp, fsync, rename, fsync the directory: the file is old or new, never torn."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StateStore:
    """Loads and atomically saves ``state.json`` in the state dir, and holds the agent lock."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.path = self.dir / STATE_FILE
        self._lock_fd: int | None = None

    def ensure_dir(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        except OSError as exc:
            raise StateError(f"cannot create state dir {self.dir}: {exc.strerror}") from None

    def lock(self) -> None:
        """One agent per state dir: two would double-deliver and fight over approvals."""
        self.ensure_dir()
        try:
            import fcntl
        except ImportError:  # Windows: the service manager already runs one instance
            return
        fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StateError(f"another sefwd agent is running with state dir {self.dir}") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def load(self) -> AgentState:
        """The saved state; a missing file is a fresh install, a damaged one is set aside."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return AgentState()
        except OSError as exc:
            raise StateError(f"cannot read {self.path}: {exc.strerror}") from None
        try:
            obj: Any = orjson.loads(raw)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
            state = AgentState(
                sequence=int(obj.get("sequence") or 0),
                document=obj.get("document"),
                api_version=obj.get("api_version"),
                vm=dict(obj.get("vm") or {}),
                saved_at=obj.get("saved_at"),
                pending=[str(b) for b in obj.get("pending") or []],
                pending_index=obj.get("pending_index"),
                evidence=obj["evidence"] if isinstance(obj.get("evidence"), dict) else {},
            )
            if state.document is not None and not isinstance(state.document, str):
                raise ValueError("document is not a string")
            return state
        except (ValueError, TypeError, orjson.JSONDecodeError) as exc:
            aside = self.path.with_name(f"{STATE_FILE}.damaged-{int(time.time())}")
            os.replace(self.path, aside)
            log.error(
                "state file %s is damaged (%s); moved it to %s and starting fresh: current events "
                "will be re-sent as Initial records", self.path, exc, aside,
            )
            return AgentState()

    def save(self, state: AgentState) -> None:
        state.saved_at = time.time()
        try:
            atomic_write(self.path, state.to_json())
        except OSError as exc:
            raise StateError(f"cannot write {self.path}: {exc.strerror}") from None
