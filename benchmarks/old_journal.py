"""REFERENCE ONLY, for the storage benchmark: the segmented journal the SQLite store replaced
(forwarder/journal.py before issue 12), kept here until its figures are recorded.

Crash-safe, append-only, segmented record log with one cursor per sink.

Segment files ``seg-<first index>.log`` start with a magic string and hold frames::

    u32 length | u32 crc32(index, time, payload) | u64 index | u64 append time (ms) | payload

Every frame carries its own index, so a reader can resynchronize after damage and count exactly
what it skipped. ``append`` writes a whole batch with one write and one fsync (group commit).
The newest segment is never deleted, so the next index survives even a fully drained journal.
"""
from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from forwarder.errors import ForwarderError

log = logging.getLogger(__name__)

MAGIC = b"SEFWDJ01"
HEADER = struct.Struct("<IIQQ")
_TAIL = struct.Struct("<QQ")  # the part of the header the CRC covers
MAX_FRAME = 64 * 1024 * 1024
SEGMENT_PREFIX = "seg-"
SEGMENT_SUFFIX = ".log"


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class JournalError(ForwarderError):
    """The journal could not take records (disk full, file too large, I/O error)."""


@dataclass(frozen=True, slots=True)
class Entry:
    index: int
    appended_ms: int
    body: bytes


@dataclass
class JournalStats:
    """Losses and repairs, counted by reason (never silently)."""

    corrupt_skipped: dict[str, int] = field(default_factory=dict)  # by sink
    torn_bytes_truncated: int = 0
    damaged_segments: int = 0
    cursor_resets: dict[str, int] = field(default_factory=dict)
    dropped_full: dict[str, int] = field(default_factory=dict)
    append_failures: int = 0


def _segment_name(base: int) -> str:
    return f"{SEGMENT_PREFIX}{base:020d}{SEGMENT_SUFFIX}"


def _crc(index: int, appended_ms: int, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(_TAIL.pack(index, appended_ms))) & 0xFFFFFFFF


def encode_frame(index: int, appended_ms: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), _crc(index, appended_ms, payload), index, appended_ms) + payload


def decode_at(buf: bytes | bytearray, pos: int) -> tuple[Entry, int] | None:
    """The valid frame at ``pos`` and the position after it, or None (torn, damaged or short)."""
    end = pos + HEADER.size
    if end > len(buf):
        return None
    length, crc, index, appended_ms = HEADER.unpack_from(buf, pos)
    if length > MAX_FRAME or end + length > len(buf):
        return None
    payload = bytes(buf[end : end + length])
    if _crc(index, appended_ms, payload) != crc:
        return None
    return Entry(index, appended_ms, payload), end + length


def resync(buf: bytes | bytearray, pos: int, min_index: int) -> int | None:
    """Next position at or after ``pos`` where a valid frame with index ≥ min_index starts."""
    for p in range(pos, len(buf) - HEADER.size + 1):
        found = decode_at(buf, p)
        if found is not None and found[0].index >= min_index:
            return p
    return None


