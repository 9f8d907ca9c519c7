"""Failures a user can cause end as one line on stderr and a documented exit code, never a traceback."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent import ROOT, closed_port, wait_until

EXIT_FAILURE, EXIT_CONFIG, EXIT_INTERRUPTED = 1, 2, 130
NOBODY = 65534


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def sefwd(*args: str, prefix: tuple[str, ...] = (), timeout: float = 60, root: Path = ROOT,
          ) -> subprocess.CompletedProcess[str]:
    env = {**_env(), "PYTHONPATH": str(root)}
    return subprocess.run([*prefix, sys.executable, "-m", "forwarder", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(root))


def one_clear_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("sefwd: "), stderr
    return lines[0]



@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory another user can traverse (pytest's tmp_path lives under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="sefwd-perm-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _as_nobody(public_dir: Path) -> tuple[tuple[str, ...], Path]:
    """The setpriv prefix that runs a command as nobody, and a copy of the code nobody can read.

    The checkout may sit where nobody cannot read it (a clone in a 0700 `mktemp -d` directory, or in
    /root): the code the command runs is copied under ``public_dir``. The interpreter cannot be copied;
    when nobody cannot run it (a venv under /root), the test is skipped and says so.
    """
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv (util-linux): cannot drop privileges to test EACCES")
    prefix = (setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
    code = public_dir / "code"
    for package in ("forwarder", "sinks"):
        shutil.copytree(ROOT / package, code / package, ignore=shutil.ignore_patterns("__pycache__"))
    for path in [code, *code.rglob("*")]:  # the checkout's modes may be 0600/0700 (umask 077)
        path.chmod(0o755 if path.is_dir() else 0o644)
    probe = subprocess.run([*prefix, sys.executable, "-c", "import forwarder.agent.cli"], capture_output=True,
                           text=True, timeout=60, env={**_env(), "PYTHONPATH": str(code)}, cwd=str(code))
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"nobody cannot run this interpreter ({sys.executable}): {last}")
    return prefix, code


@pytest.mark.parametrize("command", [("status",), ("status", "--json"), ("deadletter", "list")])
def test_unreadable_state_dir_is_one_line_and_exit_1(public_dir, command):
    state = public_dir / "state"
    state.mkdir(mode=0o700)
    (state / "agent.lock").write_bytes(b"")
    (state / "state.db").write_bytes(b"")
    config = public_dir / "c.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    config.chmod(0o644)
    prefix: tuple[str, ...] = ()
    root = ROOT
    if os.geteuid() == 0:
        # Root reads everything (CI runs as root): run the command as nobody, as a user without access
        # would. (setpriv, not os.setuid in a preexec_fn: the latter cannot exec a pyenv python under /root.)
        prefix, root = _as_nobody(public_dir)
    else:
        state.chmod(0o000)
    try:
        res = sefwd(*command, "--config", str(config), prefix=prefix, root=root)
    finally:
        state.chmod(0o700)
    assert res.returncode == EXIT_FAILURE, res.stderr
    line = one_clear_line(res.stderr)
    assert "Permission denied" in line and str(state) in line
    assert res.stdout == ""


def test_missing_config_file_is_one_line_and_exit_2(tmp_path):
    res = sefwd("status", "--config", str(tmp_path / "nope.toml"))
    assert res.returncode == EXIT_CONFIG
    assert "Traceback" not in res.stderr and "does not exist" in res.stderr


def test_unreachable_imds_once_is_one_line_and_exit_1(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'[imds]\nendpoint = "http://127.0.0.1:{closed_port()}"\nfirst_call_timeout = "2s"\n'
                      f'[state]\ndir = "{tmp_path / "state"}"\n')
    res = sefwd("once", "--config", str(config))
    assert res.returncode == EXIT_FAILURE
    assert "not reachable" in one_clear_line(res.stderr)


def _ctrl_c_as_in_a_terminal() -> None:
    """In the child before exec: SIGINT at its default and unblocked, as a shell gives a foreground
    command. A test worker can pass it on ignored or blocked (a command started with SIGINT ignored
    keeps it ignored, as Python rightly does for background jobs: seen in parallel runs)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _signal_masks(pid: int | str) -> str:
    try:
        return " ".join(line.strip() for line in open(f"/proc/{pid}/status") if line.startswith(("SigBlk", "SigIgn")))
    except OSError:
        return "?"


def test_ctrl_c_in_approve_against_unreachable_imds_says_what_it_waits_for_then_exits_130(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'[imds]\nendpoint = "http://127.0.0.1:{closed_port()}"\n[state]\ndir = "{tmp_path / "state"}"\n')
    # PYTHONFAULTHANDLER: should it ever hang after Ctrl-C, a SIGABRT makes it print every thread's stack.
    proc = subprocess.Popen([sys.executable, "-m", "forwarder", "approve", "--config", str(config), "some-event-id"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**_env(), "PYTHONFAULTHANDLER": "1", "SEFWD_WAIT_NOTICE_AFTER": "0.3"}, cwd=str(ROOT),
                            preexec_fn=_ctrl_c_as_in_a_terminal)  # the waiting line after 0.3 s, not 5 s
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(proc.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        wait_until(lambda: any("waiting for IMDS" in line for line in err), 30, "approve's waiting line")
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            masks = f"child {_signal_masks(proc.pid)}; test worker {_signal_masks('self')}\n"
            proc.send_signal(signal.SIGABRT)
            proc.wait(10)
            reader.join(5)
            raise AssertionError("approve did not exit 30 s after Ctrl-C; " + masks + "its threads:\n"
                                 + "".join(err)[-6000:]) from None
        assert rc == EXIT_INTERRUPTED
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)
    stderr = "".join(err)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert stderr.splitlines()[-1] == "sefwd: interrupted (Ctrl-C)"
    assert proc.stdout is not None and proc.stdout.read() == ""


def test_a_time_scale_that_is_no_finite_non_negative_number_is_a_usage_error() -> None:
    """`--time-scale` of `sefwd demo` and `sefwd emulator`: a clear usage error (exit 2), not a traceback."""
    for command, value in (("demo", "-1"), ("demo", "nan"), ("emulator", "inf"), ("emulator", "fast")):
        done = sefwd(command, "--time-scale", value)
        assert done.returncode == 2 and "--time-scale" in done.stderr and "Traceback" not in done.stderr, done.stderr
