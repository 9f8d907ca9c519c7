"""Detection and processing latency of `sefwd run` agents against the in-process IMDS emulator.

* detection: the emulator's document changes (t0, taken just before the emulator call that bumps
  DocumentIncarnation; the call itself takes tens of microseconds) -> the agent's stdout sink line
  reaches the benchmark through a pipe (monotonic stamp on arrival, in a reader thread).
* processing: the emulator answers that agent the first GET carrying the new DocumentIncarnation
  (t1, stamped in the emulator's per-request count hook, just before the answer leaves) -> the
  loopback webhook receiver is about to answer 2xx to that agent's POST of the record. It covers
  the read of the answer, diff, records, one store commit of document, records and sequence (fsync), the wake of
  the webhook dispatcher and a signed POST.

CLOCK_MONOTONIC is one clock for every process on Linux, so the stamps compare across processes.
Several agents poll at their own phases, each on its own emulator VM (the document is shared), so
each change gives one independent sample per agent. Changes come at random moments, at least one
interval apart and only after every agent delivered the previous one, so the poll phase at which
each change lands is uniform for every agent.
"""
from __future__ import annotations

import random
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from benchmarks.agents import spawn_agent, stop_agents
from benchmarks.common import Sizes, goal, result, scratch_dir
from forwarder.emulator import Emulator
from forwarder.common.signing import generate_secret

from benchmarks.peers.webhook_receiver import ReceivedRequest, WebhookReceiver

PROCESSING_GOAL_MS = 15.0
START_TIMEOUT_S = 60.0
SECRET_ENV = "SEFWD_BENCH_WEBHOOK_SECRET"


def detection_goal_ms(interval_s: float) -> float:
    return 1.05 * interval_s * 1000 + 20.0


@dataclass(frozen=True)
class _Plan:
    agents: int
    changes: int  # samples per metric = agents * changes
    interval: float = 1.0  # the agent's default poll interval, seconds


PLANS = {"full": _Plan(6, 60), "quick": _Plan(6, 20), "smoke": _Plan(3, 4)}


class _Arrivals:
    """Every record seen on an agent's stdout and at the webhook, keyed (vm, type, subject, incarnation)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.stdout: dict[tuple[Any, ...], float] = {}
        self.webhook: dict[tuple[Any, ...], float] = {}
        self.duplicates = {"stdout": 0, "webhook": 0}
        self.unsigned = 0
        self.unparsed = 0

    def add(self, where: str, vm: str, body: bytes, stamp: float) -> None:
        try:
            rec = orjson.loads(body)
            data = rec.get("data") if isinstance(rec.get("data"), dict) else {}
            key = (vm, rec.get("type"), rec.get("subject"), data.get("DocumentIncarnation"))
        except (orjson.JSONDecodeError, AttributeError):
            with self.cond:
                self.unparsed += 1
            return
        with self.cond:
            seen = self.stdout if where == "stdout" else self.webhook
            if key in seen:
                self.duplicates[where] += 1
            else:
                seen[key] = stamp
            self.cond.notify_all()

    def wait(self, keys: list[tuple[Any, ...]], deadline: float, alive: Callable[[], None]) -> bool:
        with self.cond:
            while not all(k in self.stdout and k in self.webhook for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                alive()
                self.cond.wait(min(left, 0.25))
            return True


class _Tap:
    """When the emulator first answered each VM a GET carrying each DocumentIncarnation.

    The handler builds the body with ``platform.document`` and counts the request (``platform.count``)
    just before the answer leaves, on the same thread: the incarnation is stashed per thread in the
    first and read in the second, so it is the one actually in that answer.
    """

    def __init__(self, emu: Emulator) -> None:
        self.answered: dict[tuple[str, int], float] = {}
        self.first_get: dict[str, float] = {}
        self.last_get: dict[str, float] = {}
        self._lock = threading.Condition()
        self._local = threading.local()
        document, count = emu.platform.document, emu.platform.count

        def documenting(version: str) -> dict[str, Any]:
            doc = document(version)
            self._local.incarnation = doc["DocumentIncarnation"]
            return doc

        def counting(vm: str, method: str, endpoint: str, status: int | str) -> None:
            now = time.monotonic()
            incarnation, self._local.incarnation = getattr(self._local, "incarnation", None), None
            count(vm, method, endpoint, status)
            if incarnation is not None and method == "GET" and endpoint == "scheduledevents" and str(status) == "200":
                with self._lock:
                    self.answered.setdefault((vm, incarnation), now)
                    self.first_get.setdefault(vm, now)
                    self.last_get[vm] = now
                    self._lock.notify_all()

        emu.platform.document = documenting  # type: ignore[method-assign]
        emu.platform.count = counting  # type: ignore[method-assign]

    def first(self, vm: str, incarnation: int) -> float | None:
        with self._lock:
            return self.answered.get((vm, incarnation))

    def wait_first_get(self, vm: str, deadline: float, alive: Callable[[], None]) -> float | None:
        with self._lock:
            while vm not in self.first_get:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                alive()
                self._lock.wait(min(left, 0.2))
            return self.first_get[vm]

    def phases(self, interval: float) -> list[float]:
        """Each agent's poll phase (answer time modulo the interval), from its latest poll."""
        with self._lock:
            return [t % interval for t in self.last_get.values()]


