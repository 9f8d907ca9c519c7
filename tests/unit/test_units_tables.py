"""Parsing many keys at once: every problem collected, labelled by where the value came from."""
from __future__ import annotations

from forwarder.common.values import boolean, integer, parse_labelled, parse_table

PARSERS = {"count": integer(0, 10), "on": boolean}


def test_parse_table_keeps_good_values_and_names_every_bad_one() -> None:
    problems: list[str] = []
    values = parse_table(PARSERS, {"count": 11, "on": "maybe", "other": 1}, "x.y", problems)
    assert values == {}
    assert problems == ["x.y.count: must be an integer from 0 to 10, got 11", "x.y.on: expected true or false, got 'maybe'"]
    problems.clear()
    assert parse_table(PARSERS, {"on": "yes"}, "x.y", problems) == {"on": True} and problems == []


def test_parse_labelled_uses_each_values_own_label() -> None:
    problems: list[str] = []
    values = parse_labelled(PARSERS, {"on": ("off", "environment X_ON"), "count": (-1, "x.count")}, problems)
    assert values == {"on": False}
    assert problems == ["x.count: must be an integer from 0 to 10, got -1"]
