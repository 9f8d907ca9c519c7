"""Run a local hook command for a change: the event in env vars, the record as JSON on stdin.

A hook inherits none of the agent's environment but ``PATH`` and the few names of
``HOOK_ENV_DEFAULT`` plus the operator's ``hook_env`` allow-list: the agent's secrets (the
callback secret, sink credentials) stay with the agent. Output (stdout and stderr together) is
kept up to a limit and redacted like every log line; a hook that runs too long, or is still
running when the agent stops, is terminated with its whole process group.

When: a ``HookDeadline`` holds the two moments (monotonic) — SIGTERM to the group at ``term_at``,
SIGKILL to whatever of the group is left at ``kill_at`` — and another thread may move both
earlier while the hook runs (``tighten``: Azure moved NotBefore closer).
"""
from __future__ import annotations

import logging
import os
import re
import selectors
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from forwarder.approval.settings import HOOK_ENV_DEFAULT
from forwarder.common.logs import MASK, redact

log = logging.getLogger(__name__)

KILL_GRACE = 5.0  # SIGTERM, then SIGKILL this much later (less when the hook's time is short)
GRACE_SHARE = 0.2  # with a hard deadline, SIGTERM comes at the latest this share of the time before SIGKILL
# After the hook exits, a background child may still hold the output pipe open; stop reading soon.
OUTPUT_GRACE = 0.5
_CHUNK = 65536
ENV_VALUE_LIMIT = 65536  # bytes of one SEFWD_* variable
_TICK = 0.05
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Standard Webhooks secrets (the callback's, the webhook sink's) never reach a record.
_WHSEC = re.compile(r"whsec_[A-Za-z0-9+/=_-]+")


@dataclass(frozen=True)
class HookResult:
    """How one hook run went; ``output`` is already cut to the configured limit."""

    command: str
    exit_code: int | None
    timed_out: bool
    output: str
    duration: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.error is None

    def to_audit(self) -> dict[str, Any]:
        """The ``Hook`` object of an approval.* record."""
        return {
            "Command": redact_output(self.command),  # a token in an argument stays out of the record too
            "ExitCode": self.exit_code,
            "TimedOut": self.timed_out,
            "Output": self.output,
            "DurationSeconds": round(self.duration, 3),
            "Error": self.error,
        }


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    # The environment cannot carry NUL bytes, nor one string over 128 KiB (exec fails with
    # E2BIG); the whole record is on stdin anyway.
    text = str(value).replace("\0", "")
    if len(text) > ENV_VALUE_LIMIT // 4:
        text = text.encode()[:ENV_VALUE_LIMIT].decode("utf-8", "ignore")
    return text


def hook_env(record: Mapping[str, Any]) -> dict[str, str]:
    """The ``SEFWD_*`` variables describing the record's event."""
    data = record.get("data")
    if not isinstance(data, Mapping):
        data = {}
    resources = data.get("Resources")
    affects = data.get("AffectsThisVm")
    return {
        "SEFWD_EVENT_ID": _text(data.get("EventId")),
        "SEFWD_EVENT_TYPE": _text(data.get("EventType")),
        "SEFWD_EVENT_STATUS": _text(data.get("EventStatus")),
        "SEFWD_EVENT_SOURCE": _text(data.get("EventSource")),
        "SEFWD_EVENT_RESOURCES": ",".join(_text(r) for r in resources) if isinstance(resources, list) else "",
        "SEFWD_EVENT_NOT_BEFORE": _text(data.get("NotBefore")),
        "SEFWD_EVENT_DURATION": _text(data.get("DurationInSeconds")),
        "SEFWD_EVENT_DESCRIPTION": _text(data.get("Description")),
        "SEFWD_CHANGE": _text(data.get("Change")),
        "SEFWD_AFFECTS_THIS_VM": _text(affects) if isinstance(affects, bool) else "",
        "SEFWD_RECORD_ID": _text(record.get("id")),
        "SEFWD_RECORD_TYPE": _text(record.get("type")),
    }


def redact_output(text: str) -> str:
    """Hook output as it may enter a record: redacted like a log line, and no whsec_ secret."""
    return _WHSEC.sub(MASK, redact(text))


