"""The one retry policy: capped exponential backoff with full jitter, Retry-After, retryable statuses."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime

__all__ = ["Backoff", "RETRYABLE_STATUS", "is_retryable_status", "parse_retry_after"]

# 408 timeout, 429 throttled, every 5xx. (IMDS also retries 410 for up to 70 s: that rule is
# IMDS-only and lives in forwarder.imds.client; to any other server 410 Gone is final.)
RETRYABLE_STATUS: frozenset[int] = frozenset({408, 429, *range(500, 600)})


def is_retryable_status(status: int) -> bool:
    """True when an HTTP status says "try again later" rather than "this request is wrong"."""
    return status in RETRYABLE_STATUS


@dataclass(frozen=True)
class Backoff:
    """Immutable retry pacing shared by the IMDS client, the poller and the sink dispatcher."""

    initial: float = 1.0
    maximum: float = 60.0
    multiplier: float = 2.0
    retry_after_cap: float = 300.0

    def __post_init__(self) -> None:
        if self.initial < 0 or self.maximum < 0 or self.retry_after_cap < 0:
            raise ValueError("backoff durations must not be negative")
        if self.multiplier < 1:
            raise ValueError("backoff multiplier must be at least 1")

    def ceiling(self, attempt: int) -> float:
        """The upper bound of the jittered delay for ``attempt`` (0-based): min(maximum, initial*multiplier**attempt)."""
        attempt = max(0, int(attempt))
        try:
            grown = self.initial * self.multiplier ** attempt
        except OverflowError:  # attempt in the thousands: long past the cap anyway
            return self.maximum
        return min(self.maximum, grown)

    def delay(self, attempt: int, rng: random.Random | None = None, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based).

        Without ``retry_after``: full jitter, uniform(0, ceiling(attempt)), so a fleet of agents
        that failed together does not retry together. With ``retry_after`` the server's word can
        lengthen the wait (even beyond our own ceiling), never shorten it below ``initial``: a
        ``Retry-After: 0`` or a date in the past must not make a hot loop. It is clamped to
        [initial, retry_after_cap] so a bogus header cannot park a sender for hours either; no
        jitter is added because the server has already chosen when it wants to hear from us.
        """
        if retry_after is not None and math.isfinite(retry_after):
            return min(max(self.initial, float(retry_after)), max(self.initial, self.retry_after_cap))
        return (rng or random).uniform(0.0, self.ceiling(attempt))


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Retry-After as seconds from ``now``: delay-seconds or an HTTP-date; past → 0, garbage → None."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:  # very old Pythons return None instead of raising
        return None
    if when.tzinfo is None:  # HTTP-dates are GMT by definition
        when = when.replace(tzinfo=timezone.utc)
    now = now or datetime.now(timezone.utc)
    return max(0.0, (when - now).total_seconds())
