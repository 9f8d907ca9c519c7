"""The ``file`` sink: JSON lines appended to a file, with size-based rotation.

Every line is one complete CloudEvents JSON object, which is what line-oriented collectors such
as the Azure Monitor Agent's custom text-log collection expect.

Crash safety: a batch is written with one ``write`` call, and a write that fails part-way is
truncated back. A crash (kill -9, power loss) in the middle of a write can still leave a torn
last line; when the sink opens a file whose last byte is not a newline it truncates back to just
after the last newline and logs how many bytes it dropped. Those records are not lost: the batch
was never acknowledged, so delivery (at-least-once) sends it again. Consumers de-duplicate on
``id``.

External rotation (logrotate ``create`` mode) is noticed by comparing the path's inode with the
open file's on every batch; the sink then reopens ``path``. ``copytruncate`` also works because
the file is opened with ``O_APPEND``.
"""
from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from forwarder.sinkapi import Ok, Record, Reject, Result, SinkContext
from forwarder.common.values import parse_size
from sinks import check_bool, retry_for_os_error, unknown_options

log = logging.getLogger(__name__)

DEFAULT_MAX_SIZE = "64MiB"
DEFAULT_BACKUPS = 5
MAX_BACKUPS = 1000
FILE_MODE = 0o640
_SCAN_CHUNK = 64 * 1024


