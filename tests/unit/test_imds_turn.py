"""The turn file one-shot commands share (`imds-turn.lock` in the state dir) is read back from disk:
whatever it holds — garbage, NaN, infinities, a far-future time, a huge file — the turn is taken
within one budget window and the file is left holding a sane time."""
from __future__ import annotations

import math
import time

import pytest

from forwarder.agent.cli import IMDS_TURN_LOCK, _imds_turn
from forwarder.imds.client import BUDGET_WINDOW
from forwarder.imds.evidence import read_boot_time


@pytest.mark.parametrize("content", [b"", b"garbage", b"nan", b"inf", b"-inf", b"1e308", b"-1e308",
                                     b"\x00" * 64, pytest.param(repr(time.time() + 10 ** 9).encode(), id="far-future"),
                                     b"9" * 1_000_000])
def test_any_turn_file_content_costs_at_most_one_window(tmp_path, content):
    (tmp_path / IMDS_TURN_LOCK).write_bytes(content)
    started = time.monotonic()
    with _imds_turn(tmp_path):
        waited = time.monotonic() - started
    assert waited <= BUDGET_WINDOW + 5.0  # bounded by one window (slack for a loaded machine), never forever
    left = float((tmp_path / IMDS_TURN_LOCK).read_bytes())
    assert math.isfinite(left) and abs(left - time.time()) < 60


@pytest.mark.parametrize("text", [b"btime\n", b"btime x\n", b"btime 1e400\n", b"cpu 1 2 3\n", b"\xff\xfe"])
def test_a_damaged_proc_stat_gives_no_boot_time(tmp_path, text):
    stat = tmp_path / "stat"
    stat.write_bytes(text)
    value = read_boot_time(stat)
    assert value is None or (isinstance(value, float) and math.isfinite(value))
