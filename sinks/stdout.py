"""The ``stdout`` sink: one JSON record per line, or one human line per record with ``pretty``."""
from __future__ import annotations

import errno
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO, ClassVar

from forwarder.common.terminal import as_text, colourize, render_pretty, use_colour
from forwarder.sinkapi import Ok, Record, Reject, Result, SinkContext
from sinks import check_bool, retry_for_os_error, unknown_options

log = logging.getLogger(__name__)


class StdoutSink:
    """Writes records to standard output, flushing after every batch."""

    OPTIONS: ClassVar[dict[str, str]] = {
        "pretty": "one human-readable line per record instead of JSON (also set by --pretty)",
    }
    max_batch: int = 500

    def __init__(
        self, options: Mapping[str, Any], context: SinkContext, *, stream: BinaryIO | None = None
    ) -> None:
        problems = self.check(options)
        if problems:
            raise ValueError("; ".join(problems))
        self.name = context.name
        self.pretty = bool(options.get("pretty", False)) or context.pretty
        self._stream = stream  # None: sys.stdout, looked up at send time (tests and the CLI swap it)
        self._reader_gone = False
        self._lock = threading.Lock()

    @classmethod
    def check(cls, options: Mapping[str, Any]) -> list[str]:
        """Every problem with ``options``."""
        return unknown_options(options, cls.OPTIONS) + check_bool(options, "pretty")

    def _encode(self, batch: Sequence[Record]) -> bytes | Reject:
        if not self.pretty:
            for record in batch:
                if b"\n" in record.body or b"\r" in record.body:
                    return Reject("record_contains_newline", detail=record.id)
            return b"".join(record.body + b"\n" for record in batch)
        lines = []
        colour = use_colour(self._stream if self._stream is not None else sys.stdout)
        for record in batch:
            try:
                event = record.to_dict()
                line = render_pretty(event)
                lines.append(colourize(line, as_text(event.get("type")) if isinstance(event, dict) else "") if colour else line)
            except ValueError as exc:  # orjson.JSONDecodeError: the body is not JSON
                return Reject("invalid_json", detail=f"{record.id}: {exc}")
        return ("\n".join(lines) + "\n").encode("utf-8", "replace")

    def send(self, batch: Sequence[Record]) -> Result:
        """Write the batch as one write and flush; never raises."""
        if not batch:
            return Ok()
        payload = self._encode(batch)
        if isinstance(payload, Reject):
            return payload
        with self._lock:
            # A closed stdout never comes back (the reader, e.g. `| head`, has exited), so retrying
            # would stall this sink forever; Reject sends the records to dead letters instead,
            # where they stay recoverable, and every later batch follows them.
            if self._reader_gone:
                return Reject("stdout_closed")
            stream = self._stream if self._stream is not None else _real_stdout()
            if stream is None:
                return Reject("stdout_closed", detail="no standard output")
            try:
                stream.write(payload)
                stream.flush()
            except (BrokenPipeError, ValueError) as exc:  # ValueError: write to a closed file object
                self._reader_gone = True
                log.warning("sink %r: standard output is closed (%s); records go to dead letters", self.name, exc)
                if self._stream is None:
                    _detach_stdout()
                return Reject("stdout_closed", detail=str(exc))
            except OSError as exc:
                if exc.errno == errno.EBADF:
                    self._reader_gone = True
                    return Reject("stdout_closed", detail=str(exc))
                result = retry_for_os_error(exc)
                log.warning("sink %r: writing to standard output failed: %s (%s)", self.name, exc, result.reason)
                return result
        return Ok()

    def close(self) -> None:
        """Flush what is buffered; the stream itself belongs to the process."""
        with self._lock:
            if self._reader_gone:
                return
            stream = self._stream if self._stream is not None else _real_stdout()
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass


def _real_stdout() -> BinaryIO | None:
    out = sys.stdout
    if out is None:
        return None
    return getattr(out, "buffer", None) or _TextAdapter(out)  # type: ignore[return-value]


class _TextAdapter:
    """Bytes onto a text-only sys.stdout (some embedders and test harnesses install one)."""

    def __init__(self, text_stream: Any) -> None:
        self._text = text_stream

    def write(self, data: bytes) -> int:
        return self._text.write(data.decode("utf-8", "replace"))

    def flush(self) -> None:
        self._text.flush()


def _detach_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's exit-time flush does not fail noisily again."""
    try:
        fd = sys.stdout.buffer.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass
