"""One remote-approver instance as a process, for the scale-out benchmark and tests: decides every record
of a feed (a JSONL file) with the real pipeline.RemoteApprover, its settings from the environment as the
Function's app settings (STATE_BACKEND=table: the shared Azure Storage table), and appends one outcome per
record to an output JSONL file (flushed, so a kill loses nothing already decided).

    PYTHONPATH=<checkout>:<checkout>/deploy/consumers/remote-approver python benchmarks/approver_worker.py FEED OUT
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1] / "deploy" / "consumers" / "remote-approver"


def main(feed: Path, out: Path) -> int:
    import pipeline  # the Function app's module: its folder (APP_DIR) is on PYTHONPATH

    approver = pipeline.RemoteApprover(pipeline.Settings.from_env(os.environ))
    records = [json.loads(line) for line in feed.read_text().splitlines() if line.strip()]
    started = time.monotonic()
    with out.open("a", encoding="utf-8") as sink:
        for record in records:
            outcome = approver.handle(record)
            sink.write(json.dumps({k: outcome.get(k) for k in ("id", "EventId", "decision", "reason", "target")}) + "\n")
            sink.flush()
    approver.close()
    print(json.dumps({"records": len(records), "seconds": time.monotonic() - started}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
