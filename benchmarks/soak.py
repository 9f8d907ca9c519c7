"""A long run of `sefwd run` with every sink type against local peers: does its memory level off, is every record
delivered? `python -m benchmarks --only soak --minutes N`.

The emulator schedules one event every few seconds (types in turn, some canceled, Freezes approved by a rule, a
hook on each scheduled change, the probe and telemetry on); the webhook refuses a fifth of its requests with 503.
RSS is read every ``SAMPLE_S``; the figure is the least-squares slope of the second half, in MiB per hour (the first
half holds the warm-up: imports, SQLite's page cache, the allocator's arenas). At the end the scheduling stops,
every sink is given time to catch up, and each peer's record ids are compared with the union of all of them.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson
import psutil  # type: ignore[import-untyped]

from benchmarks.agents import FirstGets, spawn_agent, stop_agents
from benchmarks.common import ROOT, Sizes, goal, result, scratch_dir
from benchmarks.footprint import QUIET_SDK_ENV
from benchmarks.peers.appinsights_peer import AppInsightsPeer
from benchmarks.peers.eventgrid_peer import KEY, EventGridPeer
from benchmarks.peers.eventhubs_peer import EventHubsPeer
from benchmarks.peers.logs_ingestion import LogsIngestionPeer, emulator_tokens
from benchmarks.peers.webhook_receiver import ReceivedRequest, Reply, WebhookReceiver
from forwarder.emulator import Emulator

MINUTES = {"full": 60.0, "quick": 10.0, "smoke": 1.0}
EVENT_EVERY_S = 5.0  # one new event this often: 720 an hour (the soak: 710 in 25 minutes, one per 2 s)
# For hunting growth faster (not for the goal's figure): SEFWD_SOAK_EVENT_EVERY=1 makes an hour's events in 12 minutes.
EVENT_EVERY_ENV = "SEFWD_SOAK_EVENT_EVERY"
SAMPLE_S = 15.0  # RSS reading interval
CATCH_UP_S = 120.0  # after the last event: time for every sink to deliver what is left
SLOPE_GOAL_MIB_PER_H = 0.5
TYPES = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate")
CANCEL_EVERY = 7  # every 7th event is canceled before it starts (a `canceled` change)
# A notify sink's messages carry the record id (the template) so that a missing one can be named.
NOTIFY_TEMPLATE = '[sinks.templates.default]\ntitle = "soak"\nbody = "{{ record.id }}"\n'
TRACE_ENV = "SEFWD_SOAK_TRACEMALLOC"  # a directory: the agent runs under benchmarks/soak_trace.py, snapshots there


def _refuse_a_fifth() -> Any:
    counter = itertools.count(1)
    lock = threading.Lock()

    def policy(request: ReceivedRequest) -> Reply:
        with lock:
            n = next(counter)
        return Reply(503 if n % 5 == 0 else 200)

    return policy


def _ids_jsonl(path: Path) -> set[str]:
    if not path.exists():
        return set()
    ids = set()
    for line in path.read_bytes().splitlines():
        if line.strip():
            try:
                ids.add(orjson.loads(line)["id"])
            except (orjson.JSONDecodeError, KeyError, TypeError):
                pass  # a partial last line while the agent writes
    return ids


def _sequence_gaps(path: Path) -> int:
    """Sequence numbers missing between the first and the last record the file sink holds."""
    seqs = set()
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            seqs.add(int(orjson.loads(line)["sequence"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            pass
    return (max(seqs) - min(seqs) + 1 - len(seqs)) if seqs else 0


def _slope_per_hour(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) samples, in MiB per hour."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_m = sum(m for _, m in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var == 0:
        return None
    return sum((t - mean_t) * (m - mean_m) for t, m in samples) / var * 3600


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def run(sizes: Sizes, minutes: float | None = None) -> dict[str, Any]:
    minutes = MINUTES[sizes.name] if minutes is None else minutes
    with scratch_dir("soak-") as work, ExitStack() as stack:
        emu = stack.enter_context(Emulator(vms=["soak"], rate_limit=None))
        first_gets = FirstGets(emu)
        webhook = stack.enter_context(WebhookReceiver(_refuse_a_fifth()))
        chat = stack.enter_context(WebhookReceiver(200))
        logs = stack.enter_context(LogsIngestionPeer(token_validator=emulator_tokens(emu)))
        appinsights = stack.enter_context(AppInsightsPeer(work))
        eventgrid = stack.enter_context(EventGridPeer())
        eventhubs = None
        missing_peers = []
        if (why := EventHubsPeer.available()) is None:
            eventhubs = stack.enter_context(EventHubsPeer(log=work / "eventhubs-peer.log"))
        else:
            missing_peers.append(f"eventhubs ({why})")

        vm_dir = work / "soak"
        out = vm_dir / "file.jsonl"
        stdout_path = vm_dir / "stdout.jsonl"
        env = {**QUIET_SDK_ENV, "AZURE_POD_IDENTITY_AUTHORITY_HOST": emu.url, "SEFWD_AGENT_HEARTBEAT": "1m",
               "SOAK_AI_CONN": appinsights.connection_string, "SOAK_EG_KEY": KEY,
               "SOAK_NOTIFY_URLS": f"json://127.0.0.1:{chat.port}/chat"}
        sinks = (
            '[[sinks]]\ntype = "stdout"\nname = "stdout"\n'
            f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{out}"\n'
            f'[[sinks]]\ntype = "webhook"\nname = "webhook"\nurl = "{webhook.url}"\n'
            f'[[sinks]]\ntype = "loganalytics"\nname = "loganalytics"\nendpoint = "{logs.url}"\n'
            f'rule_id = "{logs.rule_id}"\nca_file = "{logs.ca_file}"\n'
            f'[[sinks]]\ntype = "appinsights"\nname = "appinsights"\nconnection_string_env = "SOAK_AI_CONN"\n'
            f'ca_file = "{appinsights.ca_file}"\n'
            f'[[sinks]]\ntype = "eventgrid"\nname = "eventgrid"\nendpoint = "{eventgrid.topic_endpoint}"\n'
            f'key_env = "SOAK_EG_KEY"\nca_file = "{eventgrid.ca_file}"\n'
            '[[sinks]]\ntype = "notify"\nname = "notify"\nurls_env = "SOAK_NOTIFY_URLS"\nfilter = {}\n'
            + NOTIFY_TEMPLATE
        )
        if eventhubs is not None:
            env["SOAK_EH_CONN"] = eventhubs.connection_string()
            sinks += '[[sinks]]\ntype = "eventhubs"\nname = "eventhubs"\nconnection_string_env = "SOAK_EH_CONN"\n'
        body = ('[delivery]\nretry_initial = "200ms"\nretry_max = "2s"\n'
                '[telemetry]\nlisten = "127.0.0.1:0"\n'
                '[probe]\nlisten = "127.0.0.1:0"\nsettle = "1s"\n'
                '[approval]\n[approval.hooks]\nscheduled = ["true"]\ncompleted = ["true"]\n'
                '[[approval.rules]]\nname = "freeze"\nevent_type = "Freeze"\naction = "approve"\n' + sinks)
        # Allocator experiments (MALLOC_ARENA_MAX=2, MALLOC_TRIM_THRESHOLD_=...) reach the agent.
        env.update({k: v for k, v in os.environ.items() if k.startswith("MALLOC_")})
        trace_dir = os.environ.get(TRACE_ENV)
        vm_dir.mkdir(parents=True, exist_ok=True)
        with open(stdout_path, "wb") as stdout:
            proc = spawn_agent(emu, vm_dir, "soak", body, env, stdout=stdout,
                               wrapper=[str(ROOT / "benchmarks" / "soak_trace.py"), trace_dir] if trace_dir else None)
            try:
                # Under tracemalloc every import is several times slower (the Azure SDKs: minutes).
                if first_gets.wait("soak", 600 if trace_dir else 60, lambda: proc.poll() is None) is None:
                    raise RuntimeError(f"the agent made no Scheduled Events GET: see {vm_dir / 'agent.log'}")
                figures = _soak(emu, proc, minutes)
                times = psutil.Process(proc.pid).cpu_times()  # every thread's, also those that ended
                cpu_s = times.user + times.system
                delivered = _catch_up(proc, {
                    "stdout": lambda: _ids_jsonl(stdout_path),
                    "file": lambda: _ids_jsonl(out),
                    "webhook": lambda: {orjson.loads(r.body)["id"] for r in webhook.requests
                                        if r.method == "POST" and r.body},
                    "loganalytics": lambda: {row["RecordId"] for row in logs.rows},
                    "appinsights": lambda: set(appinsights.event_ids()),
                    "eventgrid": lambda: set(eventgrid.event_ids()),
                    "notify": lambda: {orjson.loads(r.body)["message"].strip() for r in chat.requests},
                    **({"eventhubs": lambda: {_eh_id(e) for e in eventhubs.events()}} if eventhubs else {}),
                })
            finally:
                stop_agents([proc], timeout=20)
        figures.update(delivered)
        figures["sequence_gaps"] = _sequence_gaps(out)
        figures["cpu_percent"] = round(100 * cpu_s / max(1.0, figures["seconds"]), 2)
        figures["webhook_requests"] = webhook.count
        figures["peers_missing"] = missing_peers
    slope = figures["rss_slope_second_half_mib_per_hour"]
    goals = [goal(f"RSS slope of the second half <= {SLOPE_GOAL_MIB_PER_H} MiB/h",
                  slope is not None and slope <= SLOPE_GOAL_MIB_PER_H),
             goal("0 records missing at any sink, no gap in the sequence",
                  figures["records_missing_total"] == 0 and figures["sequence_gaps"] == 0),
             goal("every sink type configured against a local peer", not missing_peers)]
    return result(figures, goals)


def _eh_id(event: dict[str, Any]) -> str:
    body = event.get("body")
    try:
        return str(orjson.loads(body)["id"]) if isinstance(body, (str, bytes)) else str(body["id"])  # type: ignore[index]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return ""


def _soak(emu: Emulator, proc: subprocess.Popen[bytes], minutes: float) -> dict[str, Any]:
    """Schedule events for ``minutes``, reading the agent's RSS; the figures."""
    start = time.monotonic()
    end = start + minutes * 60
    samples: list[tuple[float, float]] = []
    scheduled = 0
    to_cancel: list[str] = []
    next_event = next_sample = start
    every = float(os.environ.get(EVENT_EVERY_ENV) or EVENT_EVERY_S)
    while (now := time.monotonic()) < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the agent exited with {proc.returncode} after {now - start:.0f} s")
        if now >= next_event:
            for event_id in to_cancel:
                try:
                    emu.cancel(event_id)
                except KeyError:
                    pass  # already started and gone
            to_cancel.clear()
            scheduled += 1
            etype = TYPES[scheduled % len(TYPES)]
            if scheduled % CANCEL_EVERY == 0:
                to_cancel.append(emu.schedule(type=etype, resources=["soak"], start_after=60))
            else:
                emu.schedule(type=etype, resources=["soak"], start_after=2, complete_after=2)
            next_event += every
        if now >= next_sample:
            samples.append((now - start, _rss_mib(proc.pid)))
            next_sample += SAMPLE_S
        time.sleep(max(0.05, min(next_event, next_sample, end) - time.monotonic()))
    for event_id in to_cancel:
        try:
            emu.cancel(event_id)
        except KeyError:
            pass
    seconds = time.monotonic() - start
    second_half = [s for s in samples if s[0] >= seconds / 2]
    slope = _slope_per_hour(second_half)
    return {
        "minutes": round(minutes, 2), "event_every_s": every, "seconds": round(seconds, 1), "events_scheduled": scheduled,
        "rss_first_mib": round(samples[0][1], 2) if samples else None,
        "rss_last_mib": round(samples[-1][1], 2) if samples else None,
        "rss_max_mib": round(max(m for _, m in samples), 2) if samples else None,
        "rss_second_half_start_mib": round(second_half[0][1], 2) if second_half else None,
        "rss_slope_second_half_mib_per_hour": None if slope is None else round(slope, 3),
        "rss_samples": [[round(t / 60, 2), round(m, 2)] for t, m in samples],
    }


def _catch_up(proc: subprocess.Popen[bytes], peers: dict[str, Any]) -> dict[str, Any]:
    """Wait until every peer holds every record any of them holds (or ``CATCH_UP_S``); what is missing where."""
    deadline = time.monotonic() + CATCH_UP_S
    last: dict[str, set[str]] = {}
    while True:
        seen = {name: received() - {""} for name, received in peers.items()}
        union = set().union(*seen.values())
        missing = {name: len(union - ids) for name, ids in seen.items()}
        # Every 5 s for a while: stable figures, with the emulator's last events ended and delivered.
        if (not any(missing.values()) and seen == last) or time.monotonic() > deadline or proc.poll() is not None:
            break
        last = seen
        time.sleep(5)
    return {"records": len(union), "records_missing": missing, "records_missing_total": sum(missing.values())}
