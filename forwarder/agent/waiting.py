"""Say what we wait for, at once and then at a calm interval, until it arrives: never silent."""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import TracebackType

REPEAT = 30.0  # seconds between two reminders: often enough to show life, rare enough to read


def imds_trouble(imds: object) -> str | None:
    """What the IMDS client's latest request ran into, unless it is a timeout (the slow first call)."""
    from forwarder.errors import ImdsTimeout

    error = getattr(imds, "last_error", None)
    if error is None or isinstance(error, ImdsTimeout):
        return None
    return str(error)


def _leave_stop_signals_to_the_main_thread() -> None:
    """Block Ctrl-C and SIGTERM in this helper thread. The kernel may hand a process's signal to any
    thread that does not block it; taken here, it only wakes the main thread (which alone raises
    KeyboardInterrupt) when that thread's current wait ends, up to a whole retry backoff later."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


class WaitNotice:
    """Calls ``say(message)`` after ``first`` seconds, then every ``every`` seconds, until ``done()``
    is true, ``stop`` is set or the notice is closed (a ``with`` block ends).

    ``message`` may be a callable, so a reminder can say how long it has waited. ``cause`` (optional)
    names what went wrong so far (an IMDS endpoint refusing, say); a new cause is said within a tenth
    of a second, without waiting for ``first`` or the next reminder.
    """

    def __init__(self, say: Callable[[str], None], message: str | Callable[[], str], *,
                 done: Callable[[], bool] = lambda: False, first: float = 0.0, every: float = REPEAT,
                 stop: threading.Event | None = None, cause: Callable[[], str | None] | None = None) -> None:
        self._say = say
        self._cause = cause
        self._said_cause: str | None = None
        self._message = message
        self._done = done
        self._first = first
        self._every = every
        self._stop = stop
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wait-notice", daemon=True)

    def start(self) -> WaitNotice:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()

    def _over(self) -> bool:
        return self._closed.is_set() or (self._stop is not None and self._stop.is_set()) or self._done()

    def _run(self) -> None:
        _leave_stop_signals_to_the_main_thread()
        delay = self._first
        # Polled in short steps so a `done()` that turns true (or a stop) ends the notice promptly.
        while True:
            waited = 0.0
            while waited < delay:
                step = min(0.5 if self._cause is None else 0.1, delay - waited)
                if self._closed.wait(step):
                    return
                waited += step
                if self._over():
                    return
                if self._new_cause():
                    break
            if self._over():
                return
            self._new_cause()  # what this line says is said
            try:
                self._say(self._message() if callable(self._message) else self._message)
            except Exception:  # noqa: BLE001 - a notice must never break what it describes
                return
            delay = self._every

    def _new_cause(self) -> bool:
        """Whether ``cause`` names something not said yet."""
        try:
            cause = self._cause() if self._cause is not None else None
        except Exception:  # noqa: BLE001 - a notice must never break what it describes
            return False
        if cause is None or cause == self._said_cause:
            return False
        self._said_cause = cause
        return True

    def __enter__(self) -> WaitNotice:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