class Journal:
    """The shared log. Writers: the poller (and approvals). Readers: one per sink."""

    def __init__(
        self,
        directory: Path,
        *,
        segment_size: int = 8 * 1024 * 1024,
        max_size: int = 256 * 1024 * 1024,
        fsync: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dir = Path(directory)
        self.cursor_dir = self.dir / "cursors"
        self.segment_size = segment_size
        self.max_size = max_size
        self.fsync = fsync
        self._clock = clock
        self.stats = JournalStats()
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)
        self._readers: dict[str, Reader] = {}
        self._fd: int | None = None
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cursor_dir.mkdir(exist_ok=True)
        self._segments: list[int] = []  # base indexes, ascending
        self._sizes: dict[int, int] = {}
        self.next_index = 0
        self._recover()

    # -- recovery -------------------------------------------------------------------------
    def _recover(self) -> None:
        bases = []
        for path in self.dir.glob(f"{SEGMENT_PREFIX}*{SEGMENT_SUFFIX}"):
            try:
                bases.append(int(path.name[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)]))
            except ValueError:
                continue
        for base in sorted(bases):
            path = self.segment_path(base)
            with open(path, "rb") as fh:
                head = fh.read(len(MAGIC))
            if head != MAGIC:
                if path.stat().st_size > len(MAGIC) or head:
                    self.stats.damaged_segments += 1
                    aside = path.with_name(path.name + ".damaged")
                    os.replace(path, aside)
                    log.error("journal segment %s has no valid header; moved to %s", path.name, aside.name)
                else:  # zero-length: a crash right after creating it
                    path.unlink()
                continue
            self._segments.append(base)
            self._sizes[base] = path.stat().st_size
        if not self._segments:
            self._open_segment(self._first_index_hint())
            return
        last = self._segments[-1]
        self.next_index = self._repair_tail(last)
        self._fd = os.open(self.segment_path(last), os.O_WRONLY | os.O_APPEND)

    def _first_index_hint(self) -> int:
        """With no segment left, continue after the furthest cursor so indexes never go back."""
        best = 0
        for path in self.cursor_dir.glob("*.cursor"):
            try:
                best = max(best, int(orjson.loads(path.read_bytes())["next"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return best

    def _repair_tail(self, base: int) -> int:
        """Scan the newest segment; truncate a torn tail. Returns the next index."""
        path = self.segment_path(base)
        buf = path.read_bytes()
        pos, next_index, last_good_end = len(MAGIC), base, len(MAGIC)
        while pos < len(buf):
            found = decode_at(buf, pos)
            if found is None:
                nxt = resync(buf, pos + 1, next_index)
                if nxt is None:
                    break
                pos = nxt  # damage in the middle: readers skip it and count it per sink
                continue
            entry, pos = found
            next_index = entry.index + 1
            last_good_end = pos
        if last_good_end < len(buf):
            torn = len(buf) - last_good_end
            self.stats.torn_bytes_truncated += torn
            log.warning("journal segment %s: truncating a torn tail of %d bytes", path.name, torn)
            with open(path, "r+b") as fh:
                fh.truncate(last_good_end)
                fh.flush()
                os.fsync(fh.fileno())
            self._sizes[base] = last_good_end
        return next_index

    # -- writing --------------------------------------------------------------------------
    def segment_path(self, base: int) -> Path:
        return self.dir / _segment_name(base)

    def _open_segment(self, base: int) -> None:
        path = self.segment_path(base)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        try:
            os.write(fd, MAGIC)
            if self.fsync:
                os.fsync(fd)
                fsync_dir(self.dir)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        self._segments.append(base)
        self._sizes[base] = len(MAGIC)
        self.next_index = base

    def append(self, bodies: Sequence[bytes]) -> int:
        """Append and fsync a batch (group commit); returns the first index. Raises JournalError."""
        if not bodies:
            return self.next_index
        with self._lock:
            first = self.next_index
            now_ms = int(self._clock() * 1000)
            data = b"".join(encode_frame(first + i, now_ms, b) for i, b in enumerate(bodies))
            base = self._segments[-1]
            size_before = self._sizes[base]
            assert self._fd is not None
            try:
                view = memoryview(data)
                while view:  # a short write means the next one reports why (ENOSPC, EFBIG)
                    view = view[os.write(self._fd, view) :]
                if self.fsync:
                    os.fsync(self._fd)
            except OSError as exc:
                self.stats.append_failures += 1
                self._undo(size_before)
                reason = {errno.ENOSPC: "disk full", errno.EFBIG: "file too large", errno.EDQUOT: "quota exceeded"}.get(exc.errno or 0, exc.strerror or str(exc))
                raise JournalError(f"cannot append to the journal in {self.dir}: {reason}") from None
            self._sizes[base] = size_before + len(data)
            self.next_index = first + len(bodies)
            if self._sizes[base] >= self.segment_size:
                try:
                    self._open_segment(self.next_index)
                except OSError as exc:  # the records are safe; rolling is retried on the next append
                    log.warning("could not start a new journal segment: %s", exc)
            self._enforce_cap()
            self.changed.notify_all()
            return first

    def _undo(self, size: int) -> None:
        """Cut a partly written batch off, so the segment never holds half a batch."""
        try:
            assert self._fd is not None
            os.ftruncate(self._fd, size)
        except OSError as exc:  # recovery at the next start truncates the torn tail instead
            log.error("could not truncate the journal after a failed append: %s", exc)

    def _enforce_cap(self) -> None:
        """Full-buffer policy: drop the oldest segment (never the newest), counting per sink."""
        while len(self._segments) > 1 and sum(self._sizes.values()) > self.max_size:
            base = self._segments[0]
            end = self._segments[1]
            for reader in self._readers.values():
                lost = end - max(reader.position, base)
                if lost > 0:
                    self.stats.dropped_full[reader.name] = self.stats.dropped_full.get(reader.name, 0) + lost
                    log.error("journal full (%d bytes): sink %s gives up %d undelivered record(s)", self.max_size, reader.name, lost)
            self._delete_segment(base)

    def _delete_segment(self, base: int) -> None:
        self._segments.remove(base)
        self._sizes.pop(base, None)
        try:
            self.segment_path(base).unlink()
        except FileNotFoundError:
            pass

    @property
    def oldest_index(self) -> int:
        return self._segments[0] if self._segments else self.next_index

    def size_bytes(self) -> int:
        return sum(self._sizes.values())

    def collect(self) -> None:
        """Delete segments every reader has passed (never the newest)."""
        with self._lock:
            if not self._readers:
                return
            low = min(r.committed for r in self._readers.values())
            while len(self._segments) > 1 and self._segments[1] <= low:
                self._delete_segment(self._segments[0])

    def reader(self, name: str) -> Reader:
        with self._lock:
            if name not in self._readers:
                self._readers[name] = Reader(self, name)
            return self._readers[name]

    def segments(self) -> list[int]:
        with self._lock:
            return list(self._segments)

    def wake(self) -> None:
        """Wake every reader waiting for records (shutdown: they re-check their stop flags)."""
        with self.changed:
            self.changed.notify_all()

    def close(self) -> None:
        for r in list(self._readers.values()):
            r.flush()
            r.close()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class Reader:
    """One sink's view of the journal: reads from its cursor, commits what the sink accepted."""

    def __init__(self, journal: Journal, name: str) -> None:
        self.journal = journal
        self.name = name
        self.cursor_path = journal.cursor_dir / f"{name}.cursor"
        self.committed = self._load_cursor()
        self.position = self.committed  # next index to read
        self._persisted = self.committed
        self._seg_base: int | None = None
        self._buf = bytearray()
        self._pos = 0

    def _reset(self, why: str) -> int:
        oldest = self.journal.oldest_index
        self.journal.stats.cursor_resets[self.name] = self.journal.stats.cursor_resets.get(self.name, 0) + 1
        log.warning("sink %s: %s; restarting it from the oldest retained record (%d): duplicates, not loss", self.name, why, oldest)
        return oldest

    def _load_cursor(self) -> int:
        try:
            raw = self.cursor_path.read_bytes()
        except FileNotFoundError:
            return self._reset("no cursor file") if self.journal.next_index > self.journal.oldest_index else self.journal.oldest_index
        except OSError as exc:
            return self._reset(f"cursor unreadable ({exc.strerror})")
        try:
            value = int(orjson.loads(raw)["next"])
        except (ValueError, KeyError, TypeError):
            return self._reset("cursor file damaged")
        if value > self.journal.next_index:
            return self._reset(f"cursor {value} is ahead of the journal end {self.journal.next_index}")
        if value < self.journal.oldest_index:
            return self.journal.oldest_index
        return value

    @property
    def backlog(self) -> int:
        return max(0, self.journal.next_index - self.committed)

    def _load_segment(self, base: int) -> bool:
        self._seg_base = base
        self._buf = bytearray()
        self._pos = len(MAGIC)
        return self._extend()

    def _extend(self) -> bool:
        """Read bytes appended to the current segment since we last looked."""
        assert self._seg_base is not None
        try:
            with open(self.journal.segment_path(self._seg_base), "rb") as fh:
                fh.seek(len(self._buf))
                more = fh.read()
        except FileNotFoundError:
            return False
        self._buf += more
        return bool(more)

    def _segment_for(self, index: int) -> int | None:
        segs = self.journal.segments()
        candidates = [b for b in segs if b <= index]
        return candidates[-1] if candidates else (segs[0] if segs else None)

    def _refill(self) -> bool:
        """More bytes: the current segment grew, or move on to the next segment."""
        if self._seg_base is None:
            base = self._segment_for(self.position)
            return base is not None and self._load_segment(base)
        if self._extend():
            return True
        later = [b for b in self.journal.segments() if b > self._seg_base]
        if not later:
            return False
        if later[0] > self.position:  # the rest of this segment was unreadable
            self._skipped(later[0] - self.position, later[0])
            self.position = later[0]
        return self._load_segment(later[0])

    def _skipped(self, count: int, before: int) -> None:
        skipped = self.journal.stats.corrupt_skipped
        skipped[self.name] = skipped.get(self.name, 0) + count
        log.error("sink %s: skipped %d damaged journal record(s) before index %d", self.name, count, before)

    def read(self, max_n: int) -> list[Entry]:
        """Up to ``max_n`` entries from the current position (never waits)."""
        j = self.journal
        out: list[Entry] = []
        if self.position < j.oldest_index:  # the full-buffer policy dropped what we had not read
            self.position = j.oldest_index
            self._seg_base = None
        while len(out) < max_n and self.position < j.next_index:
            found = decode_at(self._buf, self._pos) if self._seg_base is not None else None
            if found is None:
                if self._seg_base is not None and self._pos < len(self._buf) and not self._extend():
                    nxt = resync(self._buf, self._pos + 1, self.position)
                    self._pos = len(self._buf) if nxt is None else nxt
                    continue
                if not self._refill():
                    break
                continue
            entry, self._pos = found
            if entry.index < self.position:
                continue
            if entry.index > self.position:
                self._skipped(entry.index - self.position, entry.index)
            out.append(entry)
            self.position = entry.index + 1
        return out

    def wait(self, timeout: float) -> bool:
        """Wait until there is something past ``position`` (or timeout)."""
        with self.journal.changed:
            if self.position < self.journal.next_index:
                return True
            self.journal.changed.wait(timeout)
            return self.position < self.journal.next_index

    def commit(self, next_index: int) -> None:
        self.committed = max(self.committed, next_index)

    @property
    def dirty(self) -> bool:
        """Whether the cursor has moved since it was last persisted."""
        return self.committed != self._persisted

    def rewind(self) -> None:
        """Read again from the last committed index (after a failed send)."""
        self.position = self.committed
        self._seg_base = None

    def flush(self) -> None:
        """Persist the cursor (atomic); a crash before this only causes duplicates."""
        if self.committed == self._persisted:
            return
        atomic_write(self.cursor_path, orjson.dumps({"next": self.committed}))
        self._persisted = self.committed

    def close(self) -> None:
        self._buf = bytearray()
