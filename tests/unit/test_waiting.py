"""WaitNotice: says what we wait for at once, repeats at its interval, stops when done."""
from __future__ import annotations

import threading

from forwarder.agent.waiting import WaitNotice
from tests.agent import wait_until


def test_says_at_once_repeats_and_stops_when_done():
    said: list[str] = []
    done = threading.Event()
    count = iter(range(1000))
    notice = WaitNotice(said.append, lambda: f"waiting {next(count)}", done=done.is_set, every=0.05).start()
    wait_until(lambda: len(said) >= 3, 10, "three notices")
    done.set()
    wait_until(lambda: not notice._thread.is_alive(), 10, "the notice to end")
    assert said[:3] == ["waiting 0", "waiting 1", "waiting 2"]


def test_closed_before_first_says_nothing():
    said: list[str] = []
    with WaitNotice(said.append, "slow", first=60.0) as notice:
        pass
    notice._thread.join(10)
    assert not notice._thread.is_alive() and said == []


def _blocked_signals(native_id: int) -> int:
    for line in open(f"/proc/self/task/{native_id}/status"):
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    raise AssertionError("no SigBlk line")


def test_ctrl_c_and_sigterm_are_left_to_the_main_thread():
    """A Ctrl-C the kernel gave the notice thread would reach the main thread only when its wait ends
    (a retry backoff: `sefwd approve` ignored Ctrl-C for 30 s and more under load); blocked here, the
    kernel delivers it to the main thread, which raises KeyboardInterrupt at once."""
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    said: list[str] = []
    with WaitNotice(said.append, "slow", first=60.0) as notice:
        mask = wait_until(lambda: notice._thread.native_id and _blocked_signals(notice._thread.native_id), 10,
                          "the notice thread's signal mask")
        assert mask & (1 << (signal.SIGINT - 1)) and mask & (1 << (signal.SIGTERM - 1))
        assert not _blocked_signals(threading.main_thread().native_id) & (1 << (signal.SIGINT - 1))


def test_the_wait_notice_delay_from_the_environment_takes_only_finite_seconds(monkeypatch) -> None:
    from forwarder.agent.cli import WAIT_NOTICE_AFTER, _wait_notice_after

    for value, expected in [("0.3", 0.3), ("0", 0.0), ("-5", 0.0), ("nan", WAIT_NOTICE_AFTER),
                            ("inf", WAIT_NOTICE_AFTER), ("-inf", 0.0), ("soon", WAIT_NOTICE_AFTER),
                            ("", WAIT_NOTICE_AFTER), ("1e400", WAIT_NOTICE_AFTER)]:
        monkeypatch.setenv("SEFWD_WAIT_NOTICE_AFTER", value)
        assert _wait_notice_after() == expected, value
    monkeypatch.delenv("SEFWD_WAIT_NOTICE_AFTER")
    assert _wait_notice_after() == WAIT_NOTICE_AFTER