def base_env(allow: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a hook inherits from the agent: the default names and ``allow``, when set; PATH always."""
    environ = os.environ if environ is None else environ
    env = {name: environ[name] for name in (*HOOK_ENV_DEFAULT, *allow) if name in environ}
    env.setdefault("PATH", DEFAULT_PATH)
    return env


def describe_command(command: Sequence[str] | str) -> str:
    """The command as an operator would type it."""
    return command if isinstance(command, str) else shlex.join(command)


class _Output:
    """The first ``limit`` bytes of a stream and a count of the rest (which is discarded)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.limit - len(self.kept)
        if room > 0:
            self.kept += chunk[:room]

    def text(self) -> str:
        text = redact_output(bytes(self.kept).decode("utf-8", "replace"))
        cut = self.total - len(self.kept)
        if cut > 0:
            text += f"\n[... {cut} more bytes cut, {self.total} in all]"
        return text


def grace_for(budget: float) -> float:
    """SIGTERM to SIGKILL when the hook has ``budget`` seconds in all: KILL_GRACE, or a fifth of the budget."""
    return max(0.0, min(KILL_GRACE, budget * GRACE_SHARE))


class HookDeadline:
    """When a running hook gets SIGTERM and when SIGKILL (``time.monotonic()`` seconds); thread-safe."""

    def __init__(self, term_at: float, kill_at: float) -> None:
        self._lock = threading.Lock()
        self._term_at = min(term_at, kill_at)
        self._kill_at = kill_at

    @classmethod
    def after(cls, timeout: float, now: float | None = None) -> HookDeadline:
        """SIGTERM ``timeout`` from now, SIGKILL KILL_GRACE after it (no hard deadline)."""
        start = time.monotonic() if now is None else now
        return cls(start + timeout, start + timeout + KILL_GRACE)

    @classmethod
    def by(cls, kill_at: float, timeout: float, now: float | None = None) -> HookDeadline:
        """Gone by ``kill_at`` whatever happens: SIGTERM after ``timeout`` or ``grace_for`` the time left
        before ``kill_at`` (whichever comes first), SIGKILL KILL_GRACE after SIGTERM or at ``kill_at``."""
        start = time.monotonic() if now is None else now
        term_at = min(start + timeout, kill_at - grace_for(kill_at - start))
        return cls(term_at, min(term_at + KILL_GRACE, kill_at))

    def times(self) -> tuple[float, float]:
        """(term_at, kill_at)."""
        with self._lock:
            return self._term_at, self._kill_at

    def tighten(self, kill_at: float, now: float | None = None) -> bool:
        """The hook must be gone by ``kill_at`` now (only ever earlier): SIGTERM moves with it, keeping
        ``grace_for`` the time left between the two. False when ``kill_at`` is not earlier."""
        start = time.monotonic() if now is None else now
        with self._lock:
            if kill_at >= self._kill_at:
                return False
            self._kill_at = kill_at
            self._term_at = min(self._term_at, kill_at - grace_for(kill_at - start))
            return True


def _signal_group(pgid: int, signum: int) -> bool:
    try:
        os.killpg(pgid, signum)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # macOS answers EPERM for a group of zombies
        return False


def _group_alive(pgid: int) -> bool:
    return _signal_group(pgid, 0)


def _terminate_group(proc: subprocess.Popen[bytes], kill_at: Callable[[], float]) -> None:
    """SIGTERM the hook's process group, SIGKILL it if anything is left at ``kill_at()`` (re-read each tick)."""
    pgid = proc.pid  # start_new_session: the hook leads its own group
    if not _signal_group(pgid, signal.SIGTERM):
        proc.poll()
        return
    while (left := kill_at() - time.monotonic()) > 0:
        try:
            proc.wait(timeout=min(_TICK, left))
        except subprocess.TimeoutExpired:
            continue
        # The leader is reaped; children of the group may still be running (one may ignore SIGTERM).
        if not _group_alive(pgid) or _only_zombies(pgid):
            return
        threading.Event().wait(max(0.0, min(_TICK, kill_at() - time.monotonic())))
    _signal_group(pgid, signal.SIGKILL)
    try:
        proc.wait(timeout=KILL_GRACE)
    except subprocess.TimeoutExpired:
        log.warning("hook process %d did not exit after SIGKILL", proc.pid)


def _only_zombies(pgid: int) -> bool:
    """Whether every process left in the group is a zombie (orphans wait for init to reap them)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return False
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return False
    return True


def run_hook(
    command: Sequence[str] | str,
    record: Mapping[str, Any],
    *,
    timeout: float | None = None,
    output_limit: int,
    stop: threading.Event | None = None,
    extra_env: Mapping[str, str] | None = None,
    env_allow: Sequence[str] = (),
    deadline: HookDeadline | None = None,
) -> HookResult:
    """Run ``command`` for ``record`` and report how it went; never raises.

    ``deadline`` says when SIGTERM and SIGKILL come (and may be tightened while the hook runs);
    without it, SIGTERM after ``timeout`` and SIGKILL KILL_GRACE later. A stop sends SIGTERM at once
    and SIGKILL KILL_GRACE later (never after the deadline's SIGKILL).
    The environment: ``base_env(env_allow)``, the ``SEFWD_*`` event variables, then ``extra_env``.
    """
    started = time.monotonic()
    shown = ""
    try:
        shown = describe_command(command)
        if deadline is None:
            if timeout is None:
                raise ValueError("run_hook needs a timeout or a deadline")
            deadline = HookDeadline.after(timeout, started)
        env = base_env(env_allow)
        env.update(hook_env(record))
        env.update(extra_env or {})
        return _run(command, shown, record, deadline, output_limit, stop or threading.Event(), env, started)
    except Exception as exc:  # a hook must never take the approver thread down
        log.exception("hook %s failed to run", shown)
        return HookResult(shown, None, False, "", time.monotonic() - started, f"{type(exc).__name__}: {exc}")


def _run(
    command: Sequence[str] | str,
    shown: str,
    record: Mapping[str, Any],
    limit: HookDeadline,
    output_limit: int,
    stop: threading.Event,
    env: dict[str, str],
    started: float,
) -> HookResult:
    argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
    if not argv or not argv[0]:
        return HookResult(shown, None, False, "", 0.0, "empty command")
    stdin_data = orjson.dumps(record, default=str, option=orjson.OPT_NON_STR_KEYS) + b"\n"
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=env, start_new_session=True, close_fds=True, bufsize=0,
        )
    except OSError as exc:
        reason = exc.strerror or str(exc)
        return HookResult(shown, None, False, "", time.monotonic() - started, f"cannot run {argv[0]!r}: {reason}")
    assert proc.stdin is not None and proc.stdout is not None
    output = _Output(output_limit)
    timed_out = False
    error: str | None = None
    sel = selectors.DefaultSelector()
    try:
        out_fd, in_fd = proc.stdout.fileno(), proc.stdin.fileno()
        os.set_blocking(out_fd, False)
        os.set_blocking(in_fd, False)
        sel.register(out_fd, selectors.EVENT_READ)
        sel.register(in_fd, selectors.EVENT_WRITE)
        stdin_open = True
        written = 0
        exited_at: float | None = None
        stopped_at: float | None = None
        while True:
            now = time.monotonic()
            deadline = limit.times()[0]  # (re-read: another thread may have moved it earlier)
            # Once the hook has exited it is never signalled: its process group id may be gone.
            if proc.poll() is not None:
                if out_fd not in sel.get_map():
                    break
                if exited_at is None:
                    exited_at = now
                elif now - exited_at >= OUTPUT_GRACE or stop.is_set():
                    log.warning("hook %s exited but something it started still holds its output open", shown)
                    break
            elif stop.is_set():
                error = "interrupted: the agent is stopping"
                stopped_at = now
                break
            elif now >= deadline:
                timed_out = True
                break
            for key, _ in sel.select(timeout=max(0.0, min(deadline - now, _TICK)) if exited_at is None else _TICK):
                if key.fd == out_fd:
                    try:
                        chunk = os.read(out_fd, _CHUNK)
                    except BlockingIOError:
                        continue
                    if chunk:
                        output.add(chunk)
                    else:
                        sel.unregister(out_fd)
                elif key.fd == in_fd:
                    try:
                        written += os.write(in_fd, stdin_data[written:])
                    except BlockingIOError:
                        continue
                    except (BrokenPipeError, ConnectionResetError):
                        written = len(stdin_data)  # the hook does not read stdin: fine
                    if written >= len(stdin_data):
                        sel.unregister(in_fd)
                        proc.stdin.close()
                        stdin_open = False
        if stdin_open:
            sel.unregister(in_fd)
            _close(proc.stdin)
        if timed_out or error is not None:
            log.warning("hook %s %s; terminating its process group", shown, "timed out" if timed_out else "interrupted")
            # (a stop leaves KILL_GRACE before SIGKILL, unless the deadline's SIGKILL comes first)
            last = float("inf") if stopped_at is None else stopped_at + KILL_GRACE
            _terminate_group(proc, lambda: min(last, limit.times()[1]))
            _drain(out_fd, output)
    finally:
        sel.close()
        _close(proc.stdout)
        if proc.poll() is None and not timed_out and error is None:
            # Only reached when something above raised: leave no hook behind.
            last = time.monotonic() + KILL_GRACE
            _terminate_group(proc, lambda: min(last, limit.times()[1]))
    return HookResult(shown, proc.returncode, timed_out, output.text(), time.monotonic() - started, error)


def _drain(fd: int, output: _Output) -> None:
    """Whatever is already buffered in the pipe, without waiting for more."""
    for _ in range(max(1, output.limit // _CHUNK + 2)):
        try:
            chunk = os.read(fd, _CHUNK)
        except (BlockingIOError, OSError):
            return
        if not chunk:
            return
        output.add(chunk)


def _close(stream: Any) -> None:
    try:
        stream.close()
    except OSError:
        pass
