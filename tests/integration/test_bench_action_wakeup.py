"""`python -m benchmarks --smoke --only action_wakeup` runs both worker waits and writes their figures (not judged here)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]


def test_action_wakeup_benchmark_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--smoke", "--only", "action_wakeup", "--out", str(out),
                           "--no-plots"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr  # 1 = a goal missed, which is not this test's business
    bench = orjson.loads(out.read_bytes())["results"]["action_wakeup"]
    assert "error" not in bench, bench.get("error")
    cases = bench["figures"]["workers_8"]  # the case the suite summary names (action_wakeup_ms)
    assert set(cases) == {"as_is", "descheduled"}
    for variants in cases.values():
        assert set(variants) == {"before", "after"}
        for figures in variants.values():
            assert figures["rounds"] == 5 and figures["busy_workers"] == 7
            assert 0 <= figures["p50_ms"] <= figures["max_ms"] and figures["missed_wakeups"] <= figures["claimed"]
