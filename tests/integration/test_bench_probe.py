"""`python -m benchmarks --smoke --only probe` runs a real agent and writes the probe's figures (not judged here)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]


def test_probe_benchmark_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--smoke", "--only", "probe", "--out", str(out),
                           "--no-plots"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr  # 1 = a goal missed, which is not this test's business
    doc = orjson.loads(out.read_bytes())
    probe = doc["results"]["probe"]
    assert "error" not in probe, probe.get("error")
    figures = probe["figures"]
    assert set(figures) == {"answer_ms", "route_us", "flip_ms", "load_avg_1m"}
    assert figures["answer_ms"]["requests"] == 50 and figures["flip_ms"]["samples"] == 2
    assert 0 < figures["flip_ms"]["p50"] <= figures["flip_ms"]["max"]
    assert set(doc["summary"]["probe"]) >= {"answer_p99_ms", "flip_p99_ms", "poll_interval_ms"}
