"""Resident memory and startup time of `sefwd run`: stdout only beside every sink configured, in the same run."""
from __future__ import annotations

import re
import sqlite3
import statistics
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil

from benchmarks.agents import FirstGets, spawn_agent, stop_agents
from benchmarks.common import Sizes, goal, result, scratch_dir
from forwarder.emulator import Emulator

from benchmarks.peers.appinsights_peer import AppInsightsPeer
from benchmarks.peers.eventhubs_peer import EventHubsPeer
from benchmarks.peers.logs_ingestion import LogsIngestionPeer, emulator_tokens
from benchmarks.peers.webhook_receiver import WebhookReceiver

RSS_GOAL_MIB = {"stdout_only": 40.0, "all_sinks": 120.0}
HOSTILE_RSS_GOAL_MIB = 64.0  # a stdout-only agent while IMDS serves hostile documents (issue 11)
HOSTILE_RETURN_MIB = 8.0  # "returns to baseline": RSS after the hostile phase within this of before
# What the emulator serves in the hostile phase: (name, fault kind, options), each for a few polls.
HOSTILE_FAULTS = (
    ("oversized_64mib", "oversized", {"size": 64 * 1024 * 1024}),
    ("oversized_chunked_64mib", "oversized", {"size": 64 * 1024 * 1024, "chunked": True}),
    ("nested_50000", "nested", {"depth": 50_000}),
    ("out_of_range", "out_of_range", {}),
)
HUGE_EVENTS = 400  # events in one document (about 200 KB), each with a long description
STARTUP_GOAL_MS = 400.0
CONFIGS = ("stdout_only", "all_sinks")
ALL_SINKS = ("stdout", "file", "webhook", "eventhubs", "loganalytics", "appinsights")
DELIVERY_TIMEOUT_S = 60.0
START_TIMEOUT_S = 30.0
# Keep the Application Insights SDK's own phone-home features off the network (documented env switches).
QUIET_SDK_ENV = {
    "APPLICATIONINSIGHTS_STATSBEAT_DISABLED_ALL": "true",
    "APPLICATIONINSIGHTS_CONTROLPLANE_DISABLED": "true",
    "APPLICATIONINSIGHTS_SDKSTATS_DISABLED": "true",
}
_TELEMETRY_URL = re.compile(r"/metrics and /healthz on (http://\S+)")


@dataclass(frozen=True)
class _Plan:
    startup_runs: int  # starts per configuration; the last one stays up for the RSS figure
    settle: float  # seconds between every sink's delivery and the RSS reading


PLANS = {"full": _Plan(3, 5.0), "quick": _Plan(3, 3.0), "smoke": _Plan(1, 0.5)}


@dataclass
class _Peers:
    """Every sink's loopback peer, and the config lines and environment that point an agent at them."""

    emu: Emulator
    work: Path
    webhook: WebhookReceiver
    logs: LogsIngestionPeer
    appinsights: AppInsightsPeer
    eventhubs: EventHubsPeer | None
    missing: list[str] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        env = {**QUIET_SDK_ENV, "AZURE_POD_IDENTITY_AUTHORITY_HOST": self.emu.url,
               "FOOTPRINT_AI_CONN": self.appinsights.connection_string}
        if self.eventhubs is not None:
            env["FOOTPRINT_EH_CONN"] = self.eventhubs.connection_string()
        return env

    def sinks(self, out: Path) -> str:
        text = (
            '[[sinks]]\ntype = "stdout"\nname = "stdout"\n'
            f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{out}"\n'
            f'[[sinks]]\ntype = "webhook"\nname = "webhook"\nurl = "{self.webhook.url}"\n'
            f'[[sinks]]\ntype = "loganalytics"\nname = "loganalytics"\nendpoint = "{self.logs.url}"\n'
            f'rule_id = "{self.logs.rule_id}"\nca_file = "{self.logs.ca_file}"\n'
            f'[[sinks]]\ntype = "appinsights"\nname = "appinsights"\nconnection_string_env = "FOOTPRINT_AI_CONN"\n'
            f'ca_file = "{self.appinsights.ca_file}"\n'
        )
        if self.eventhubs is not None:
            text += '[[sinks]]\ntype = "eventhubs"\nname = "eventhubs"\nconnection_string_env = "FOOTPRINT_EH_CONN"\n'
        return text

    def delivered(self, event_id: str, out: Path) -> dict[str, bool]:
        """Whether each peer holds a record of this event (the stdout sink is checked by the caller)."""
        needle = event_id.encode()
        got = {
            "file": out.exists() and needle in out.read_bytes(),
            "webhook": any(needle in r.body for r in self.webhook.requests),
            "loganalytics": any(needle in orjson.dumps(row) for row in self.logs.rows),
            "appinsights": any(needle in orjson.dumps(e) for e in self.appinsights.events()),
        }
        if self.eventhubs is not None:
            got["eventhubs"] = any(event_id in e["body"] for e in self.eventhubs.events())
        return got


