"""The IMDS EventTypes the agent knows by name, and the api-version that introduced each."""
from __future__ import annotations

# Every type a supported api-version can show (docs/api-versions.md). Anything else IMDS sends is
# kept and forwarded unchanged; only bounded metric labels fold it into "other".
EVENT_TYPES: tuple[str, ...] = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate", "SpotRebalanceRecommendation")
# The api-version from which IMDS shows each type; older versions never do.
TYPE_SINCE: dict[str, str] = {"Preempt": "2017-11-01", "Terminate": "2019-01-01",
                              "SpotRebalanceRecommendation": "2024-07-09"}
# Advisory only: acknowledging it has no effect (Microsoft, "Spot eviction risk notifications").
ADVISORY_TYPES: frozenset[str] = frozenset({"SpotRebalanceRecommendation"})

__all__ = ["ADVISORY_TYPES", "EVENT_TYPES", "TYPE_SINCE"]
