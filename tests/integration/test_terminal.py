"""What a person sees at a terminal: each command runs under a pseudo-terminal (stdin, stdout and
stderr on the pty, which is the controlling terminal, so Ctrl-C is a typed ^C), and the test reads
the screen as it comes."""
from __future__ import annotations

import fcntl
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.agent import ROOT, closed_port

CTRL_C = b"\x03"
BIN = Path(sys.executable).parent



class Terminal:
    """One program on a fresh pty; ``screen`` is everything it wrote (CR LF turned into LF)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> None:
        master, slave = os.openpty()
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_") and k != "NO_COLOR"}
        full_env.update({"PYTHONPATH": str(ROOT), "TERM": "xterm", "PATH": f"{BIN}:{os.environ.get('PATH', '')}"})
        full_env.update(env or {})

        def become_session_leader_on_the_pty() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=full_env, cwd=str(cwd),
                                     preexec_fn=become_session_leader_on_the_pty, close_fds=True)
        os.close(slave)
        self.master = master
        self._raw = b""

    @property
    def screen(self) -> str:
        return self._raw.decode(errors="replace").replace("\r\n", "\n")

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the program exited and closed the pty
            return False
        if not data:
            return False
        self._raw += data
        return True

    def expect(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        """Wait until ``pattern`` (a regex) is on the screen; fail with the screen shown otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.screen)
            if m:
                return m
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 0.2)) and self.proc.poll() is not None:
                m = re.search(pattern, self.screen)
                if m:
                    return m
                raise AssertionError(f"{pattern!r} not seen within {timeout}s; the screen:\n{self.screen}")

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def wait(self, timeout: float = 15.0) -> int:
        """Exit code, reading the rest of the screen meanwhile."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.1)
        while self._read(0.05) and select.select([self.master], [], [], 0)[0]:
            pass
        if self.proc.poll() is None:
            raise AssertionError(f"still running after {timeout}s; the screen:\n{self.screen}")
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.fixture
def terminal():
    opened: list[Terminal] = []

    def run(*args: str, env: dict[str, str] | None = None, program: list[str] | None = None) -> Terminal:
        t = Terminal(program or [sys.executable, "-m", "forwarder", *args], env=env)
        opened.append(t)
        return t

    yield run
    for t in opened:
        t.close()


def no_traceback(screen: str) -> None:
    assert "Traceback" not in screen and "KeyboardInterrupt" not in screen, screen


def test_busy_port_is_one_line(terminal):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t = terminal("emulator", "--listen", f"127.0.0.1:{port}")
        assert t.wait() == 1
    assert t.screen.strip() == f"sefwd: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_unreachable_imds_says_what_it_waits_for_and_ctrl_c_stops_it(terminal, tmp_path):
    port = closed_port()
    config = tmp_path / "c.toml"
    config.write_text(f'[imds]\nendpoint = "http://127.0.0.1:{port}"\n[state]\ndir = "{tmp_path / "state"}"\n')
    t = terminal("run", "--config", str(config))
    # A refused port is named at once, not taken for the slow first call (issue 32)
    t.expect(rf"waiting for IMDS at http://127.0.0.1:{port}: .*connection refused", 20)
    status = terminal("status", "--config", str(config))
    assert status.wait(30) == 4  # running, degraded: waiting
    assert re.search(rf"waiting for IMDS at http://127.0.0.1:{port} since \S+ \(no answer yet; latest error: "
                     r".*connection refused", status.screen)
    assert "has not run" not in status.screen
    t.type(CTRL_C)
    assert t.wait(30) == 0
    t.expect("sefwd stopped")
    no_traceback(t.screen)


def test_ctrl_c_stops_demo_at_once_with_a_summary_and_colour(terminal):
    t = terminal("demo")
    t.expect(r"sefwd demo: scenario 'demo'", 60)
    t.expect(r"\x1b\[[0-9;]*m", 60)  # pretty lines, coloured: this is a terminal
    t.type(CTRL_C)
    started = time.monotonic()
    assert t.wait(15) == 130
    assert time.monotonic() - started < 5, "Ctrl-C must stop the demo at once"
    t.expect(r"sefwd demo: \d+ record\(s\) about \d+ event\(s\), stopped by Ctrl-C")
    no_traceback(t.screen)


def test_no_color_means_no_colour(terminal):
    t = terminal("demo", env={"NO_COLOR": "1"})
    t.expect(r"scheduledevent\.\w+|forwarder\.started|Freeze", 60)
    t.type(CTRL_C)
    assert t.wait(15) == 130
    assert "\x1b[" not in t.screen, t.screen


def test_status_exit_codes_and_unknown_sink(terminal, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'[state]\ndir = "{tmp_path / "state"}"\n')
    status = terminal("status", "--config", str(config))
    assert status.wait(30) == 1
    assert "agent: NOT running" in status.screen
    unknown = terminal("deadletter", "list", "nosuch", "--config", str(config))
    assert unknown.wait(30) == 2
    assert unknown.screen.strip() == "sefwd: no sink named 'nosuch' (configured: stdout)"


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_tab_completes_in_an_interactive_bash(terminal, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = subprocess.run([sys.executable, "-m", "forwarder", "completion", "bash"], capture_output=True,
                            text=True, timeout=60, env=env, cwd=str(ROOT)).stdout
    (tmp_path / "sefwd.bash").write_text(script)
    rc = tmp_path / "bashrc"
    rc.write_text(f'PS1="$ "\nsource {tmp_path / "sefwd.bash"}\n')
    t = terminal(program=["bash", "--noprofile", "--rcfile", str(rc), "-i"], env={"HOME": str(tmp_path)})
    t.expect(r"\$ ", 30)
    t.type(b"sefwd dea\t")
    t.expect(r"sefwd deadletter ", 30)
    t.type(b"\x15exit\n")  # ^U clears the line
    t.wait(15)
