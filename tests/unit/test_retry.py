"""Backoff (full jitter, caps, Retry-After) and Retry-After / retryable-status parsing."""
from __future__ import annotations

import dataclasses
import math
import random
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import pytest

from forwarder.common.retry import RETRYABLE_STATUS, Backoff, is_retryable_status, parse_retry_after

NOW = datetime(2026, 11, 3, 12, 0, 0, tzinfo=timezone.utc)


# -- Backoff ---------------------------------------------------------------------------------
@pytest.mark.parametrize("attempt, ceiling", [(0, 1.0), (1, 2.0), (2, 4.0), (5, 32.0), (6, 60.0), (40, 60.0)])
def test_full_jitter_stays_within_zero_and_capped_ceiling(attempt: int, ceiling: float) -> None:
    backoff = Backoff()
    rng = random.Random(1234)
    draws = [backoff.delay(attempt, rng) for _ in range(3000)]
    assert backoff.ceiling(attempt) == ceiling
    assert all(0.0 <= d <= ceiling for d in draws)
    # Full jitter spreads over the whole range, not just the top (equal jitter) or a point.
    assert min(draws) < 0.05 * ceiling
    assert max(draws) > 0.95 * ceiling
    assert 0.4 * ceiling < sum(draws) / len(draws) < 0.6 * ceiling


def test_custom_multiplier_initial_and_maximum() -> None:
    backoff = Backoff(initial=0.5, maximum=10, multiplier=3)
    assert [backoff.ceiling(a) for a in range(5)] == [0.5, 1.5, 4.5, 10, 10]
    rng = random.Random(7)
    assert all(backoff.delay(4, rng) <= 10 for _ in range(500))


def test_same_seed_same_delays() -> None:
    backoff = Backoff(initial=0.1, maximum=5)
    first = [backoff.delay(a, random.Random(99)) for a in range(10)]
    again = [backoff.delay(a, random.Random(99)) for a in range(10)]
    assert first == again
    assert len(set(first)) > 1


def test_huge_attempt_does_not_overflow_and_negative_attempt_counts_as_first() -> None:
    backoff = Backoff(initial=1, maximum=60)
    assert backoff.ceiling(100_000) == 60
    assert 0 <= backoff.delay(100_000, random.Random(1)) <= 60
    assert backoff.ceiling(-3) == 1.0


def test_default_rng_is_used_when_none_given() -> None:
    backoff = Backoff(initial=0.2, maximum=0.2)
    assert all(0 <= backoff.delay(3) <= 0.2 for _ in range(200))


def test_retry_after_wins_over_jitter_even_beyond_maximum() -> None:
    backoff = Backoff(initial=1, maximum=10, retry_after_cap=300)
    rng = random.Random(5)
    assert backoff.delay(0, rng, retry_after=42.0) == 42.0  # above `maximum`: the server knows best
    assert backoff.delay(9, rng, retry_after=2.5) == 2.5  # below the jitter ceiling: honoured too


def test_retry_after_never_shortens_the_wait_below_initial() -> None:
    backoff = Backoff(initial=1, maximum=10, retry_after_cap=300)
    assert backoff.delay(9, random.Random(5), retry_after=0.25) == 1  # (issue 20: no hot loop)
    assert backoff.delay(0, retry_after=0.0) == 1


def test_retry_after_is_capped_and_never_negative() -> None:
    backoff = Backoff(retry_after_cap=30)
    assert backoff.delay(0, retry_after=3600) == 30
    assert backoff.delay(0, retry_after=-5) == backoff.initial
    assert Backoff().delay(0, retry_after=10_000) == 300  # default cap


def test_non_finite_retry_after_falls_back_to_jitter() -> None:
    backoff = Backoff(initial=1, maximum=1)
    assert 0 <= backoff.delay(0, random.Random(3), retry_after=math.inf) <= 1
    assert 0 <= backoff.delay(0, random.Random(3), retry_after=math.nan) <= 1


def test_backoff_is_immutable_and_validated() -> None:
    backoff = Backoff()
    with pytest.raises(dataclasses.FrozenInstanceError):
        backoff.initial = 5  # type: ignore[misc]
    with pytest.raises(ValueError):
        Backoff(initial=-1)
    with pytest.raises(ValueError):
        Backoff(multiplier=0.5)
    assert Backoff(initial=0.5, maximum=10) == Backoff(initial=0.5, maximum=10.0)


# -- parse_retry_after -----------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [("120", 120.0), (" 3 ", 3.0), ("0", 0.0), ("1.5", 1.5), ("-5", 0.0)])
def test_parse_retry_after_seconds(value: str, expected: float) -> None:
    assert parse_retry_after(value, NOW) == expected


def test_parse_retry_after_http_date() -> None:
    later = format_datetime(NOW + timedelta(seconds=90), usegmt=True)
    assert later.endswith("GMT")
    assert parse_retry_after(later, NOW) == 90.0
    assert parse_retry_after("Tue, 03 Nov 2026 12:00:30 GMT", NOW) == 30.0


def test_parse_retry_after_date_in_the_past_is_zero() -> None:
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", NOW) == 0.0


def test_parse_retry_after_defaults_now_to_the_current_time() -> None:
    soon = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=600), usegmt=True)
    assert 590 <= parse_retry_after(soon) <= 600  # type: ignore[operator]


@pytest.mark.parametrize("value", [None, "", "   ", "soon", "Retry later", "12abc", "inf", "nan", "Mon, 99 Foo 2026"])
def test_parse_retry_after_garbage_is_none(value: str | None) -> None:
    assert parse_retry_after(value, NOW) is None


# -- retryable statuses ----------------------------------------------------------------------
@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504, 599])
def test_retryable_statuses(status: int) -> None:
    assert is_retryable_status(status)
    assert status in RETRYABLE_STATUS


@pytest.mark.parametrize("status", [200, 204, 304, 400, 401, 403, 404, 405, 409, 410, 413, 422, 600])
def test_non_retryable_statuses(status: int) -> None:
    assert not is_retryable_status(status)


def test_retryable_status_set_is_frozen() -> None:
    assert isinstance(RETRYABLE_STATUS, frozenset)
    assert RETRYABLE_STATUS == frozenset({408, 429, *range(500, 600)})


def test_410_is_retried_only_by_the_imds_client() -> None:
    """IMDS says "410: retry for up to 70 s"; to every other server 410 Gone is final (issue 14)."""
    from forwarder.imds.client import IMDS_RETRYABLE_STATUS

    assert 410 in IMDS_RETRYABLE_STATUS and 410 not in RETRYABLE_STATUS
    assert IMDS_RETRYABLE_STATUS - RETRYABLE_STATUS == {410}
