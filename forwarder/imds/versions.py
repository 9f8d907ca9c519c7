"""``api_version = "auto"``: use 2024-07-09 where IMDS serves it, else 2020-07-01, and look again now and then."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

AUTO = "auto"
NEWEST = "2024-07-09"  # adds SpotRebalanceRecommendation (preview; not served everywhere)
FALLBACK = "2020-07-01"  # the newest generally available version
# Where a version is not available IMDS answers 404 (400 for one it does not know at all); both mean
# "use the older one" here, as openshift/machine-api-provider-azure does (docs/api-versions.md).
UNAVAILABLE_STATUS = frozenset({400, 404})
REPROBE_INTERVAL = 6 * 3600.0  # a VM moved to a region or host that serves 2024-07-09 finds it within 6 h


class VersionChoice:
    """Which api-version the next request uses; thread-safe (one client's poller and its callers)."""

    def __init__(self, requested: str, clock: Callable[[], float], reprobe: float = REPROBE_INTERVAL) -> None:
        self.auto = requested == AUTO
        self.current = NEWEST if self.auto else requested
        self.confirmed = False  # whether IMDS has answered 200/304 at `current`
        self.reprobe = reprobe
        self._clock = clock
        self._next_probe: float | None = None  # when to try NEWEST again, once fallen back
        self._announced: str | None = None  # the version last logged as in use (logged again only on a change)
        self._lock = threading.Lock()

    def for_request(self) -> str:
        """The version for the next GET: NEWEST again when a re-probe is due."""
        with self._lock:
            if self.auto and self.current != NEWEST and self._next_probe is not None \
                    and self._clock() >= self._next_probe:
                self._next_probe = None
                self.current, self.confirmed = NEWEST, False
                log.debug("IMDS api-version auto: trying %s again", NEWEST)
            return self.current

    def unavailable(self, version: str, status: int, *, confirmed_only: bool = False) -> str | None:
        """``version`` was answered ``status``: the version to try instead, or None (not auto, or nothing older)."""
        with self._lock:
            if not self.auto or version != NEWEST or status not in UNAVAILABLE_STATUS:
                return None
            if confirmed_only and self.confirmed:
                return None
            first = self._announced != FALLBACK  # a re-probe that finds nothing new is not news
            self.current, self.confirmed = FALLBACK, False
            self._next_probe = self._clock() + self.reprobe
        level = logging.INFO if first else logging.DEBUG
        log.log(level, "IMDS api-version auto: %s answered %d (not available here); using %s, trying %s again in %.0f h",
                NEWEST, status, FALLBACK, NEWEST, self.reprobe / 3600)
        return FALLBACK

    def answered(self, version: str) -> None:
        """IMDS answered a GET at ``version``: say once which version auto uses."""
        with self._lock:
            if self.confirmed or version != self.current:
                return
            self.confirmed = True
            announce = self.auto and version != self._announced
            self._announced = version
        if announce:
            log.info("IMDS api-version auto: using %s", version)


__all__ = ["AUTO", "FALLBACK", "NEWEST", "REPROBE_INTERVAL", "UNAVAILABLE_STATUS", "VersionChoice"]