@contextmanager
def _peers(emu: Emulator, work: Path) -> Iterator[_Peers]:
    with ExitStack() as stack:
        missing = []
        eventhubs = None
        why = EventHubsPeer.available()
        if why is None:
            eventhubs = stack.enter_context(EventHubsPeer(log=work / "eventhubs-peer.log"))
        else:
            missing.append(f"eventhubs ({why})")
        yield _Peers(
            emu=emu, work=work,
            webhook=stack.enter_context(WebhookReceiver(default=200)),
            logs=stack.enter_context(LogsIngestionPeer(token_validator=emulator_tokens(emu))),
            appinsights=stack.enter_context(AppInsightsPeer(work)),
            eventhubs=eventhubs, missing=missing,
        )


class _Agent:
    """One `python -m forwarder run` on its own emulator VM and state dir; stderr goes to a file."""

    def __init__(self, emu: Emulator, first_gets: FirstGets, work: Path, vm: str, sinks: Callable[[Path], str],
                 env: dict[str, str], telemetry: bool) -> None:
        self.vm = vm
        self.dir = work / vm
        self.state = self.dir / "state"
        self.out = self.dir / "out.jsonl"
        self.log = self.dir / "agent.log"
        spawned = time.monotonic()
        self.proc = spawn_agent(emu, self.dir, vm,
                                ('[telemetry]\nlisten = "127.0.0.1:0"\n' if telemetry else "") + sinks(self.out), env)
        served = first_gets.wait(vm, START_TIMEOUT_S, self.alive)
        if served is None:
            self.stop()
            raise RuntimeError(f"agent {vm} made no Scheduled Events GET within {START_TIMEOUT_S:g} s: see {self.log}")
        self.startup_ms = (served - spawned) * 1000
        self.handle = psutil.Process(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise RuntimeError(f"agent {self.vm} exited with {self.proc.returncode}: see {self.log}")

    def committed(self, sink: str, event_id: str) -> bool:
        """Whether the sink's cursor in the agent's store has passed the record of this event."""
        try:
            db = sqlite3.connect(f"file:{self.state / 'state.db'}?mode=ro", uri=True, timeout=5)
            try:
                row = db.execute("SELECT (SELECT next FROM cursors WHERE sink = ?) > id FROM records "
                                 "WHERE instr(body, ?) > 0 ORDER BY id LIMIT 1", (sink, event_id.encode())).fetchone()
            finally:
                db.close()
        except sqlite3.Error:
            return False
        return bool(row and row[0])

    def telemetry_scrape(self) -> str:
        found = _TELEMETRY_URL.search(self.log.read_text(errors="replace"))
        if found is None:
            return ""
        try:
            with urllib.request.urlopen(found[1] + "/metrics", timeout=5) as response:
                return response.read().decode() if response.status == 200 else ""
        except OSError:  # HTTPError and URLError too: the figure then says telemetry did not answer
            return ""

    def memory(self) -> dict[str, Any]:
        rss = self.handle.memory_info().rss / 2**20
        peak = None
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) / 1024
        except OSError:
            pass
        return {"rss": rss, "peak": peak, "threads": self.handle.num_threads()}

    def stop(self) -> None:
        stop_agents([self.proc], timeout=15)


