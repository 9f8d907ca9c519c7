"""A delivery worker told to drain or halt never sleeps through it: ``Store.wait`` checks its ``unless``
events under the lock ``wake()`` takes, so an event set just before the wake cannot be missed (it was
missed once: a Ctrl-C'd `sefwd demo` then waited out the whole 10 s drain_timeout)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from forwarder.store.database import Store


def test_an_event_set_before_the_wait_returns_at_once(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state", fsync=False)
    try:
        draining, halt = threading.Event(), threading.Event()
        position = store.next_index  # nothing there yet: without an event this would sleep the timeout
        assert store.wait(position, 0.01, unless=(draining, halt)) is False
        draining.set()  # what close() does before store.wake(): the worker had not reached wait() yet
        started = time.monotonic()
        assert store.wait(position, 600, unless=(draining, halt)) is True
        assert time.monotonic() - started < 60  # not the 600 s timeout (a generous bound: a loaded machine)
        halt.set()
        draining.clear()
        assert store.wait(position, 600, unless=(draining, halt)) is True
    finally:
        store.close()


def test_a_waiter_is_woken_by_the_event_and_wake(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state", fsync=False)
    try:
        draining = threading.Event()
        result: list[bool] = []
        waiter = threading.Thread(target=lambda: result.append(store.wait(store.next_index, 600, unless=(draining,))))
        waiter.start()
        # Set and wake at any moment relative to the waiter: before it waits, or while it waits.
        draining.set()
        store.wake()
        waiter.join(60)
        assert not waiter.is_alive() and result == [True]
    finally:
        store.close()
