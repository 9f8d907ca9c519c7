"""`python -m benchmarks --smoke --only journal` runs and writes every figure (values are not judged here)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("persistqueue", reason="the bench extra is not installed: pip install -e '.[bench]'")


def test_journal_benchmark_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--smoke", "--only", "journal", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode in (0, 1), proc.stderr  # 1 = a goal missed, which is not this test's business
    doc = orjson.loads(out.read_bytes())
    assert set(doc["machine"]) >= {"cpu_model", "nproc", "python", "date"}
    assert doc["mode"] == "quick"
    assert list(doc["results"]) == ["journal"]
    journal = doc["results"]["journal"]
    assert set(journal["figures"]["sefwd_rec_per_s"]) == {"append_batched", "append_single", "drain"}
    assert set(journal["figures"]["persist_queue_rec_per_s"]) == {"put", "drain"}
    assert {"append_vs_persist_queue", "drain_vs_persist_queue", "fsync_ms_median"} <= set(journal["figures"])
    assert journal["goals"] and all(isinstance(g["pass"], bool) for g in journal["goals"])
    assert journal["pass"] == all(g["pass"] for g in journal["goals"])
    assert "journal" in proc.stdout
