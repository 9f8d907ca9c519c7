"""A fleet of `sefwd run` agents, one per VM of an availability set, all sending to one Event hub.

Every agent is a `python -m forwarder run` subprocess on its own emulator VM path (one in-process
IMDS emulator serves them all, default rate limit), polling at 1 s, with one `eventhubs` sink
pointed at the Node.js AMQP peer (benchmarks/peers/eventhubs). Agents start in waves so start-up does
not starve the machine. At steady state (no document change) the agents' CPU is read from
schedstat over a window; then one Freeze event naming every VM is scheduled, started and completed,
and a consumer reading the hub deduplicates by `eventkey`: it must see one logical event per change
although every agent sends its own record of it.
"""
from __future__ import annotations

import os
import statistics
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psutil

from benchmarks.agents import FirstGets, spawn_agent, stop_agents
from benchmarks.common import Sizes, cpu_seconds, goal, result, scratch_dir
from forwarder.emulator import Emulator

from benchmarks.peers.eventhubs_peer import EventHubsPeer

CPU_GOAL_PERCENT = 25.0  # of all cores together, the agents at steady state
POLL_INTERVAL_S = 1.0
START_TIMEOUT_S = 90.0  # one wave: spawn until every agent's first Scheduled Events GET
CONNECT_TIMEOUT_S = 120.0  # every agent's forwarder.started record at the hub
CHANGE_TIMEOUT_S = 90.0  # one change: until every agent's record of it is at the hub
PEER_POLL_S = 0.1  # how often the consumer reads the hub while it waits for a change's records
CHANGES = ("scheduled", "started", "completed")
# eventkey suffix per change: every terminal record shares "<EventId>:ended" (outcome in data).
KEY_OF = {"scheduled": "scheduled", "started": "started", "completed": "ended"}
CONN_ENV = "FLEET_EH_CONN"


@dataclass(frozen=True)
class _Plan:
    agents: int
    wave: int  # agents spawned together; the next wave waits for their first GETs
    settle: float  # seconds between every agent being connected and the steady window
    window: float  # the steady-state window


PLANS = {
    "full": _Plan(agents=100, wave=10, settle=10.0, window=60.0),
    "quick": _Plan(agents=100, wave=10, settle=5.0, window=20.0),
    "smoke": _Plan(agents=3, wave=3, settle=1.0, window=5.0),
}


