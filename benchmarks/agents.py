"""What the agent benchmarks share: spawning `sefwd run` on an emulator VM, and when each VM first polled."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from benchmarks.common import ROOT
from forwarder.emulator import Emulator


def spawn_agent(emu: Emulator, vm_dir: Path, vm: str, body: str, env: dict[str, str] | None = None,
                *, poll_interval_ms: int | None = None, stdout: int | IO[bytes] = subprocess.DEVNULL,
                wrapper: list[str] | None = None) -> subprocess.Popen[bytes]:
    """`python -m forwarder run` on emulator VM ``vm``, state and log (``agent.log``) under ``vm_dir``.

    ``body`` is the config after [imds], [state] and [agent] (sinks, telemetry); heartbeats are off
    so that an idle agent only polls. ``wrapper``: a script (and its arguments) run instead of
    ``-m forwarder``, given the CLI's arguments after them.
    """
    vm_dir.mkdir(parents=True, exist_ok=True)
    config = vm_dir / "sefwd.toml"
    interval = f'poll_interval = "{poll_interval_ms}ms"\n' if poll_interval_ms else ""
    config.write_text(
        f'[imds]\nendpoint = "{emu.vm_url(vm)}"\n{interval}'
        f'[state]\ndir = "{vm_dir / "state"}"\n'
        '[agent]\nheartbeat = "0"\ndrain_timeout = "2s"\n' + body
    )
    full_env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(vm_dir), **(env or {})}
    with open(vm_dir / "agent.log", "ab") as err:
        return subprocess.Popen([sys.executable, *(wrapper or ["-m", "forwarder"]), "run", "--config", str(config)],
                                stdout=stdout, stderr=err, env=full_env, cwd=str(ROOT))


class FirstGets:
    """Monotonic time at which the emulator answered each VM's first Scheduled Events GET."""

    def __init__(self, emu: Emulator) -> None:
        self.times: dict[str, float] = {}
        self._arrived = threading.Condition()
        count = emu.platform.count

        # The emulator counts each request just before its answer leaves: timing that call needs no
        # polling of stats(), whose own cost and interval would blur a figure of a few hundred ms.
        def counting(vm: str, method: str, endpoint: str, status: int | str) -> None:
            now = time.monotonic()
            count(vm, method, endpoint, status)
            if method == "GET" and endpoint == "scheduledevents" and str(status) == "200" and vm not in self.times:
                with self._arrived:
                    self.times.setdefault(vm, now)
                    self._arrived.notify_all()

        emu.platform.count = counting  # type: ignore[method-assign]

    def wait(self, vm: str, timeout: float, alive: Callable[[], bool]) -> float | None:
        """When ``vm`` first polled; None if it did not within ``timeout`` or ``alive()`` turned false."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while vm not in self.times:
                left = deadline - time.monotonic()
                if left <= 0 or not alive():
                    return None
                self._arrived.wait(min(left, 0.2))
            return self.times[vm]

    def wait_all(self, vms: list[str], timeout: float, check: Callable[[], None]) -> None:
        """Until every VM has polled; ``check`` raises if an agent died; RuntimeError on timeout."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while missing := [vm for vm in vms if vm not in self.times]:
                check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{len(missing)} agent(s) made no Scheduled Events GET within "
                                       f"{timeout:g} s: {', '.join(missing[:5])}")
                self._arrived.wait(min(left, 0.2))


def stop_agents(procs: list[subprocess.Popen[bytes]], timeout: float = 20.0) -> None:
    """SIGTERM every agent at once, then wait; kill whoever is still there after ``timeout``."""
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.terminate()
            except OSError:
                pass
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