class _Agent:
    """One `python -m forwarder run`: own VM and state dir, stdout sink on a pipe, signed webhook sink."""

    def __init__(self, emu: Emulator, work: Path, vm: str, hook_url: str, interval: float, secret: str,
                 arrivals: _Arrivals) -> None:
        self.vm = vm
        self.dir = work / vm
        self.log = self.dir / "agent.log"
        self.proc = spawn_agent(
            emu, self.dir, vm,
            '[[sinks]]\ntype = "stdout"\nname = "stdout"\n'
            f'[[sinks]]\ntype = "webhook"\nname = "webhook"\nurl = "{hook_url}"\nsecret_env = "{SECRET_ENV}"\n',
            {SECRET_ENV: secret}, poll_interval_ms=int(round(interval * 1000)), stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout, arrivals),
                                        name=f"stdout-{vm}", daemon=True)
        self._reader.start()

    def _read(self, pipe: IO[bytes], arrivals: _Arrivals) -> None:
        # BufferedReader.readline returns as soon as a whole line is in: it never waits for a full buffer.
        for line in pipe:
            stamp = time.monotonic()
            arrivals.add("stdout", self.vm, line, stamp)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"agent {self.vm} exited with {self.proc.returncode}: see {self.log}")

    def close_pipe(self) -> None:
        """After the process is gone: let the reader see the end of stdout, then close it."""
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _changes(emu: Emulator, vms: list[str]) -> Callable[[int], tuple[str, str]]:
    """Change k of a repeating cycle over two events: -> (record type expected, EventId)."""
    live: dict[str, str] = {}

    def new_event() -> str:
        # No timer may change the document behind our back: it starts at NotBefore (20 min or more
        # away, the emulator never starts it earlier) and completes an hour after that.
        live["id"] = emu.schedule(type="Reboot", source="Platform", resources=vms, not_before="+20m",
                                  complete_after=3600)
        return live["id"]

    def update(k: int) -> str:
        emu.update(live["id"], not_before=f"+{21 + k % 30}m")
        return live["id"]

    def start(k: int) -> str:
        emu.start_event(live["id"])
        return live["id"]

    def done(fn: Callable[[str], None]) -> str:
        event_id = live.pop("id")
        fn(event_id)
        return event_id

    cycle: list[tuple[str, Callable[[int], str]]] = [
        ("scheduled", lambda k: new_event()),
        ("updated", update),
        ("canceled", lambda k: done(emu.cancel)),
        ("scheduled", lambda k: new_event()),
        ("updated", update),
        ("started", start),
        ("completed", lambda k: done(emu.complete)),
    ]

    def change(k: int) -> tuple[str, str]:
        kind, fn = cycle[k % len(cycle)]
        return "scheduledevent." + kind, fn(k)

    return change


