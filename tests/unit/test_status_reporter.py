"""The status report is rewritten when something changes, and otherwise only every `refresh` seconds."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import orjson

from forwarder.agent.status import STATUS_KEY, StatusReporter
from forwarder.store.database import Store


def test_rewritten_on_change_not_on_every_poll_but_refreshed(tmp_path: Path) -> None:
    state: dict[str, Any] = {"imds": {"polls": 0, "last_poll_ok": "t0", "imds_errors": 0}, "sinks": {}}
    lock = threading.Lock()

    def snapshot() -> dict[str, Any]:
        with lock:
            return orjson.loads(orjson.dumps(state))

    def written() -> dict[str, Any]:
        return orjson.loads(reader.meta()[STATUS_KEY])

    def wait_for(check: Any, timeout: float) -> None:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if check():
                return
            time.sleep(0.01)
        raise AssertionError("the status report did not show the expected content in time")

    stop = threading.Event()
    reporter = StatusReporter(Store.open(tmp_path), snapshot, stop, interval=0.05, refresh=1.5)
    reader = Store.open(tmp_path)  # another connection, as `sefwd status` reads it
    reporter.write()
    reporter.start()
    try:
        with lock:  # a change that matters: written within about one interval
            state["imds"]["imds_errors"] = 1
        wait_for(lambda: written()["imds"]["imds_errors"] == 1, 5)
        first = written()["updated"]
        with lock:  # only the poll count and time move: no rewrite for those alone...
            state["imds"]["polls"] = 50
            state["imds"]["last_poll_ok"] = "t1"
        time.sleep(0.5)  # ten check intervals in which nothing may be written
        assert written()["imds"]["polls"] == 0 and written()["updated"] == first
        # ...until the refresh is due
        wait_for(lambda: written()["imds"]["polls"] == 50, 5)
    finally:
        stop.set()


def test_a_poke_writes_a_change_at_once_on_the_reporters_thread(tmp_path: Path) -> None:
    """The maintenance probe pokes the reporter when its state changes: the report shows it without
    waiting out the interval, and the write is the reporter thread's, not the poker's."""
    state = {"maintenance": {"state": "none"}}
    writers: list[str] = []

    def snapshot() -> dict[str, Any]:
        writers.append(threading.current_thread().name)
        return orjson.loads(orjson.dumps(state))

    stop = threading.Event()
    reporter = StatusReporter(Store.open(tmp_path), snapshot, stop, interval=3600, refresh=3600)
    reader = Store.open(tmp_path)
    reporter.write()
    reporter.start()
    try:
        state["maintenance"]["state"] = "maintenance"
        reporter.poke()
        deadline = time.monotonic() + 10
        while orjson.loads(reader.meta()[STATUS_KEY])["maintenance"]["state"] != "maintenance":
            assert time.monotonic() < deadline, "the poke was not written within 10 s (the interval is an hour)"
            time.sleep(0.01)
        assert writers[1:] == ["status"]  # after the first, direct write: only the reporter's thread
    finally:
        stop.set()
        reporter.poke()
