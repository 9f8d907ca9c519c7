"""Local hooks: real subprocesses get the event in env vars and the record on stdin; timeouts,
stops, output limits and missing programs are reported, never raised."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson
import pytest

from forwarder.approval import hooks
from forwarder.approval.hooks import HookResult, run_hook
from forwarder.imds.differ import Change
from forwarder.imds.document import Document, parse_event
from forwarder.imds.identity import VmIdentity
from forwarder.records import RecordFactory
from tests.agent import wait_until

VM = VmIdentity(vm_id="vm-id-0", name="demo-vm-0", computer_name="demo-vm-0")


def make_record(**fields: Any) -> dict[str, Any]:
    """A scheduledevent.scheduled record as the agent produces it."""
    raw = {
        "EventId": "A1F0E5A7-0001-4C5D-9E8F-000000000001", "EventType": "Freeze", "ResourceType": "VirtualMachine",
        "Resources": ["demo-vm-0", "demo-vm-1"], "EventStatus": "Scheduled", "NotBefore": "Sun, 22 Nov 2026 07:50:07 GMT",
        "Description": "Virtual machine is being paused because of a memory-preserving Live Migration operation.",
        "EventSource": "Platform", "DurationInSeconds": 5, **fields,
    }
    event = parse_event(raw, 0)
    factory = RecordFactory(VM, "2020-07-01", clock=lambda: datetime(2026, 11, 22, 7, 35, tzinfo=timezone.utc))
    (record,) = factory.for_changes([Change("scheduled", event, None)], Document(incarnation=2, events=(event,)))
    return record.to_dict()


RECORD = make_record()


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for init (which may not reap in a container)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2:].split()[0] == b"Z"


def read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def run(command: Any, record: dict[str, Any] = RECORD, **kw: Any) -> HookResult:
    kw.setdefault("timeout", 20.0)
    kw.setdefault("output_limit", 4096)
    return run_hook(command, record, **kw)


# -- what the hook sees ------------------------------------------------------------------------------

def test_env_vars_and_stdin(tmp_path: Path) -> None:
    dumper = tmp_path / "dump.py"
    dumper.write_text(
        "import json, os, sys\n"
        "data = {'stdin': sys.stdin.read(), 'env': {k: v for k, v in os.environ.items() if k.startswith('SEFWD_')},\n"
        "        'extra': os.environ.get('HOOK_EXTRA'), 'path': os.environ.get('PATH')}\n"
        f"open({str(tmp_path / 'seen.json')!r}, 'w').write(json.dumps(data))\n"
        "print('dumped')\n"
    )
    result = run([sys.executable, str(dumper)], extra_env={"HOOK_EXTRA": "yes"})
    assert result.ok, result
    assert result.output == "dumped\n"
    seen = orjson.loads((tmp_path / "seen.json").read_bytes())
    assert orjson.loads(seen["stdin"]) == RECORD
    assert seen["extra"] == "yes" and seen["path"] == os.environ.get("PATH")
    assert seen["env"] == {
        "SEFWD_EVENT_ID": "A1F0E5A7-0001-4C5D-9E8F-000000000001",
        "SEFWD_EVENT_TYPE": "Freeze",
        "SEFWD_EVENT_STATUS": "Scheduled",
        "SEFWD_EVENT_SOURCE": "Platform",
        "SEFWD_EVENT_RESOURCES": "demo-vm-0,demo-vm-1",
        "SEFWD_EVENT_NOT_BEFORE": "2026-11-22T07:50:07.000Z",
        "SEFWD_EVENT_DURATION": "5",
        "SEFWD_EVENT_DESCRIPTION": "Virtual machine is being paused because of a memory-preserving Live Migration operation.",
        "SEFWD_CHANGE": "scheduled",
        "SEFWD_AFFECTS_THIS_VM": "true",
        "SEFWD_RECORD_ID": RECORD["id"],
        "SEFWD_RECORD_TYPE": "scheduledevent.scheduled",
    }  # (the agent's own SEFWD_* settings are not inherited: hooks get only the event's)


def test_env_of_missing_fields_is_empty(tmp_path: Path) -> None:
    record = make_record(NotBefore="", DurationInSeconds=None, Resources=["other"], EventSource=None)
    hook = script(tmp_path, "show.sh", 'printf "[%s][%s][%s][%s]" "$SEFWD_EVENT_NOT_BEFORE" "$SEFWD_EVENT_DURATION" '
                                       '"$SEFWD_AFFECTS_THIS_VM" "$SEFWD_EVENT_SOURCE"\n')
    assert run([hook], record).output == "[][][false][]"
    unknown_vm = dict(record, data=dict(record["data"], AffectsThisVm=None))
    assert run([hook], unknown_vm).output == "[][][][]"


def test_list_runs_without_a_shell_and_string_runs_with_one(tmp_path: Path) -> None:
    hook = script(tmp_path, "args.sh", 'for a in "$@"; do printf "<%s>" "$a"; done\n')
    assert run([hook, "two words", "$HOME", "*"]).output == "<two words><$HOME><*>"
    result = run('echo "$SEFWD_EVENT_TYPE" | tr a-z A-Z; echo to-stderr >&2; exit 4')
    assert (result.exit_code, result.output, result.ok) == (4, "FREEZE\nto-stderr\n", False)
    assert result.command == 'echo "$SEFWD_EVENT_TYPE" | tr a-z A-Z; echo to-stderr >&2; exit 4'


# -- outcomes ----------------------------------------------------------------------------------------

def test_exit_codes(tmp_path: Path) -> None:
    good = run([script(tmp_path, "good.sh", "echo drained\nexit 0\n"), "--graceful"])
    assert (good.ok, good.exit_code, good.timed_out, good.error, good.output) == (True, 0, False, None, "drained\n")
    assert good.command.endswith("good.sh --graceful")
    bad = run([script(tmp_path, "bad.sh", "echo cannot drain >&2\nexit 3\n")])
    assert (bad.ok, bad.exit_code, bad.output) == (False, 3, "cannot drain\n")
    assert bad.to_audit() == {
        "Command": bad.command, "ExitCode": 3, "TimedOut": False, "Output": "cannot drain\n",
        "DurationSeconds": round(bad.duration, 3), "Error": None,
    }


def test_missing_or_unrunnable_program(tmp_path: Path) -> None:
    missing = run([str(tmp_path / "nope.sh"), "x"])
    assert (missing.ok, missing.exit_code, missing.timed_out) == (False, None, False)
    assert missing.error is not None and "nope.sh" in missing.error and "No such file" in missing.error
    plain = tmp_path / "plain.sh"
    plain.write_text("echo hi\n")  # not executable
    denied = run([str(plain)])
    assert denied.exit_code is None and denied.error is not None and "Permission denied" in denied.error
    assert run([]).error == "empty command"
    assert run("no-such-command-sefwd").exit_code == 127  # the shell runs; the command is missing


def test_output_is_bounded_and_says_how_much_was_cut(tmp_path: Path) -> None:
    hook = script(tmp_path, "loud.sh", "printf BEGIN\nhead -c 3000000 /dev/zero | tr '\\0' x\necho tail >&2\n")
    result = run([hook], output_limit=100)
    assert result.ok
    kept, _, note = result.output.partition("\n")
    assert kept == "BEGIN" + "x" * 95
    assert note == f"[... {3000010 - 100} more bytes cut, 3000010 in all]"
    assert run([hook], output_limit=0).output.startswith("\n[... 3000010 more bytes cut")


def test_a_hook_that_ignores_stdin_gets_a_large_record_without_deadlock(tmp_path: Path) -> None:
    record = make_record(Description="d" * 2_000_000)
    result = run([script(tmp_path, "quick.sh", "exit 0\n")], record)
    assert result.ok, result
    # One environment string must stay under the kernel's 128 KiB limit; stdin has it all.
    result = run('printf %s "$SEFWD_EVENT_DESCRIPTION" | wc -c', record)
    assert result.ok and int(result.output) == hooks.ENV_VALUE_LIMIT
    result = run([script(tmp_path, "reader.sh", "wc -c\n")], record)
    assert result.ok and int(result.output) == len(orjson.dumps(record)) + 1


def test_a_background_child_holding_the_output_does_not_hold_the_result(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    hook = script(tmp_path, "bg.sh", f"sleep 30 &\necho $! > {pid_file}\necho started\nexit 0\n")
    started = time.monotonic()
    result = run([hook])
    try:
        assert result.ok and result.output == "started\n"
        assert time.monotonic() - started < 10
    finally:
        child = read_pid(pid_file)
        if child is not None and not gone(child):
            os.kill(child, signal.SIGKILL)


# -- timeout and stop --------------------------------------------------------------------------------

def sleeper(tmp_path: Path, *, trap: bool = False) -> tuple[str, Path, Path]:
    """A hook that starts a sleeping child and sleeps too; writes both pids."""
    leader, child = tmp_path / "leader.pid", tmp_path / "child.pid"
    body = ("trap '' TERM\n" if trap else "") + (
        f"echo $$ > {leader}\nsleep 60 &\necho $! > {child}\necho waiting\nwait\n"
    )
    return script(tmp_path, "sleeper.sh", body), leader, child


def assert_group_gone(leader: Path, child: Path) -> None:
    pids = [read_pid(leader), read_pid(child)]
    assert None not in pids, "the hook did not get to write its pids"
    wait_until(lambda: all(gone(p) for p in pids if p is not None), 15, "the hook's processes to be gone")


def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    hook, leader, child = sleeper(tmp_path)
    result = run([hook], timeout=2.0)
    assert result.timed_out and not result.ok and result.error is None
    assert result.exit_code == -signal.SIGTERM
    assert result.output == "waiting\n"
    assert 2.0 <= result.duration < 15
    assert result.to_audit()["TimedOut"] is True
    assert_group_gone(leader, child)


def test_sigterm_ignored_then_sigkill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hooks, "KILL_GRACE", 0.5)
    hook, leader, child = sleeper(tmp_path, trap=True)
    result = run([hook], timeout=1.5)
    assert result.timed_out and result.exit_code == -signal.SIGKILL
    assert_group_gone(leader, child)


def test_stop_event_interrupts_the_hook(tmp_path: Path) -> None:
    hook, leader, child = sleeper(tmp_path)
    stop = threading.Event()

    def stop_once_running() -> None:
        wait_until(lambda: read_pid(child), 15, "the hook to start its child")
        stop.set()

    helper = threading.Thread(target=stop_once_running)
    helper.start()
    result = run([hook], timeout=60.0, stop=stop)
    helper.join()
    assert result.error == "interrupted: the agent is stopping"
    assert not result.timed_out and not result.ok
    assert result.duration < 30
    assert_group_gone(leader, child)


def test_never_raises_on_odd_records(tmp_path: Path) -> None:
    hook = script(tmp_path, "cat.sh", "cat\n")
    odd: dict[str, Any] = {"id": "x\0y", "type": None, "data": {"Resources": "not-a-list", "When": datetime(2020, 1, 1)}}
    result = run([hook], odd)
    assert result.ok, result
    assert orjson.loads(result.output)["data"]["When"].startswith("2020-01-01")
    assert run([hook], {"data": None}).ok
