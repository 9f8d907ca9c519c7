"""CPU per unchanged poll and RSS of `sefwd run`, next to the seed's sample loop, in the same run."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.agents import spawn_agent
from benchmarks.common import ROOT, Sizes, cpu_seconds, goal, result, scratch_dir
from forwarder.emulator import Emulator

RSS_GOAL_MIB = 40.0
CPU_GOAL_MS = 0.5
LOGS = {"sefwd": lambda work: work / "sefwd" / "agent.log", "seed": lambda work: work / "seed.log"}


def _agent(emu: Emulator, work: Path, interval: float) -> subprocess.Popen[bytes]:
    return spawn_agent(emu, work / "sefwd", "sefwd", '[[sinks]]\ntype = "stdout"\nname = "stdout"\n',
                       poll_interval_ms=int(interval * 1000))


def _seed(emu: Emulator, work: Path, interval: float) -> subprocess.Popen[bytes]:
    url = emu.vm_url("seed") + "/metadata/scheduledevents"
    return _spawn([sys.executable, str(ROOT / "benchmarks" / "seed_loop.py"), url, str(interval)], work / "seed.log")


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(log.parent)}
    with open(log, "ab") as err:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=str(ROOT))


def _gets(emu: Emulator, vm: str) -> int:
    return int(emu.stats()["requests"].get(vm, {}).get("by_endpoint", {}).get("scheduledevents", 0))


def run(sizes: Sizes) -> dict[str, Any]:
    names = ("sefwd", "seed")
    with scratch_dir("poll-") as work, Emulator(vms=list(names), rate_limit=None) as emu:
        # A Platform Reboot: the sample only logs it, so nobody's approval changes the document.
        emu.schedule(type="Reboot", source="Platform", duration=-1, resources=list(names), start_after=3600)
        procs = {"sefwd": _agent(emu, work, sizes.poll_interval), "seed": _seed(emu, work, sizes.poll_interval)}
        try:
            handles = {n: psutil.Process(p.pid) for n, p in procs.items()}
            deadline = time.monotonic() + 60
            while min(_gets(emu, n) for n in names) < 3:  # both are up and polling
                for n, p in procs.items():
                    if p.poll() is not None:
                        raise RuntimeError(f"{n} exited with {p.returncode}: see {LOGS[n](work)}")
                if time.monotonic() > deadline:
                    raise RuntimeError("the pollers did not start within 60 s")
                time.sleep(0.1)
            time.sleep(sizes.poll_warmup)
            start = {n: (cpu_seconds(procs[n].pid), _gets(emu, n)) for n in names}
            time.sleep(sizes.poll_window)
            end = {n: (cpu_seconds(procs[n].pid), _gets(emu, n)) for n in names}
            rss = {n: handles[n].memory_info().rss / 2**20 for n in names}
        finally:
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
    polls = {n: end[n][1] - start[n][1] for n in names}
    per_poll = {n: (end[n][0] - start[n][0]) * 1000 / max(1, polls[n]) for n in names}
    figures = {
        "poll_interval_s": sizes.poll_interval,
        "window_s": sizes.poll_window,
        "polls": {"sefwd": polls["sefwd"], "seed_sample": polls["seed"]},
        "cpu_ms_per_poll": {"sefwd": round(per_poll["sefwd"], 3), "seed_sample": round(per_poll["seed"], 3)},
        "ratio_sefwd_to_seed": round(per_poll["sefwd"] / per_poll["seed"], 3) if per_poll["seed"] else None,
        # At the default 1 s interval, CPU per poll in ms is tenths of a percent of one core.
        "cpu_percent_of_one_core_at_1s": {"sefwd": round(per_poll["sefwd"] / 10, 3), "seed_sample": round(per_poll["seed"] / 10, 3)},
        "rss_mib": {"sefwd": round(rss["sefwd"], 1), "seed_sample": round(rss["seed"], 1)},
    }
    return result(figures, [
        goal("sefwd CPU per poll <= seed sample's", per_poll["sefwd"] <= per_poll["seed"]),
        goal(f"sefwd CPU per poll <= {CPU_GOAL_MS:g} ms", per_poll["sefwd"] <= CPU_GOAL_MS),
        goal(f"sefwd RSS <= {RSS_GOAL_MIB:g} MiB", rss["sefwd"] <= RSS_GOAL_MIB),
    ])