class _Agent:
    """One `python -m forwarder run` on its own emulator VM and state dir; stderr goes to a file."""

    def __init__(self, emu: Emulator, work: Path, vm: str, env: dict[str, str]) -> None:
        self.vm = vm
        self.dir = work / vm
        self.log = self.dir / "agent.log"
        self.proc = spawn_agent(
            emu, self.dir, vm,
            f'[[sinks]]\ntype = "eventhubs"\nname = "eventhubs"\nconnection_string_env = "{CONN_ENV}"\n',
            env, poll_interval_ms=int(POLL_INTERVAL_S * 1000))
        self.handle = psutil.Process(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            try:
                tail = self.log.read_text(errors="replace")[-2000:]
            except OSError:
                tail = ""
            raise RuntimeError(f"agent {self.vm} exited with {self.proc.returncode}; its log ends:\n{tail}")

    def cpu(self) -> float:
        """schedstat CPU seconds of the live threads (precise; misses threads that already ended)."""
        return cpu_seconds(self.proc.pid)

    def cpu_ticks(self) -> float:
        """utime + stime in 10 ms ticks, including threads that ended (each send runs on its own thread)."""
        t = self.handle.cpu_times()
        return t.user + t.system

    def rss_mib(self) -> float:
        return self.handle.memory_info().rss / 2**20


class _Hub:
    """The consumer: reads every event the peer holds, notes when each was first seen, parses CloudEvents."""

    def __init__(self, peer: EventHubsPeer) -> None:
        self._url = f"http://127.0.0.1:{peer.control_port}/events"
        self.seen: list[tuple[float, dict[str, Any]]] = []  # (monotonic arrival as observed, CloudEvent)
        self.unparsed = 0

    def read(self) -> None:
        with urllib.request.urlopen(self._url, timeout=10) as response:
            events = orjson.loads(response.read())
        now = time.monotonic()
        for raw in events[len(self.seen) + self.unparsed:]:
            try:
                event = orjson.loads(raw["body"])
            except (orjson.JSONDecodeError, KeyError, TypeError):
                self.unparsed += 1
                continue
            if isinstance(event, dict):
                self.seen.append((now, event))
            else:
                self.unparsed += 1

    def wait(self, want: Callable[[], bool], timeout: float, check: Callable[[], None], what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.read()
            if want():
                return
            check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
            time.sleep(PEER_POLL_S)


def _vm_of(event: dict[str, Any]) -> str | None:
    data = event.get("data")
    vm = data.get("Vm") if isinstance(data, dict) else None
    name = vm.get("Name") if isinstance(vm, dict) else None
    return name if isinstance(name, str) else None


def run(sizes: Sizes) -> dict[str, Any]:
    plan = PLANS[sizes.name]
    why = EventHubsPeer.available()
    if why is not None:
        raise RuntimeError(f"the fleet benchmark needs the Event Hubs peer: {why} "
                           "(sh benchmarks/peers/eventhubs/install.sh)")
    ncpu = os.cpu_count() or 1
    vms = [f"fleet-vm-{i:03d}" for i in range(plan.agents)]
    agents: list[_Agent] = []
    with scratch_dir("fleet-") as work, Emulator(vms=vms) as emu, \
            EventHubsPeer(log=work / "eventhubs-peer.log") as peer:
        first_gets = FirstGets(emu)
        hub = _Hub(peer)
        env = {CONN_ENV: peer.connection_string()}
        me = os.getpid()

        def check() -> None:
            for agent in agents:
                agent.check_alive()
            if peer.proc.poll() is not None:
                raise RuntimeError(f"the Event Hubs peer exited with {peer.proc.returncode}")

        try:
            # -- start-up, in waves ---------------------------------------------------------------
            started_at = time.monotonic()
            for i in range(0, len(vms), plan.wave):
                wave = [_Agent(emu, work, vm, env) for vm in vms[i:i + plan.wave]]
                agents.extend(wave)
                first_gets.wait_all([a.vm for a in wave], START_TIMEOUT_S, check)
            polling_s = time.monotonic() - started_at
            by_vm = {a.vm: a for a in agents}

            def connected() -> bool:
                return {_vm_of(e) for _, e in hub.seen if e.get("type") == "forwarder.started"} >= set(by_vm)

            hub.wait(connected, CONNECT_TIMEOUT_S, check, "every agent's forwarder.started record at the hub")
            connected_s = time.monotonic() - started_at

            # -- steady state: nothing changes, every agent polls once a second ------------------------
            time.sleep(plan.settle)
            check()
            t0 = time.monotonic()
            cpu0 = {a.vm: a.cpu() for a in agents}
            ticks0 = sum(a.cpu_ticks() for a in agents)
            emu0, peer0 = cpu_seconds(me), cpu_seconds(peer.proc.pid)
            gets0 = emu.stats()["requests"]
            time.sleep(plan.window)
            cpu1 = {a.vm: a.cpu() for a in agents}
            ticks1 = sum(a.cpu_ticks() for a in agents)
            emu1, peer1 = cpu_seconds(me), cpu_seconds(peer.proc.pid)
            t1 = time.monotonic()
            gets1 = emu.stats()["requests"]
            check()
            hub_stats = peer.stats()
            rss = [a.rss_mib() for a in agents]
            threads = [a.handle.num_threads() for a in agents]
            window = t1 - t0
            agent_cpu = sum(cpu1[v] - cpu0[v] for v in cpu0)
            per_agent_ms_s = [(cpu1[v] - cpu0[v]) * 1000 / window for v in cpu0]

            def se_gets(stats: dict[str, Any], vm: str) -> int:
                return int(stats.get(vm, {}).get("by_endpoint", {}).get("scheduledevents", 0))

            polls = sum(se_gets(gets1, v) - se_gets(gets0, v) for v in vms)

            # -- one availability-set event: scheduled, started, completed -----------------------------
            tick0 = sum(a.cpu_ticks() for a in agents)
            emu_b0, peer_b0 = cpu_seconds(me), cpu_seconds(peer.proc.pid)
            burst0 = time.monotonic()
            # NotBefore and the start/complete timers far away: the benchmark moves the event itself.
            event_id = ""
            fanout: dict[str, dict[str, float]] = {}
            actions: dict[str, Callable[[], None]] = {
                "started": lambda: emu.start_event(event_id),
                "completed": lambda: emu.complete(event_id),
            }
            for kind in CHANGES:
                if kind == "scheduled":
                    event_id = emu.schedule(type="Freeze", source="Platform", duration=5, resources=vms,
                                            start_after=3600, complete_after=3600)
                else:
                    actions[kind]()
                changed = time.monotonic()
                key = f"{event_id}:{KEY_OF[kind]}"

                def arrived(key: str = key) -> dict[str, float]:
                    first: dict[str, float] = {}
                    for when, e in hub.seen:
                        vm = _vm_of(e)
                        if e.get("eventkey") == key and vm is not None and vm not in first:
                            first[vm] = when
                    return first

                hub.wait(lambda: set(arrived()) >= set(by_vm), CHANGE_TIMEOUT_S, check,
                         f"every agent's {kind} record at the hub")
                delays = [(t - changed) * 1000 for t in arrived().values()]
                fanout[kind] = {"p50_ms": round(statistics.median(delays), 0), "max_ms": round(max(delays), 0)}
            burst1 = time.monotonic()
            tick1 = sum(a.cpu_ticks() for a in agents)
            emu_b1, peer_b1 = cpu_seconds(me), cpu_seconds(peer.proc.pid)
            time.sleep(0.5)  # a late duplicate would still be counted
            hub.read()
            check()
        finally:
            stop_agents([a.proc for a in agents])

    # -- the consumer: scheduledevent.* records of this event, deduplicated by eventkey ----------------
    records = [e for _, e in hub.seen
               if str(e.get("type", "")).startswith("scheduledevent.")
               and isinstance(e.get("data"), dict) and e["data"].get("EventId") == event_id]
    keys = {e.get("eventkey") for e in records}
    pairs = {(_vm_of(e), e.get("eventkey")) for e in records}
    expected_keys = {f"{event_id}:{KEY_OF[k]}" for k in CHANGES}
    every_pair = all((vm, k) in pairs for vm in vms for k in expected_keys)
    per_kind = {k: sum(1 for e in records if e.get("type") == f"scheduledevent.{k}") for k in CHANGES}
    burst = burst1 - burst0
    cpu_percent = agent_cpu * 100 / (window * ncpu)
    figures: dict[str, Any] = {
        "agents": plan.agents,
        "poll_interval_s": POLL_INTERVAL_S,
        "window_s": round(window, 1),
        "nproc": ncpu,
        # Share of ALL cores (nproc of them): agents' CPU seconds / (window x nproc) x 100.
        "cpu_percent": round(cpu_percent, 2),
        # The same from utime+stime ticks, which also count threads that ended within the window.
        "cpu_percent_ticks": round((ticks1 - ticks0) * 100 / (window * ncpu), 2),
        "cpu_ms_per_s_each": {"median": round(statistics.median(per_agent_ms_s), 2),
                              "max": round(max(per_agent_ms_s), 2)},
        "cpu_ms_per_poll": round(agent_cpu * 1000 / max(1, polls), 3),
        "polls_in_window": polls,
        "emulator_and_benchmark_cpu_percent": round((emu1 - emu0) * 100 / (window * ncpu), 2),
        "eventhubs_peer_cpu_percent": round((peer1 - peer0) * 100 / (window * ncpu), 2),
        "rss_mib_each": {"median": round(statistics.median(rss), 1), "max": round(max(rss), 1)},
        "rss_mib_total": round(sum(rss), 0),
        # One AMQP connection per agent, held open while idle (opened_total > agents: reconnects).
        "eventhubs_connections": {"open": hub_stats.get("open_connections"),
                                  "opened_total": hub_stats.get("connections")},
        "threads_each": {"median": statistics.median(threads), "max": max(threads)},
        "start_up_s": {"all_polling": round(polling_s, 1), "all_connected": round(connected_s, 1),
                       "wave": plan.wave},
        "eventhubs_records": len(records),
        "unique_eventkeys": len(keys),
        "records_by_kind": per_kind,
        "duplicates": len(records) - len(pairs),
        "fanout_ms": fanout,
        "burst_s": round(burst, 1),
        # Burst CPU from utime+stime ticks: each send runs on its own short-lived thread.
        "burst_cpu_percent": {"agents": round((tick1 - tick0) * 100 / (burst * ncpu), 1),
                              "emulator_and_benchmark": round((emu_b1 - emu_b0) * 100 / (burst * ncpu), 1),
                              "eventhubs_peer": round((peer_b1 - peer_b0) * 100 / (burst * ncpu), 1)},
        "unparsed_hub_events": hub.unparsed,
    }
    return result(figures, [
        goal(f"agents' steady-state CPU <= {CPU_GOAL_PERCENT:g} % of all {ncpu} cores",
             cpu_percent <= CPU_GOAL_PERCENT),
        goal(f"every agent delivered every change ({plan.agents} x {len(CHANGES)} records, every VM and eventkey)",
             len(records) >= plan.agents * len(CHANGES) and every_pair),
        goal(f"deduplicated by eventkey, one logical event per change ({len(CHANGES)})",
             keys == expected_keys),
    ])
