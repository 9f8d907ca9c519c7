"""`python -m benchmarks --smoke --only hold` runs a real agent with [protect] and writes the hold's figures."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]


def test_hold_benchmark_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--smoke", "--only", "hold", "--out", str(out),
                           "--no-plots"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr  # 1 = a goal missed, which is not this test's business
    doc = orjson.loads(out.read_bytes())
    hold = doc["results"]["hold"]
    assert "error" not in hold, hold.get("error")
    figures = hold["figures"]
    assert figures["enter_start_ms"]["samples"] == 2 and figures["other_hooks_running"] == 5
    assert 0 < figures["enter_start_ms"]["p50"] <= figures["enter_start_ms"]["max"]
    assert set(doc["summary"]["hold"]) >= {"enter_start_p99_ms", "poll_interval_ms"}
    assert "hold.enter_start_p99_ms" in proc.stdout
