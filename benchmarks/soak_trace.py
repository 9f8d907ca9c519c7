"""`python benchmarks/soak_trace.py DIR ARGS...`: the agent's CLI under tracemalloc, a snapshot in DIR every minute.

For finding what grows in a soak (``SEFWD_SOAK_TRACEMALLOC=DIR python -m benchmarks --only soak``); compare two
snapshots with ``tracemalloc.Snapshot.load(later).compare_to(tracemalloc.Snapshot.load(earlier), "traceback")``.
"""
from __future__ import annotations

import sys
import threading
import time
import tracemalloc
from pathlib import Path

FRAMES = 6
EVERY_S = 60.0


def _snapshots(out: Path) -> None:
    n = 0
    while True:
        time.sleep(EVERY_S)
        n += 1
        tracemalloc.take_snapshot().dump(str(out / f"snapshot-{n:04d}.pickle"))


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(FRAMES)
    threading.Thread(target=_snapshots, args=(out,), name="soak-tracemalloc", daemon=True).start()
    from forwarder.agent.cli import main as cli

    return int(cli(sys.argv[2:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
