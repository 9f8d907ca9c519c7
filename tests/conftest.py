from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
SEEDS = ROOT.parent / "shared" / "seeds"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Hypothesis profiles, chosen by SEFWD_HYPOTHESIS: "ci" (the default, what the README's test command
# and CI run) gives every property the example count its test asks for; "dev" (the inner loop) a tenth.
# A test with its own count writes `@settings(max_examples=examples(2000))`.
HYPOTHESIS_PROFILES = {"ci": 1.0, "dev": 0.1}
HYPOTHESIS_PROFILE = os.environ.get("SEFWD_HYPOTHESIS", "ci")
if HYPOTHESIS_PROFILE not in HYPOTHESIS_PROFILES:
    raise RuntimeError(f"SEFWD_HYPOTHESIS must be one of {', '.join(HYPOTHESIS_PROFILES)}, got {HYPOTHESIS_PROFILE!r}")
settings.register_profile("ci", print_blob=True)
settings.register_profile("dev", max_examples=10)
settings.load_profile(HYPOTHESIS_PROFILE)


def examples(count: int) -> int:
    """``count`` Hypothesis examples in the "ci" profile, a tenth (at least 10) in "dev"."""
    return max(10, round(count * HYPOTHESIS_PROFILES[HYPOTHESIS_PROFILE]))
