"""When a hook gets SIGTERM and SIGKILL (HookDeadline), and the workers' wake-up that is never lost (Wakeup)."""
from __future__ import annotations

import threading

from forwarder.approval import hooks
from forwarder.approval.hooks import HookDeadline, grace_for
from forwarder.approval.wakeup import Wakeup


def test_a_hard_deadline_puts_sigterm_before_sigkill_and_sigkill_at_the_deadline() -> None:
    # A Spot notice: 30 s, less a 5 s margin: SIGKILL at 25 s, SIGTERM 5 s before it.
    assert HookDeadline.by(1025.0, timeout=300.0, now=1000.0).times() == (1020.0, 1025.0)
    # Less time: a fifth of it between the two.
    assert HookDeadline.by(1010.0, timeout=300.0, now=1000.0).times() == (1008.0, 1010.0)
    # hook_timeout first: SIGTERM then, SIGKILL KILL_GRACE later, still never after the deadline.
    assert HookDeadline.by(1025.0, timeout=3.0, now=1000.0).times() == (1003.0, 1003.0 + hooks.KILL_GRACE)
    assert HookDeadline.by(1025.0, timeout=22.0, now=1000.0).times() == (1020.0, 1025.0)
    # No deadline: SIGTERM after the timeout, SIGKILL KILL_GRACE later (as before).
    assert HookDeadline.after(60.0, now=1000.0).times() == (1060.0, 1060.0 + hooks.KILL_GRACE)
    assert grace_for(0.0) == 0.0 and grace_for(-3.0) == 0.0 and grace_for(1000.0) == hooks.KILL_GRACE


def test_tighten_moves_both_only_earlier() -> None:
    limit = HookDeadline.by(1100.0, timeout=300.0, now=1000.0)
    assert limit.times() == (1095.0, 1100.0)
    assert not limit.tighten(1200.0, now=1010.0)  # later: nothing moves
    assert not limit.tighten(1100.0, now=1010.0)
    assert limit.tighten(1020.0, now=1010.0)  # NotBefore moved closer: 10 s left, 2 s of grace
    assert limit.times() == (1018.0, 1020.0)
    assert limit.tighten(1019.0, now=1018.5)  # SIGTERM is earlier already: only SIGKILL moves
    assert limit.times() == (1018.0, 1019.0)
    assert limit.tighten(1000.0, now=1018.9)  # already past: both at once
    assert limit.times() == (1000.0, 1000.0)


def test_a_wakeup_sent_between_the_look_and_the_wait_is_not_lost() -> None:
    wakeup = Wakeup()
    mark = wakeup.mark()  # a worker is about to look at the store ...
    wakeup.notify(1)  # ... the scheduler makes a row due and notifies before the worker waits ...
    assert wakeup.wait(mark, 10.0) is True  # ... the wait returns at once instead of sleeping 10 s
    assert wakeup.wait(wakeup.mark(), 0.01) is False  # nothing new since: it waits (for the timeout)


def test_a_waiting_worker_is_woken_and_a_stop_ends_every_wait() -> None:
    wakeup, stop = Wakeup(), threading.Event()
    results: list[bool] = []
    ready = threading.Barrier(4)

    def worker() -> None:
        mark = wakeup.mark()
        ready.wait()
        results.append(wakeup.wait(mark, 30.0, stop))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    ready.wait()
    wakeup.notify(1)  # one row: one worker (or any that had not reached its wait yet)
    stop.set()
    wakeup.notify_all()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads) and results == [True, True, True]
