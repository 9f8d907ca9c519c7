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
