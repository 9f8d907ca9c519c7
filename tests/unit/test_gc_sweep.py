"""The agent's periodic full collection: garbage in cycles that reached the oldest generation is freed in minutes,
not when CPython's quarter rule finally allows a full collection (forwarder.agent.gc_sweep)."""
from __future__ import annotations

import gc
import threading
import weakref

from forwarder.agent.gc_sweep import GcSweep


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None
        self.payload = bytearray(64 * 1024)  # what a batch held across retries weighs


def test_a_cycle_in_the_oldest_generation_is_freed_by_the_sweep_alone() -> None:
    freed = threading.Event()
    stop = threading.Event()
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection: only the sweep can free the cycle
    try:
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        weakref.finalize(a, freed.set)
        gc.collect(1)  # survives the young collections: now in the oldest generation
        gc.collect(1)
        del a, b
        gc.collect(1)  # a young collection cannot free it
        assert not freed.is_set()
        sweep = GcSweep(stop, every=0.05).start()
        assert freed.wait(30), "the sweep did not collect the cycle"
        assert sweep.swept.wait(30) and sweep.runs >= 1 and sweep.freed >= 2
    finally:
        stop.set()
        if was_enabled:
            gc.enable()


def test_the_sweep_stops_with_the_agent() -> None:
    stop = threading.Event()
    sweep = GcSweep(stop, every=0.01).start()
    assert sweep.swept.wait(30)
    stop.set()
    sweep.join(30)
    assert not sweep.running  # ended: no sweep after the stop (no wait needed to see it)