def _wait_delivered(agents: dict[str, _Agent], peers: _Peers, event_id: str) -> dict[str, bool]:
    deadline = time.monotonic() + DELIVERY_TIMEOUT_S
    while True:
        for agent in agents.values():
            agent.check_alive()
        got = {"stdout_only.stdout": agents["stdout_only"].committed("stdout", event_id),
               "all_sinks.stdout": agents["all_sinks"].committed("stdout", event_id),
               **{f"all_sinks.{k}": v for k, v in peers.delivered(event_id, agents["all_sinks"].out).items()}}
        if all(got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def _vm_memory(pid: int) -> tuple[float, float]:
    """(current RSS, peak RSS) of ``pid`` in MiB, from /proc (VmRSS, VmHWM)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def hostile_rss(work: Path, settle: float) -> dict[str, Any]:
    """RSS of a stdout-only agent before, during (peak) and after IMDS serves hostile documents, then the
    peak with a legitimate document of ``HUGE_EVENTS`` events (its events stay in the agent's state)."""
    with Emulator(vms=["hostile"], rate_limit=None) as emu:
        emu.schedule(type="Reboot", resources=["hostile"], not_before="+1h")
        proc = spawn_agent(emu, work / "hostile", "hostile", '[[sinks]]\ntype = "stdout"\nname = "stdout"\n',
                           poll_interval_ms=500)

        def gets() -> int:
            return int(emu.stats()["requests"].get("hostile", {}).get("GET", 0))

        def wait_gets(count: int, what: str) -> None:
            deadline = time.monotonic() + 120
            while gets() < count:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"hostile footprint: agent {'died' if proc.poll() is not None else 'stalled'} ({what})")
                time.sleep(0.1)

        try:
            wait_gets(3, "first polls")
            time.sleep(settle)
            baseline, _ = _vm_memory(proc.pid)
            peaks: dict[str, float] = {}
            for name, kind, options in HOSTILE_FAULTS:
                before = gets()
                emu.inject_fault(kind, count=3, **options)
                wait_gets(before + 4, name)
                peaks[name] = round(_vm_memory(proc.pid)[1], 1)
            time.sleep(settle)
            after, _ = _vm_memory(proc.pid)  # the hostile answers left nothing behind
            # A legitimate but huge document last: its events are state the agent must keep.
            for i in range(HUGE_EVENTS):
                emu.schedule(type="Freeze", resources=["hostile"], not_before="+1h", description="d" * 400)
            wait_gets(gets() + 4, "huge document")
            peaks["huge_document_400_events"] = round(_vm_memory(proc.pid)[1], 1)
            _, peak = _vm_memory(proc.pid)
            alive = proc.poll() is None
        finally:
            stop_agents([proc])
    return {"baseline_mib": round(baseline, 1), "peak_mib": round(peak, 1), "after_mib": round(after, 1),
            "peak_after_each_mib": peaks, "alive": alive}


def run(sizes: Sizes) -> dict[str, Any]:
    plan = PLANS[sizes.name]
    startup: dict[str, list[float]] = {c: [] for c in CONFIGS}
    with scratch_dir("footprint-") as work, Emulator(vms=["footprint"], rate_limit=None) as emu, \
            _peers(emu, work) as peers:
        first_gets = FirstGets(emu)
        setups = {"stdout_only": (lambda out: '[[sinks]]\ntype = "stdout"\nname = "stdout"\n', {}, False),
                  "all_sinks": (peers.sinks, peers.env(), True)}
        agents: dict[str, _Agent] = {}
        try:
            # Interleaved, one agent starting at a time: each start has the CPU to itself, and a
            # drift in the machine's load hits both configurations alike.
            for i in range(plan.startup_runs):
                for name in CONFIGS:
                    sinks, env, telemetry = setups[name]
                    agent = _Agent(emu, first_gets, work, f"{name.replace('_', '-')}-{i}", sinks, env, telemetry)
                    startup[name].append(agent.startup_ms)
                    if i < plan.startup_runs - 1:
                        agent.stop()
                    else:
                        agents[name] = agent
            # The event lands after every start, so each sink's SDK loads and connects for real.
            event_id = emu.schedule(type="Reboot", source="Platform", duration=-1, start_after=3600,
                                    resources=[a.vm for a in agents.values()])
            delivered = _wait_delivered(agents, peers, event_id)
            metrics = agents["all_sinks"].telemetry_scrape()
            delivered["all_sinks.telemetry"] = 'sefwd_sink_delivered_total{sink="stdout"}' in metrics
            time.sleep(plan.settle)
            for agent in agents.values():
                agent.check_alive()
            memory = {name: agent.memory() for name, agent in agents.items()}
        finally:
            for agent in agents.values():
                agent.stop()
    with scratch_dir("footprint-hostile-") as work:
        hostile = hostile_rss(work, plan.settle)
    median = {name: statistics.median(runs) for name, runs in startup.items()}
    rss = {name: memory[name]["rss"] for name in CONFIGS}
    configured = [s for s in ALL_SINKS if s != "eventhubs" or peers.eventhubs is not None]
    figures = {
        "startup_ms": {name: round(median[name], 1) for name in CONFIGS},
        "startup_runs_ms": {name: [round(v, 1) for v in runs] for name, runs in startup.items()},
        "rss_mib": {name: round(rss[name], 1) for name in CONFIGS},
        "rss_peak_mib": {name: round(memory[name]["peak"], 1) if memory[name]["peak"] else None for name in CONFIGS},
        "threads": {name: memory[name]["threads"] for name in CONFIGS},
        "ratio_all_sinks_to_stdout_only": {
            "rss": round(rss["all_sinks"] / rss["stdout_only"], 2),
            "startup": round(median["all_sinks"] / median["stdout_only"], 2),
        },
        "all_sinks_configured": configured + ["telemetry.listen"],
        "missing": peers.missing,
        "delivered": delivered,
        "settle_s": plan.settle,
        "hostile_rss_mib": hostile,
    }
    return result(figures, [
        goal(f"stdout-only RSS <= {RSS_GOAL_MIB['stdout_only']:g} MiB", rss["stdout_only"] <= RSS_GOAL_MIB["stdout_only"]),
        goal(f"all-sinks RSS <= {RSS_GOAL_MIB['all_sinks']:g} MiB", rss["all_sinks"] <= RSS_GOAL_MIB["all_sinks"]),
        goal(f"stdout-only startup (spawn to first Scheduled Events GET, median) <= {STARTUP_GOAL_MS:g} ms",
             median["stdout_only"] <= STARTUP_GOAL_MS),
        goal("every sink type configured and each delivered the event (RSS reflects loaded SDKs)",
             not peers.missing and all(delivered.values())),
        goal(f"stdout-only RSS under hostile documents (oversized, chunked, nested, out of range, {HUGE_EVENTS} events) "
             f"< {HOSTILE_RSS_GOAL_MIB:g} MiB, alive, and back within {HOSTILE_RETURN_MIB:g} MiB of before",
             hostile["alive"] and hostile["peak_mib"] < HOSTILE_RSS_GOAL_MIB
             and hostile["after_mib"] <= hostile["baseline_mib"] + HOSTILE_RETURN_MIB),
    ])
