"""Shared pieces: sizes per mode, realistic records, machine info, result shaping."""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from forwarder.sinkapi import Record

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"  # committed: written only by an explicit --record
SCRATCH = RESULTS / "tmp"  # ignored by git: every other run's results, plots and scratch files


@dataclass(frozen=True)
class Sizes:
    """How much work each benchmark does; one instance per mode."""

    name: str
    poll_interval: float  # seconds; the agent's configured minimum is 500 ms
    poll_warmup: float
    poll_window: float
    journal_records: int  # batched appends and drains
    journal_single: int  # single-record appends (one fsync each)
    pq_records: int  # persist-queue puts (one transaction each)
    backlog_records: int
    backlog_single: int  # records for the batch_size 1 run (0: skipped)


MODES = {
    "full": Sizes("full", 0.5, 10.0, 90.0, 100_000, 2_000, 5_000, 100_000, 100_000),
    "quick": Sizes("quick", 0.5, 5.0, 20.0, 20_000, 500, 1_000, 100_000, 5_000),
    "smoke": Sizes("smoke", 0.5, 1.0, 2.0, 500, 20, 50, 500, 50),
}


def sample_event(n: int) -> dict[str, Any]:
    """A `scheduledevent.scheduled` CloudEvent shaped like the agent's own (from `sefwd demo --json`)."""
    rid = "/subscriptions/8d10da13-8125-4ba9-a717-bf7490507b3d/resourceGroups/myResourceGroup/providers/Microsoft.Compute/virtualMachines/web-vm-0"
    event_id = str(uuid.UUID(int=0xD3E0F5A7_0001_4C5D_9E8F_000000000000 + n)).upper()
    return {
        "specversion": "1.0",
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"bench/{n}")),
        "source": rid,
        "type": "scheduledevent.scheduled",
        "subject": event_id,
        "time": "2026-11-22T07:19:18.864Z",
        "datacontenttype": "application/json",
        "sequence": f"{n + 2:020d}",
        "data": {
            "EventId": event_id, "EventType": "Freeze", "ResourceType": "VirtualMachine",
            "Resources": ["web-vm-0", "web-vm-1"], "EventStatus": "Scheduled",
            "NotBefore": "2026-11-22T07:34:18.000Z", "NotBeforeRaw": "Sun, 22 Nov 2026 07:34:18 GMT",
            "Description": "Virtual machine is being paused because of a memory-preserving Live Migration operation.",
            "EventSource": "Platform", "DurationInSeconds": 5, "Change": "scheduled", "PreviousStatus": None,
            "ChangedFields": [], "RemovalReason": None, "Initial": False, "DocumentIncarnation": n + 2,
            "AffectsThisVm": True, "ApiVersion": "2020-07-01",
            "Vm": {
                "VmId": "265801e3-a918-5509-ad1a-0e6728a3b28b", "Name": "web-vm-0", "ComputerName": "web-vm-0",
                "ResourceId": rid, "SubscriptionId": "8d10da13-8125-4ba9-a717-bf7490507b3d",
                "ResourceGroupName": "myResourceGroup", "Location": "norwayeast", "Zone": "", "VmScaleSetName": "",
            },
            "Extra": {},
        },
        "eventkey": f"{event_id}:scheduled",
    }


def sample_records(count: int) -> list[Record]:
    return [Record.from_dict(sample_event(i)) for i in range(count)]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A temporary directory on the same disk as the results (so fsync hits that disk)."""
    base = SCRATCH
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=prefix, dir=base) as d:
        yield Path(d)


def results_file(parser: argparse.ArgumentParser, name: str, *, record: bool, out: Path | None, smoke: bool,
                 partial: bool = False) -> Path:
    """Where a run writes its results document (plots go beside it).

    By default into the ignored ``results/tmp/``; only ``--record`` rewrites the committed
    ``results/NAME``, and only for a complete, meaningful run (not ``--smoke``, not ``--only``).
    ``--out`` may point anywhere except the committed folder.
    """
    if record:
        if out is not None:
            parser.error("--record writes the committed results; it does not take --out")
        if smoke:
            parser.error("--record with --smoke would commit figures that mean nothing")
        if partial:
            parser.error("--record needs every benchmark (without --only): it replaces the committed results")
        return RESULTS / name
    if out is None:
        return SCRATCH / name
    if out.resolve().parent == RESULTS.resolve():
        parser.error(f"{out} is in the committed results folder: use --record to rewrite it")
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process's live threads have used, in seconds.

    On Linux from /proc/PID/task/*/schedstat, which the scheduler keeps in nanoseconds; the
    utime/stime that psutil reads are counted in 10 ms ticks, too coarse for a poll costing
    half a millisecond. Threads that already exited are not counted: measure long-lived ones.
    """
    total = 0
    try:
        with os.scandir(f"/proc/{pid}/task") as tasks:
            for task in tasks:
                try:
                    with open(f"{task.path}/schedstat", "rb") as f:
                        total += int(f.read().split()[0])
                except (OSError, ValueError, IndexError):
                    pass  # a thread that ended between the listing and the read
        return total / 1e9
    except FileNotFoundError:
        import psutil  # type: ignore[import-untyped]  # not Linux (or no procfs): tick-based, but there

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system


def goal(text: str, ok: bool) -> dict[str, Any]:
    return {"goal": text, "pass": bool(ok)}


def result(figures: dict[str, Any], goals: list[dict[str, Any]]) -> dict[str, Any]:
    return {"figures": figures, "goals": goals, "pass": all(g["pass"] for g in goals)}


def run_standalone(name: str, results_name: str, run: Callable[[Sizes], dict[str, Any]], *, prog: str,
                   description: str, quick_help: str, show: Callable[[dict[str, Any]], list[str]],
                   argv: list[str] | None = None) -> int:
    """One benchmark on its own (``python -m benchmarks.NAME``): its own results file, ``--record`` to commit it."""
    import argparse
    import logging
    import sys
    import time

    import orjson

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, only checks that everything runs")
    parser.add_argument("--out", type=Path, help=f"results file (default benchmarks/results/tmp/{results_name}, ignored by git)")
    parser.add_argument("--record", action="store_true", help=f"rewrite the committed benchmarks/results/{results_name}")
    args = parser.parse_args(argv)
    args.out = results_file(parser, results_name, record=args.record, out=args.out, smoke=args.smoke)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    sizes = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    started = time.monotonic()
    res = run(sizes)
    res["seconds"] = round(time.monotonic() - started, 1)
    doc = {"machine": machine_info(), "mode": sizes.name, "results": {name: res}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    for line in show(res["figures"]):
        print(line)
    for g in res["goals"]:
        print(f"[{'pass' if g['pass'] else 'FAIL'}] {g['goal']}")
    print(f"results written to {args.out}")
    return 0 if res["pass"] else 1
