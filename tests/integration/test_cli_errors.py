"""Failures a user can cause end as one line on stderr and a documented exit code, never a traceback."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.agent import ROOT, closed_port, wait_until

EXIT_FAILURE, EXIT_CONFIG, EXIT_INTERRUPTED = 1, 2, 130


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def sefwd(*args: str, prefix: tuple[str, ...] = (), timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, "-m", "forwarder", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=str(ROOT))


def one_clear_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("sefwd: "), stderr
    return lines[0]



def _without_capabilities(closed: Path) -> tuple[str, ...]:
    """The setpriv prefix that runs a command as root with no capability; skips when that cannot be done."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv (util-linux): cannot drop root's capabilities to test EACCES")
    prefix = (setpriv, "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all")
    closed.chmod(0o000)
    try:
        probe = subprocess.run([*prefix, sys.executable, "-c", f"import os; os.listdir({str(closed)!r})"],
                               capture_output=True, text=True, timeout=60)
    finally:
        closed.chmod(0o700)
    if "PermissionError" not in probe.stderr:
        last = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
        pytest.skip(f"cannot drop root's capabilities here (a container without CAP_SETPCAP?): {last}")
    return prefix


@pytest.mark.parametrize("command", [("status",), ("status", "--json"), ("deadletter", "list")])
def test_unreadable_state_dir_is_one_line_and_exit_1(tmp_path, command):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "agent.lock").write_bytes(b"")
    (state / "state.db").write_bytes(b"")
    config = tmp_path / "c.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:
        # Root reads everything (CI runs as root) by its capabilities, not by being uid 0: the command runs
        # as root without any capability, for which a 0000 directory of its own is as closed as for
        # anyone. (Not as another user: the checkout and the venv may sit where only root can read, such
        # as a clone in a 0700 `mktemp -d` directory or in /root.)
        prefix = _without_capabilities(state)
    state.chmod(0o000)
    try:
        res = sefwd(*command, "--config", str(config), prefix=prefix)
    finally:
        state.chmod(0o700)
    assert res.returncode == EXIT_FAILURE, res.stderr
    line = one_clear_line(res.stderr)
    assert "Permission denied" in line and str(state) in line
    # --json: the same error as one JSON document on stdout (issue 32); otherwise stdout stays empty
    assert (json.loads(res.stdout)["exit_code"] == EXIT_FAILURE) if "--json" in command else res.stdout == ""


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