def _cpu_stall_us() -> int | None:
    """Linux PSI: microseconds during which some runnable task waited for a CPU (None without PSI)."""
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some "):
                    return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gaps(phases: list[float], interval: float) -> list[tuple[float, float]]:
    """(gap, start) between neighbouring phases on the circle of one interval."""
    ordered = sorted(phases)
    return [((ordered[(i + 1) % len(ordered)] - p) % interval or interval, p) for i, p in enumerate(ordered)]


def _widest_gap_middle(phases: list[float], interval: float) -> float:
    gap, start = max(_gaps(phases, interval))
    return (start + gap / 2) % interval


def _summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None, "count": 0}
    # "inclusive": linear interpolation between closest ranks, numpy's default percentile.
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {
        "p50": round(cuts[49], 2), "p90": round(cuts[89], 2),
        "p99": round(cuts[98], 2), "max": round(max(values), 2),
        "mean": round(statistics.fmean(values), 2), "count": len(values),
    }


def run(sizes: Sizes) -> dict[str, Any]:
    plan = PLANS[sizes.name]
    interval = plan.interval
    rng = random.Random()
    arrivals = _Arrivals()

    def answer(request: ReceivedRequest) -> int:
        stamp = time.monotonic()  # the receiver answers 200 right after this returns
        if request.header("webhook-signature") is None:
            with arrivals.cond:
                arrivals.unsigned += 1
        arrivals.add("webhook", request.path.rsplit("/", 1)[-1], request.body, stamp)
        return 200

    vms = [f"lat-{i}" for i in range(plan.agents)]
    detection: list[float] = []
    processing: list[float] = []
    poll_wait: list[float] = []
    answer_to_stdout: list[float] = []
    missing = {"stdout": 0, "webhook": 0, "poll_answer": 0}
    kinds: dict[str, int] = {}
    with scratch_dir("latency-") as work, Emulator(vms=vms, rate_limit=None) as emu, \
            WebhookReceiver(answer, store=False) as hook:
        tap = _Tap(emu)
        secret = generate_secret()
        agents: list[_Agent] = []
        try:
            def alive() -> None:
                for a in agents:
                    a.check_alive()

            # One agent at a time, each timed so its polls fall in the middle of the widest gap
            # between the others': on a small machine agents polling at the same moment would
            # wait for each other's CPU, which no agent on its own VM does.
            phases: list[float] = []
            startups: list[float] = []
            for vm in vms:
                if phases:
                    target = _widest_gap_middle(phases, interval)
                    now = time.monotonic()
                    time.sleep((target - statistics.median(startups) - now) % interval)
                spawned = time.monotonic()
                agents.append(_Agent(emu, work, vm, hook.url_for(f"/hook/{vm}"), interval, secret, arrivals))
                first = tap.wait_first_get(vm, spawned + START_TIMEOUT_S, alive)
                if first is None:
                    raise RuntimeError(f"agent {vm} made no Scheduled Events GET within {START_TIMEOUT_S:g} s: see {work}")
                startups.append(first - spawned)
                phases.append(first % interval)

            # Started: each agent's forwarder.started record went through both sinks (the webhook
            # connection is open), so the first change is measured like every later one.
            started = [(vm, "forwarder.started", "forwarder", None) for vm in vms]
            if not arrivals.wait(started, time.monotonic() + START_TIMEOUT_S, alive):
                raise RuntimeError(f"agents did not deliver forwarder.started within {START_TIMEOUT_S:g} s: see {work}")
            time.sleep(interval)
            change = _changes(emu, vms)
            stall_before, window_start = _cpu_stall_us(), time.monotonic()
            t0 = time.monotonic()
            next_at = t0 + rng.uniform(0.0, interval)
            for k in range(plan.changes):
                time.sleep(max(0.0, next_at - time.monotonic()))
                before = emu.platform.incarnation
                t0 = time.monotonic()
                rtype, event_id = change(k)
                incarnation = emu.platform.incarnation
                if incarnation != before + 1:
                    raise RuntimeError(f"change {k} ({rtype}) moved DocumentIncarnation {before} -> {incarnation}")
                kinds[rtype] = kinds.get(rtype, 0) + 1
                keys = [(vm, rtype, event_id, incarnation) for vm in vms]
                arrivals.wait(keys, t0 + 3 * interval + 5.0, alive)
                with arrivals.cond:
                    out = {vm: arrivals.stdout.get(key) for vm, key in zip(vms, keys)}
                    hooked = {vm: arrivals.webhook.get(key) for vm, key in zip(vms, keys)}
                for vm in vms:
                    t1, printed, posted = tap.first(vm, incarnation), out[vm], hooked[vm]
                    missing["stdout"] += printed is None
                    missing["webhook"] += posted is None
                    missing["poll_answer"] += t1 is None
                    if printed is not None:
                        detection.append((printed - t0) * 1000)
                    if t1 is not None and posted is not None:
                        processing.append((posted - t1) * 1000)
                    if t1 is not None and printed is not None:
                        poll_wait.append((t1 - t0) * 1000)
                        answer_to_stdout.append((printed - t1) * 1000)
                # At least an interval (plus a uniform share of one) after t0, and never before every
                # agent delivered this change: either way the next t0 falls at a uniform poll phase.
                next_at = t0 + interval * rng.uniform(1.0, 2.0)
                if time.monotonic() > next_at:
                    next_at = time.monotonic() + interval * rng.uniform(0.0, 1.0)
            alive()
            stall_after, window = _cpu_stall_us(), time.monotonic() - window_start
            phase_gap = min(g for g, _ in _gaps(tap.phases(interval), interval)) if len(vms) > 1 else interval
        finally:
            stop_agents([a.proc for a in agents], timeout=15)
            for a in agents:
                a.close_pipe()
    expected = plan.agents * plan.changes
    det, proc = _summary(detection), _summary(processing)
    det_goal = detection_goal_ms(interval)
    figures = {
        "agents": plan.agents,
        "changes": plan.changes,
        "change_kinds": kinds,
        "agent_poll_phase_gap_ms_min": round(phase_gap * 1000, 1),
        "detection_latency_ms": {**det, "poll_interval_ms": round(interval * 1000)},
        "processing_latency_ms": proc,
        # detection = poll_wait (change to the first answer carrying it) + answer_to_stdout
        "breakdown_ms": {
            "poll_wait": {k: v for k, v in _summary(poll_wait).items() if k in ("p50", "p99", "max")},
            "answer_to_stdout": {k: v for k, v in _summary(answer_to_stdout).items() if k in ("p50", "p99", "max")},
        },
        # Share of the measuring window in which some task waited for a CPU (Linux PSI): the
        # machine's contention, ours included; tails grow with it (other work on a shared box).
        "cpu_pressure_pct": (round((stall_after - stall_before) / 1e4 / window, 1)
                             if stall_before is not None and stall_after is not None else None),
        "missing": missing,
        "duplicates": dict(arrivals.duplicates),
        "unsigned_webhook_posts": arrivals.unsigned,
    }
    res = result(figures, [
        goal(f"detection p99 <= 1.05 x interval + 20 ms ({det_goal:g} ms)",
             det["p99"] is not None and det["p99"] <= det_goal),
        goal(f"processing p99 (poll answer to webhook 2xx, fsync included) <= {PROCESSING_GOAL_MS:g} ms",
             proc["p99"] is not None and proc["p99"] <= PROCESSING_GOAL_MS),
        goal(f"every change reached every agent's stdout and webhook ({expected} each)",
             not any(missing.values()) and len(detection) == len(processing) == expected
             and arrivals.unsigned == 0),
    ])
    # Raw samples beside the figures, not in them: the results table prints figures line by line.
    res["samples_ms"] = {"detection": [round(v, 1) for v in detection],
                         "processing": [round(v, 1) for v in processing]}
    return res
