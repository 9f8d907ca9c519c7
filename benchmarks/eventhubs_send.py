"""CPU per record of the eventhubs sink, today's beside the thread-per-send one it replaced, in one run.

Both sinks send through the agent's delivery path (store + dispatcher, in this process) to the
Node.js Event Hubs peer (benchmarks/peers/eventhubs) over TLS as the service speaks it: AMQPS and AMQP
over secure WebSocket, verified against the peer's test CA. Two shapes per transport:

- ``burst``: records appended as fast as the agent can write them (a backlog after an outage, or
  many events at once); the dispatcher hands the sink up to ``max_batch`` records per send.
- ``single``: one record every 20 ms, so every record is a send of its own (changes arriving one
  at a time); this is where a per-send cost (a thread, a handshake) shows.
- ``single_sink``: the same records handed straight to ``sink.send`` (no store, no dispatcher):
  the sink's and the SDK's own share of ``single``.

CPU is the benchmark process's (all threads, also those that ended: ``time.process_time``) from
the first append until the dispatcher counted every record delivered, divided by the records. The
peer runs in its own process and is not counted. Implementations alternate per round; the median
of the rounds is reported. Run alone: ``python -m benchmarks.eventhubs_send [--quick] [--out FILE]``.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from benchmarks.common import Sizes, goal, result, run_standalone, sample_event, scratch_dir
from forwarder.delivery.dispatcher import Dispatcher
from forwarder.store.database import Store
from forwarder.common.retry import Backoff
from forwarder.sinkapi import Ok, Record, SinkContext

from benchmarks.peers.eventhubs_peer import EventHubsPeer

GOAL_MS = 1.0  # CPU per record in a burst, amortized
CONN_ENV = "BENCH_EH_CONN"
DELIVERY_TIMEOUT_S = 120.0
SINGLE_GAP_S = 0.02
EVENTS_PER_KEY = 4  # a scheduled event's records: scheduled, moved, started, gone


def _records(count: int, salt: str) -> list[Record]:
    """Realistic records; every ``EVENTS_PER_KEY`` consecutive changes share an EventId (a partition key)."""
    out = []
    for i in range(count):
        event = sample_event(i)
        event_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{salt}/{i // EVENTS_PER_KEY}")).upper()
        event["id"] = str(uuid.uuid4())
        event["subject"] = event["data"]["EventId"] = event_id
        out.append(Record.from_dict(event))
    return out


def _sink(impl: str, transport: str, peer: EventHubsPeer, work: Path) -> Any:
    port = peer.amqps_port if transport == "amqp" else peer.wss_port
    context = SinkContext(name=f"eh-{impl}", state_dir=work)
    if impl == "before":
        from benchmarks.eventhubs_before import EventHubsSink as Before
        from azure.eventhub import TransportType

        kind = TransportType.Amqp if transport == "amqp" else TransportType.AmqpOverWebsocket
        return Before({"connection_string_env": CONN_ENV}, context, client_options={
            "transport_type": kind, "connection_verify": peer.ca_file,
            "custom_endpoint_address": f"sb://127.0.0.1:{port}"})
    from sinks.eventhubs import EventHubsSink

    return EventHubsSink({"connection_string_env": CONN_ENV, "transport": transport, "ca_file": peer.ca_file,
                          "custom_endpoint_address": f"127.0.0.1:{port}"}, context)


def _deliver(impl: str, transport: str, shape: str, count: int, peer: EventHubsPeer, work: Path) -> dict[str, Any]:
    tag = f"{impl}-{transport}-{shape}-{uuid.uuid4().hex[:6]}"
    store = Store.open(work / f"state-{tag}", fsync=False)  # the sink's cost, not the disk's
    sink = _sink(impl, transport, peer, work)
    dispatcher = Dispatcher(store, {"eh": sink}, backoff=Backoff(initial=0.05, maximum=1.0))
    worker = dispatcher.workers["eh"]
    dispatcher.start()
    try:
        warm = _records(1, tag + "-warm")  # connect, TLS, CBS: not part of the burst
        dispatcher.store.commit(warm)
        _wait(worker, 1)
        records = _records(count, tag)
        before_events = peer.stats()["events"]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if shape == "burst":
            for i in range(0, count, 10):
                dispatcher.store.commit(records[i : i + 10])
        elif shape == "single_sink":
            for record in records:
                if sink.send([record]) == Ok():
                    worker.stats.delivered += 1  # counted like the dispatcher's deliveries
                time.sleep(SINGLE_GAP_S)
        else:
            for record in records:
                dispatcher.store.commit([record])
                time.sleep(SINGLE_GAP_S)  # pacing the load generator, not synchronizing
        _wait(worker, 1 + count)
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - wall0
        arrived = peer.stats()["events"] - before_events
    finally:
        dispatcher.close(drain_timeout=5)
        sink.close()
    return {"records": count, "cpu_ms_per_record": round(cpu * 1000 / count, 3),
            "wall_ms_per_record": round(wall * 1000 / count, 3), "retries": worker.stats.retries,
            "arrived": arrived}


def _wait(worker: Any, delivered: int) -> None:
    deadline = time.monotonic() + DELIVERY_TIMEOUT_S
    while worker.stats.delivered < delivered:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {worker.stats.delivered} of {delivered} records delivered")
        time.sleep(0.002)


def run(sizes: Sizes) -> dict[str, Any]:
    why = EventHubsPeer.available()
    if why is not None:
        return result({"missing": why}, [goal("the Event Hubs peer runs (node + rhea + ws)", False)])
    burst, single, rounds = {"full": (2000, 200, 3), "quick": (1000, 100, 1)}.get(sizes.name, (100, 10, 1))
    samples: dict[str, list[dict[str, Any]]] = {}
    with scratch_dir("eventhubs-") as work, EventHubsPeer(tls=True, log=work / "peer.log") as peer:
        os.environ[CONN_ENV] = peer.service_connection_string()
        for _ in range(rounds):
            for transport in ("amqp", "websocket"):
                for shape, count in (("burst", burst), ("single", single), ("single_sink", single)):
                    for impl in ("before", "after"):
                        row = _deliver(impl, transport, shape, count, peer, work)
                        samples.setdefault(f"{impl}.{transport}.{shape}", []).append(row)
    figures: dict[str, Any] = {"cpu_ms_per_record": {}, "wall_ms_per_record": {}, "ratio_before_to_after": {},
                               "records": {"burst": burst, "single": single}, "rounds": rounds}
    for key, rows in samples.items():
        impl, transport, shape = key.split(".")
        cpu = statistics.median(r["cpu_ms_per_record"] for r in rows)
        figures["cpu_ms_per_record"].setdefault(impl, {}).setdefault(transport, {})[shape] = round(cpu, 3)
        figures["wall_ms_per_record"].setdefault(impl, {}).setdefault(transport, {})[shape] = \
            round(statistics.median(r["wall_ms_per_record"] for r in rows), 3)
    complete = all(r["arrived"] >= r["records"] for rows in samples.values() for r in rows)
    after = figures["cpu_ms_per_record"]["after"]
    before = figures["cpu_ms_per_record"]["before"]
    for transport in after:
        figures["ratio_before_to_after"][transport] = {
            shape: round(before[transport][shape] / after[transport][shape], 2) for shape in after[transport]}
    worst_burst = max(after[t]["burst"] for t in after)
    return result(figures, [
        goal(f"burst CPU per record <= {GOAL_MS:g} ms amortized (AMQPS and WebSocket)", worst_burst <= GOAL_MS),
        goal("every record reached the hub", complete),
    ])


def _show(fig: dict[str, Any]) -> list[str]:
    return [f"{key:<22} {impl_or_transport:<10} {orjson.dumps(rows).decode()}"
            for key in ("cpu_ms_per_record", "wall_ms_per_record", "ratio_before_to_after")
            for impl_or_transport, rows in fig.get(key, {}).items()]


def main(argv: list[str] | None = None) -> int:
    return run_standalone("eventhubs_send", "eventhubs.json", run, prog="python -m benchmarks.eventhubs_send",
                          description=__doc__.splitlines()[0], quick_help="one round, smaller bursts", show=_show,
                          argv=argv)


if __name__ == "__main__":
    sys.exit(main())
