"""This VM's hold ([protect]) of a real `sefwd run` against the in-process IMDS emulator: how soon the
drain starts.

An event naming this VM appears in the emulator (t0, just before the call) → the hold's ``enter``
command starts (t1, the first thing it does is write the time). Meanwhile ``others`` per-change hooks
(``sleep``, for other VMs' events, ``affects_this_vm = false``) occupy the action workers: the hold has
its own worker, so they must not delay it. Events come at random moments (a uniform poll phase);
after each, the event is canceled and the hold's ``leave`` awaited before the next. Goal: p99 of
t1 − t0 <= one poll interval + 100 ms.
"""
from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.agents import spawn_agent, stop_agents
from benchmarks.common import Sizes, goal, result, run_standalone, scratch_dir
from forwarder.emulator import Emulator

GOAL_SLACK_MS = 100.0


@dataclass(frozen=True)
class _Plan:
    samples: int
    others: int  # per-change hooks running the whole time
    interval: float = 1.0  # the agent's default poll interval, seconds


PLANS = {"full": _Plan(40, 50), "quick": _Plan(12, 50), "smoke": _Plan(2, 5, 0.5)}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def _wait(predicate: Any, timeout: float, what: str, step: float = 0.002) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise RuntimeError(f"timed out waiting for {what}")


def run(sizes: Sizes) -> dict[str, Any]:
    plan = PLANS[sizes.name]
    rng = random.Random(28)
    load_before = os.getloadavg()[0]
    with scratch_dir("hold-") as tmp, Emulator(vms=["web-0", "web-1"], rate_limit=None) as emu:
        entered, left, busy = tmp / "entered", tmp / "left", tmp / "busy"
        body = (
            f'[protect]\nenter = "date +%s.%N >> {entered}"\nleave = "echo left >> {left}"\nsettle = "0s"\n'
            f"[approval]\nworkers = {plan.others}\nhook_timeout = \"1h\"\n"  # all busy: this VM's own events wait too
            f'[approval.hooks]\nscheduled = {{ command = "echo x >> {busy}; exec sleep 3600", affects_this_vm = false }}\n'
            '[[sinks]]\ntype = "file"\npath = "/dev/null"\n')
        proc = spawn_agent(emu, tmp / "agent", "web-0", body, poll_interval_ms=int(plan.interval * 1000))
        try:
            for _ in range(plan.others):  # other VMs' events, each holding a worker with its sleeping hook
                emu.schedule(type="Reboot", resources=["web-1"], start_after=7200)
            _wait(lambda: len(_lines(busy)) >= plan.others, 120, f"{plan.others} other hooks running")
            delays = []
            for n in range(plan.samples):
                time.sleep(rng.uniform(0, plan.interval))  # a uniform poll phase
                t0 = time.time()
                event_id = emu.schedule(type="Reboot", resources=["web-0"], start_after=3600)
                started = _wait(lambda: _lines(entered)[n] if len(_lines(entered)) > n else None, 60, "enter")
                delays.append((float(started) - t0) * 1000)
                emu.cancel(event_id)
                _wait(lambda: len(_lines(left)) > n, 60, "leave", step=0.01)
            others_running = len(_lines(busy))
        finally:
            stop_agents([proc])
    interval_ms = plan.interval * 1000
    limit = interval_ms + GOAL_SLACK_MS
    figures: dict[str, Any] = {
        "enter_start_ms": {"p50": round(statistics.median(delays), 1), "p99": round(_pct(delays, 0.99), 1),
                           "max": round(max(delays), 1), "samples": len(delays), "poll_interval_ms": interval_ms},
        "other_hooks_running": others_running,
        "load_avg_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
    }
    goals = [goal(f"enter starts p99 <= poll interval + {GOAL_SLACK_MS:g} ms ({limit:g} ms) with {plan.others} "
                  "other hooks running", figures["enter_start_ms"]["p99"] <= limit)]
    return result(figures, goals)


def main(argv: list[str] | None = None) -> int:
    return run_standalone("hold", "hold.json", run, prog="python -m benchmarks.hold",
                          description=__doc__.splitlines()[0], quick_help="fewer samples",
                          show=lambda figures: [f"{k:<20} {v}" for k, v in figures.items()], argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
