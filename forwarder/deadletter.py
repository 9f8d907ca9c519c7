"""Per-sink dead letters: records a sink rejected for good, kept with the reason, replayable."""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from forwarder.records import rfc3339, utcnow
from forwarder.sinkapi import Record


@dataclass(frozen=True, slots=True)
class DeadLetter:
    time: str
    reason: str
    detail: str
    record: Record


class DeadLetters:
    """``<state>/deadletter/<sink>.jsonl``: one line per record, written with fsync."""

    def __init__(self, directory: Path, sink: str) -> None:
        self.dir = Path(directory)
        self.sink = sink
        self.path = self.dir / f"{sink}.jsonl"
        self._lock = threading.Lock()

    def add(self, records: list[Record], reason: str, detail: str = "") -> None:
        if not records:
            return
        now = rfc3339(utcnow())
        lines = b"".join(
            b'{"time":' + orjson.dumps(now) + b',"reason":' + orjson.dumps(reason)
            + b',"detail":' + orjson.dumps(detail[:2000]) + b',"record":' + r.body + b"}\n"
            for r in records
        )
        with self._lock:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
            try:
                os.write(fd, lines)
                os.fsync(fd)
            finally:
                os.close(fd)

    def __iter__(self) -> Iterator[DeadLetter]:
        try:
            fh = open(self.path, "rb")
        except FileNotFoundError:
            return
        with fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    obj: dict[str, Any] = orjson.loads(line)
                    record = Record.from_dict(obj["record"])
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line after a crash
                yield DeadLetter(obj.get("time", ""), obj.get("reason", ""), obj.get("detail", ""), record)

    def count(self) -> int:
        return sum(1 for _ in self)

    def take(self) -> Path | None:
        """Move the file aside for a replay; returns its new path (None when there is nothing)."""
        if not self.path.exists():
            return None
        taken = self.path.with_name(f"{self.sink}.replaying-{os.getpid()}.jsonl")
        os.replace(self.path, taken)
        return taken


def read_file(path: Path) -> list[DeadLetter]:
    holder = DeadLetters(path.parent, "")
    holder.path = path
    return list(holder)


def sinks_with_dead_letters(directory: Path) -> dict[str, int]:
    """Dead-letter counts of every sink that has any."""
    out: dict[str, int] = {}
    if not directory.is_dir():
        return out
    for path in sorted(directory.glob("*.jsonl")):
        if ".replaying-" in path.name:
            continue
        out[path.stem] = DeadLetters(directory, path.stem).count()
    return out