class FileSink:
    """Appends records as JSON lines to ``path``, rotating to ``path.1`` … ``path.N`` by size."""

    OPTIONS: ClassVar[dict[str, str]] = {
        "path": "file to append JSON lines to (required; parent directories are created)",
        "max_size": f"rotate before the file would grow past this size (default {DEFAULT_MAX_SIZE})",
        "backups": f"rotated files kept as path.1 … path.N, the oldest deleted (default {DEFAULT_BACKUPS})",
        "fsync": "fsync after every batch, so an acknowledged batch survives power loss (default false)",
    }
    max_batch: int = 1000

    def __init__(self, options: Mapping[str, Any], context: SinkContext) -> None:
        problems = self.check(options)
        if problems:
            raise ValueError("; ".join(problems))
        self.name = context.name
        self.path = Path(os.path.expanduser(str(options["path"])))
        self.max_size = parse_size(options.get("max_size", DEFAULT_MAX_SIZE))
        self.backups = int(options.get("backups", DEFAULT_BACKUPS))
        self.fsync = bool(options.get("fsync", False))
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None
        self._regular = True
        # Open now so a bad path fails the start loudly and a torn line is repaired up front.
        self._open()

    @classmethod
    def check(cls, options: Mapping[str, Any]) -> list[str]:
        """Every problem with ``options`` (reads the filesystem, never changes it)."""
        problems = unknown_options(options, cls.OPTIONS)
        path = options.get("path")
        if path is None:
            problems.append("option 'path' is required")
        elif not isinstance(path, str) or not path.strip():
            problems.append(f"option 'path' must be a non-empty string, got {path!r}")
        elif os.path.isdir(os.path.expanduser(path)):
            problems.append(f"option 'path' names a directory: {path!r}")
        if "max_size" in options:
            try:
                if parse_size(options["max_size"]) <= 0:
                    problems.append("option 'max_size' must be greater than zero")
            except ValueError as exc:
                problems.append(f"option 'max_size': {exc}")
        if "backups" in options:
            backups = options["backups"]
            if isinstance(backups, bool) or not isinstance(backups, int) or not 0 <= backups <= MAX_BACKUPS:
                problems.append(f"option 'backups' must be an integer from 0 to {MAX_BACKUPS}, got {backups!r}")
        return problems + check_bool(options, "fsync")

    # -- sending ----------------------------------------------------------------------------
    def send(self, batch: Sequence[Record]) -> Result:
        """Append the batch with one write (rotating first if needed); never raises."""
        if not batch:
            return Ok()
        for record in batch:
            # A line break inside a body would split one record into two broken lines.
            if b"\n" in record.body or b"\r" in record.body:
                return Reject("record_contains_newline", detail=record.id)
            if not record.body:
                return Reject("empty_record", detail=record.id)
        data = b"".join(record.body + b"\n" for record in batch)
        with self._lock:
            try:
                self._append(data)
            except OSError as exc:
                result = retry_for_os_error(exc)
                log.warning("sink %r: writing %s failed: %s (%s)", self.name, self.path, exc, result.reason)
                return result
        return Ok()

    def _append(self, data: bytes) -> None:
        fd = self._current_fd()
        size = os.fstat(fd).st_size if self._regular else 0
        # Never split a batch: a batch larger than max_size gets a file of its own.
        if self._regular and size > 0 and size + len(data) > self.max_size:
            self._rotate()
            fd = self._current_fd()
            size = 0
        self._write_all(fd, data, size)
        if self.fsync and self._regular:
            os.fsync(fd)

    def _current_fd(self) -> int:
        """The open file, reopened if ``path`` was moved away or replaced since the last batch."""
        if self._fd is None:
            return self._open()
        try:
            st = os.stat(self.path)
            moved = (st.st_dev, st.st_ino) != self._ident
        except OSError:  # gone, or a path component is no longer a directory
            moved = True
        if moved:
            log.info("sink %r: %s was moved away or replaced; reopening", self.name, self.path)
            self._close_fd()
            return self._open()
        return self._fd

    def _write_all(self, fd: int, data: bytes, start: int) -> None:
        view = memoryview(data)
        written = 0
        try:
            while written < len(data):
                n = os.write(fd, view[written:])
                if n <= 0:
                    raise OSError(5, "write wrote nothing")  # EIO; never spin on a zero-length write
                written += n
        except OSError:
            if written and self._regular:
                # Take back the partial batch so the file never ends in a torn line we wrote.
                try:
                    os.ftruncate(fd, start)
                except OSError:
                    self._close_fd()  # the next open repairs the torn line instead
            raise

    # -- files ------------------------------------------------------------------------------
    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        created = True
        try:
            fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, FILE_MODE)
        except FileExistsError:
            created = False
            fd = os.open(self.path, flags)
        try:
            st = os.fstat(fd)
            self._regular = stat.S_ISREG(st.st_mode)
            if created:
                os.fchmod(fd, FILE_MODE)  # the umask may have narrowed it; readers need group read
                if self.fsync:
                    self._fsync_dir()
            elif self._regular and st.st_size > 0:
                self._repair(fd, st)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._ident = (st.st_dev, st.st_ino)
        return fd

    def _repair(self, fd: int, st: os.stat_result) -> None:
        """Truncate a torn last line (no trailing newline) left by a crash mid-write."""
        with open(self.path, "rb") as reader:
            if os.fstat(reader.fileno()).st_ino != st.st_ino:
                return
            size = st.st_size
            reader.seek(size - 1)
            if reader.read(1) == b"\n":
                return
            keep = 0
            end = size
            while end > 0:
                begin = max(0, end - _SCAN_CHUNK)
                reader.seek(begin)
                newline = reader.read(end - begin).rfind(b"\n")
                if newline >= 0:
                    keep = begin + newline + 1
                    break
                end = begin
        os.ftruncate(fd, keep)
        if self.fsync:
            os.fsync(fd)
        log.warning(
            "sink %r: %s ended in a torn line (a crash mid-write); dropped its last %d bytes, "
            "whose records will be delivered again",
            self.name, self.path, size - keep,
        )

    def _rotate(self) -> None:
        """path → path.1, path.1 → path.2, … ; the oldest backup is overwritten (deleted)."""
        self._close_fd()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            for i in range(self.backups - 1, 0, -1):
                older = self._backup(i)
                if os.path.lexists(older):
                    os.replace(older, self._backup(i + 1))
            try:
                os.replace(self.path, self._backup(1))
            except FileNotFoundError:
                pass  # moved away by someone else meanwhile: nothing left to rotate
        log.info("sink %r: rotated %s (keeping %d backups)", self.name, self.path, self.backups)
        self._open()
        if self.fsync:
            self._fsync_dir()

    def _backup(self, n: int) -> str:
        return f"{self.path}.{n}"

    def _fsync_dir(self) -> None:
        # The new name or rename is durable only once the directory itself is on disk.
        dir_fd = os.open(self.path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd, self._ident = self._fd, None, None
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Close the file (fsyncing it first when ``fsync`` is on)."""
        with self._lock:
            if self._fd is not None and self.fsync and self._regular:
                try:
                    os.fsync(self._fd)
                except OSError:
                    pass
            self._close_fd()
