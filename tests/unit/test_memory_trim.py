"""The agent hands freed heap memory back to the OS now and then (glibc's malloc_trim), and stops with it."""
from __future__ import annotations

import platform
import sys
import threading

import pytest

from forwarder.common.memory import MemoryTrimmer, malloc_trim
from tests.agent import wait_until


def test_the_trimmer_trims_until_stopped():
    stop, calls = threading.Event(), []
    trimmer = MemoryTrimmer(stop, every=0.01, trim=lambda: calls.append(1) or 1).start()
    wait_until(lambda: trimmer.trims >= 3, 10, "three trims")
    stop.set()
    trimmer._thread.join(5)
    assert not trimmer._thread.is_alive() and len(calls) == trimmer.trims >= 3


def test_a_failing_trim_ends_the_thread_not_the_agent():
    def broken() -> int:
        raise OSError("no")

    trimmer = MemoryTrimmer(threading.Event(), every=0.01, trim=broken).start()
    trimmer._thread.join(5)
    assert not trimmer._thread.is_alive() and trimmer.trims == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_has_malloc_trim():
    trim = malloc_trim()
    assert trim is not None and trim() in (0, 1)
