"""Logging helpers: stderr setup, secret redaction of every line, and rate-limiting of repeated errors.

The redaction rule (docs/config-and-secrets.md): in every URL, user:password@ becomes ``***@`` and
every query value becomes ``***`` (except ``api-version``, never secret); a path with a query in a
request line (``"POST /hook?code=..."``) is treated the same; connection-string keys
(SharedAccessKey, SharedAccessSignature, AccountKey) lose their values.
"""
from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

_CHARS = r"[^\s'\"<>`]"
# scheme://[userinfo@]host[path][?query][#fragment]; userinfo runs to the last "@" before a space,
# so a password holding "/" or "?" is still hidden (an "@" in a query over-masks, harmlessly).
_URL = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]{0,15}://)(?P<userinfo>(?:[^\s'\"<>`@]*@)+)?"
    r"(?P<host>[^\s'\"<>`/?#]*)(?P<path>[^\s'\"<>`?#]*)(?P<query>\?[^\s'\"<>`#]*)?(?P<fragment>#[^\s'\"<>`]*)?"
)
# A request target without scheme and host, as urllib3 and requests log it ("POST /hook?code=x HTTP/1.1").
_PATH_QUERY = re.compile(rf"(?P<lead>^|[\s'\"(=:])(?P<path>/{_CHARS}*?)(?P<query>\?{_CHARS}*)")
_CONN_KEYS = re.compile(r"(?i)\b(SharedAccessKey|SharedAccessSignature|AccountKey)=[^;\s'\"]+")
_KEEP_PARAMS = frozenset({"api-version"})
MASK = "***"


def _query(text: str) -> str:
    if not text:
        return ""
    kept = []
    for pair in text[1:].split("&"):
        name, sep, _value = pair.partition("=")
        kept.append(pair if name.lower() in _KEEP_PARAMS else f"{name}{sep}{MASK}" if sep else MASK)
    return "?" + "&".join(kept)


def _url(m: re.Match[str]) -> str:
    userinfo = f"{MASK}@" if m.group("userinfo") else ""
    return f"{m.group('scheme')}{userinfo}{m.group('host')}{m.group('path')}{_query(m.group('query') or '')}"


def redact(text: str) -> str:
    """``text`` with URL userinfo, query values and connection-string keys masked: the one redaction rule."""
    text = _URL.sub(_url, text)
    text = _PATH_QUERY.sub(lambda m: f"{m.group('lead')}{m.group('path')}{_query(m.group('query'))}", text)
    return _CONN_KEYS.sub(lambda m: f"{m.group(1)}={MASK}", text)



class RedactingFormatter(logging.Formatter):
    """Formats as usual, then redacts the whole line: message, arguments, exception and stack texts.

    Third-party loggers (urllib3, azure-core) put URLs into their arguments, so redacting the
    formatted line is the only place that sees every one of them.
    """

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def setup_logging(level: str = "info") -> None:
    """All logs go to stderr (stdout carries records only), redacted by RedactingFormatter."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Uncaught exceptions print straight to stderr otherwise, past the redaction.
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    if level.lower() != "debug":
        # The Azure SDKs log every HTTP request at INFO: noise for an agent that sends all day.
        for name in ("azure", "urllib3"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _log_uncaught(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    logging.getLogger("forwarder").critical("uncaught exception", exc_info=(exc_type, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    exc = args.exc_value if args.exc_value is not None else args.exc_type()
    logging.getLogger("forwarder").error("uncaught exception in thread %s", name,
                                         exc_info=(args.exc_type, exc, args.exc_traceback))


class RateLimitedLog:
    """Logs an error once per ``interval`` per key, then says how often it repeated meanwhile."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._interval = interval
        self._clock = clock
        self._last: dict[str, tuple[float, int]] = {}

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self._interval:
            self._last[key] = (last[0], last[1] + 1)
            return
        suppressed = last[1] if last else 0
        if suppressed and last is not None:
            msg += " (and %d more like it in the %.0f s since the last report)"
            args = (*args, suppressed, now - last[0])
        self._last[key] = (now, 0)
        self._log.log(level, msg, *args)

    def clear(self, key: str) -> None:
        """The condition is over: the next occurrence is logged at once."""
        self._last.pop(key, None)

    def clear_all(self) -> None:
        """Every condition is over (e.g. a send succeeded)."""
        self._last.clear()


_ERRNO_TEXT = re.compile(r"\[Errno -?\d+\] ([^'\"()\]]+)")


def short_reason(exc: BaseException) -> str:
    """A few words for a network error ("connection refused", "name not resolved", "timed out"),
    instead of the ~300 characters urllib3 nests into one requests exception."""
    text = str(exc)
    if "NameResolution" in text or "Name or service not known" in text or "nodename nor servname" in text:
        return "host name not resolved"
    m = _ERRNO_TEXT.search(text)
    if m:
        return m.group(1).strip().rstrip(".").lower()
    if "timed out" in text.lower():
        return "timed out"
    if "RemoteDisconnected" in text or "Connection aborted" in text:
        return "connection closed by the receiver"
    return type(exc).__name__


class OnceLog:
    """Logs a warning once per key, and at most ``burst`` such lines per ``interval`` in all.

    For problems found in input that is read again and again (every poll of one IMDS document, the
    saved document at each start): the same bad value of the same event is said once, and a
    stream of ever-new bad values cannot flood the log (the next line says how many were held back).
    Memory is bounded: the ``keep`` most recent keys are remembered.
    """

    def __init__(self, logger: logging.Logger, *, keep: int = 1024, burst: int = 20, interval: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._keep = keep
        self._burst = burst
        self._interval = interval
        self._clock = clock
        self._seen: dict[object, None] = {}  # insertion-ordered: the oldest key is dropped first
        self._window: tuple[float, int] = (float("-inf"), 0)  # (start, lines logged in it)
        self._held = 0
        self._lock = threading.Lock()

    def warning(self, key: object, msg: str, *args: object) -> bool:
        """Log ``msg`` unless ``key`` was seen (or the burst is spent); True if it was logged."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen[key] = None
            if len(self._seen) > self._keep:
                del self._seen[next(iter(self._seen))]
            now = self._clock()
            start, count = self._window
            if now - start >= self._interval:
                start, count = now, 0
            if count >= self._burst:
                self._window = (start, count)
                self._held += 1
                return False
            self._window = (start, count + 1)
            held, self._held = self._held, 0
        if held:
            msg += " (%d similar warning(s) held back before this one)"
            args = (*args, held)
        self._log.warning(msg, *args)
        return True

    def clear(self) -> None:
        """Forget every key (tests; a key is otherwise said once per process)."""
        with self._lock:
            self._seen.clear()
            self._window = (float("-inf"), 0)
            self._held = 0
