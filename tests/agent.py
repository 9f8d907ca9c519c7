"""Run the real agent (``python -m forwarder run``) as a subprocess and read what it delivered."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent


def write_config(path: Path, endpoint: str, state_dir: Path, *, sinks: str | None = None,
                 poll_interval: str = "300ms", extra: str = "") -> Path:
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


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll until ``predicate`` returns something truthy, or fail with ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class AgentProcess:
    """``sefwd run`` in a subprocess, logs to a file so a pipe never blocks it."""

    def __init__(self, config: Path, log: Path, *, env: dict[str, str] | None = None, args: tuple[str, ...] = ("run",)) -> None:
        self.config = config
        self.log = log
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
        full_env.update(env or {})
        full_env["PYTHONPATH"] = str(ROOT)
        self._log_fh = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "forwarder", *args, "--config", str(config)],
            stdout=subprocess.DEVNULL if "run" in args else subprocess.PIPE,
            stderr=self._log_fh, env=full_env, cwd=str(ROOT),
        )

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log_fh.close()

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log_fh.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def logs(self) -> str:
        return self.log.read_text(errors="replace")
