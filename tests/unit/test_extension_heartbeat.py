"""The Azure VM extension heartbeat file the running agent keeps fresh ([agent] heartbeat_file)."""
from __future__ import annotations

import json
import threading
from pathlib import Path

from forwarder.agent.config import parse_config
from forwarder.agent.extension_heartbeat import FAILING_POLLS, HeartbeatFile, heartbeat
from tests.agent import wait_until


def _snapshot(polls: int = 5, failures: int = 0, **sinks: dict) -> dict:
    return {"imds": {"polls": polls, "consecutive_failures": failures, "last_poll_ok": "2026-11-23T23:00:00Z"},
            "sinks": sinks}


def _beat(doc: list) -> dict:
    assert doc[0]["version"] == 1.0 and doc[0]["heartbeat"]["formattedMessage"]["lang"] == "en-US"
    return doc[0]["heartbeat"]


def test_ready_while_imds_answers_and_notready_when_it_fails_or_the_agent_stops() -> None:
    ok = _beat(heartbeat(_snapshot(hook={"backlog": 2, "dead_lettered": 1})))
    assert ok["status"] == "Ready" and ok["code"] == 0
    assert ok["formattedMessage"]["message"] == (
        "sefwd running: last IMDS poll ok 2026-11-23T23:00:00Z, 5 polls; sinks: hook backlog 2 dead letters 1")
    assert _beat(heartbeat(_snapshot(failures=FAILING_POLLS - 1)))["status"] == "Ready"  # one hiccup is no outage
    failing = _beat(heartbeat(_snapshot(failures=FAILING_POLLS)))
    assert failing["status"] == "NotReady" and "IMDS failing" in failing["formattedMessage"]["message"]
    assert _beat(heartbeat(_snapshot(polls=0)))["formattedMessage"]["message"].startswith("sefwd starting")
    stopped = _beat(heartbeat(_snapshot(), stopped=True))
    assert stopped["status"] == "NotReady" and stopped["formattedMessage"]["message"].startswith("sefwd stopped")


def test_the_file_is_rewritten_on_every_tick_and_marked_stopped_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat.json"
    polls = iter(range(1, 1000))
    stop = threading.Event()
    beat = HeartbeatFile(path, lambda: _snapshot(polls=next(polls)), stop, interval=0.05).start()
    first = json.loads(path.read_text())  # written at start, before the first tick
    assert _beat(first)["status"] == "Ready"
    wait_until(lambda: json.loads(path.read_text()) != first, 10, "a refreshed heartbeat")
    stop.set()
    beat._thread.join(10)
    assert _beat(json.loads(path.read_text()))["status"] == "NotReady"
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_write_failure_does_not_stop_the_agent(tmp_path: Path) -> None:
    stop = threading.Event()
    beat = HeartbeatFile(tmp_path / "missing-dir" / "hb.json", _snapshot, stop, interval=0.05)
    beat.write()  # no directory: logged once, not raised
    assert not (tmp_path / "missing-dir").exists()


def test_the_config_key_is_off_by_default_and_set_by_file_or_environment(tmp_path: Path) -> None:
    source = str(tmp_path / "c.toml")
    assert parse_config({}, {}, source, check_sinks=False).agent.heartbeat_file is None
    assert parse_config({"agent": {"heartbeat_file": ""}}, {}, source, check_sinks=False).agent.heartbeat_file is None
    env = {"SEFWD_AGENT_HEARTBEAT_FILE": "/var/lib/sefwd/extension-heartbeat.json"}
    assert parse_config({}, env, source, check_sinks=False).agent.heartbeat_file == Path(env["SEFWD_AGENT_HEARTBEAT_FILE"])


def test_close_writes_stopped_as_the_last_word_even_with_the_thread_mid_tick(tmp_path: Path) -> None:
    """The thread is a daemon: an agent exiting right after `stop` was set would not wait for the
    thread's own stopped write (a heartbeat left Ready after a clean stop, seen under load). close()
    writes it, and a tick that comes late never overwrites it."""
    path = tmp_path / "heartbeat.json"
    in_tick, release = threading.Event(), threading.Event()

    def slow_snapshot() -> dict:
        if threading.current_thread().name == "extension-heartbeat":
            in_tick.set()
            release.wait(10)
        return _snapshot()

    stop = threading.Event()
    beat = HeartbeatFile(path, slow_snapshot, stop, interval=0.01).start()
    assert in_tick.wait(10)  # the thread is inside a "running" write
    closer = threading.Thread(target=beat.close)
    closer.start()
    release.set()  # the running tick finishes first (it holds the lock), then close() writes stopped
    closer.join(10)
    assert _beat(json.loads(path.read_text()))["status"] == "NotReady"
    beat.write()  # a later tick (stop was never set here): no effect
    assert _beat(json.loads(path.read_text()))["formattedMessage"]["message"].startswith("sefwd stopped")
