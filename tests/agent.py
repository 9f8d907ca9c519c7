"""Run the real agent (``python -m forwarder run``) as a subprocess and read what it delivered."""
from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent


def write_config(path: Path, endpoint: str, state_dir: Path, *, sinks: str | None = None,
                 poll_interval: str = "500ms", extra: str = "") -> Path:
    out_file = state_dir.parent / "out.jsonl"
    sinks = sinks if sinks is not None else f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{out_file}"\n'
    path.write_text(
        f'[imds]\nendpoint = "{endpoint}"\npoll_interval = "{poll_interval}"\nfirst_call_timeout = "10s"\n'
        f'[state]\ndir = "{state_dir}"\n'
        f'[agent]\nheartbeat = "0"\nlog_level = "debug"\n'
        f"{extra}\n{sinks}"
    )
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete lines only (a line being written is not yet a record)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return [orjson.loads(line) for line in data.split(b"\n")[:-1] if line.strip()]


def _pause(interval: float, cost: float) -> None:
    """Sleep between two checks: ``interval``, or the check's own cost if that is longer, so a costly
    check (a CLI subprocess, a scrape) takes at most half a core while it waits, not a whole one."""
    time.sleep(max(interval, cost))


def poll_until(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.02) -> Any:
    """Poll until ``predicate`` is truthy or the deadline passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        started = time.monotonic()
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        _pause(interval, time.monotonic() - started)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll until ``predicate`` returns something truthy, or fail with ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        started = time.monotonic()
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        _pause(interval, time.monotonic() - started)


_STARTED: list[subprocess.Popen[bytes]] = []


@atexit.register
def _kill_leftovers() -> None:
    """A failed test must not leave an agent running after the test session."""
    for proc in _STARTED:
        if proc.poll() is None:
            proc.kill()


class AgentProcess:
    """``sefwd run`` in a subprocess; stderr is drained by a thread (a pipe, so file-size limits
    set on the agent in tests do not silence its logs), and also copied to ``log``."""

    def __init__(self, config: Path, log: Path, *, env: dict[str, str] | None = None, args: tuple[str, ...] = ("run",)) -> None:
        self.config = config
        self.log = log
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
        full_env.update(env or {})
        full_env["PYTHONPATH"] = str(ROOT)
        self._log_fh = open(log, "ab")
        self._chunks: list[bytes] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "forwarder", *args, "--config", str(config)],
            stdout=subprocess.DEVNULL if "run" in args else subprocess.PIPE,
            stderr=subprocess.PIPE, env=full_env, cwd=str(ROOT),
        )
        _STARTED.append(self.proc)
        self._drain = threading.Thread(target=self._read_stderr, daemon=True)
        self._drain.start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in iter(self.proc.stderr.readline, b""):
            self._chunks.append(line)
            self._log_fh.write(line)
            self._log_fh.flush()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._drain.join(10)

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        self._drain.join(10)
        return rc

    def alive(self) -> bool:
        return self.proc.poll() is None

    def logs(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")


def dead_letters(config: Path, sink: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """``sefwd deadletter list SINK --json``: the sink's dead letters as the CLI shows them."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-m", "forwarder", "deadletter", "list", sink, "--json", "--config", str(config)],
                         capture_output=True, env=full_env, cwd=str(ROOT), timeout=60, check=True)
    return [orjson.loads(line) for line in out.stdout.splitlines() if line.strip()]


_HELD: list[socket.socket] = []  # bound, never listening: refused, and no other test can take the port


def closed_port() -> int:
    """A loopback port nothing listens on: connections to it are refused. The socket stays bound (not
    listening) for the life of the test process, so a parallel test cannot bind the port meanwhile."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    return int(s.getsockname()[1])


_CALLBACK_LISTENING = re.compile(r"approval callback listening on (https?://\S+?/approvals)")


def callback_url(agent: AgentProcess, timeout: float = 60) -> str:
    """The URL of the agent's approval callback once it listens, read from its log: a test configures
    ``listen = "127.0.0.1:0"`` and the OS picks a free port (no port picked beforehand that another
    test could take in between)."""
    found = wait_until(lambda: _CALLBACK_LISTENING.search(agent.logs()) or not agent.alive(), timeout,
                       "the approval callback to listen")
    assert isinstance(found, re.Match), f"the agent exited: {agent.logs()[-3000:]}"
    return found.group(1)


@contextmanager
def callback_agent(config: Path, log: Path, env: dict[str, str]) -> Iterator[tuple[AgentProcess, str]]:
    """The real agent (its config has the approval callback on ``127.0.0.1:0``) and the callback's
    URL once it listens; the agent is terminated on exit."""
    agent = AgentProcess(config, log, env=env)
    try:
        yield agent, callback_url(agent)
    finally:
        agent.terminate()
