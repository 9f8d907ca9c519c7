"""What the standard library of Python 3.10 lacks, from one place (tomllib, datetime.UTC)."""
from __future__ import annotations

import sys
from datetime import timezone

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, published before it joined the standard library in 3.11
    import tomli as tomllib

# datetime.UTC is 3.11+; it is this very object.
UTC = timezone.utc

__all__ = ["UTC", "tomllib"]
