from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
SEEDS = ROOT.parent / "shared" / "seeds"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
