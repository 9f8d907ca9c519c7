"""Journal throughput (fsync, group commit; drain through a Reader) next to persist-queue's SQLiteAckQueue."""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from persistqueue import SQLiteAckQueue

from benchmarks.common import Sizes, goal, result, sample_records, scratch_dir
from forwarder.journal import Journal
from forwarder.sinkapi import Record

BATCH = 64
READ_BATCH = 500
APPEND_GOAL, DRAIN_GOAL, VS_PQ_GOAL = 20_000, 50_000, 3.0


def _rate(count: int, fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return count / (time.perf_counter() - start)


def _fsync_ms(work: Path, rounds: int = 50) -> float:
    """Median latency of a 4 KiB write + fsync on this disk: the floor under every durable append."""
    fd = os.open(work / "fsync-probe", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000
    finally:
        os.close(fd)


def _null_sink(batch: list[Record]) -> None:
    """Stands in for a sink that accepts everything at once."""


def _journal(bodies: list[bytes], single: list[bytes], work: Path) -> dict[str, float]:
    journal = Journal(work / "journal", fsync=True)
    try:
        def append_batched() -> None:
            for i in range(0, len(bodies), BATCH):
                journal.append(bodies[i : i + BATCH])

        def append_single() -> None:
            for body in single:
                journal.append([body])

        reader = journal.reader("null")
        total = len(bodies) + len(single)

        def drain() -> None:
            done = 0
            while done < total:
                entries = reader.read(READ_BATCH)
                _null_sink([Record.from_body(e.body) for e in entries])  # what a sink worker builds
                reader.commit(entries[-1].index + 1)
                done += len(entries)
            reader.flush()

        return {
            "append_batched": _rate(len(bodies), append_batched),
            "append_single": _rate(len(single), append_single),
            "drain": _rate(total, drain),
        }
    finally:
        journal.close()


def _persist_queue(bodies: list[bytes], work: Path) -> dict[str, float]:
    queue = SQLiteAckQueue(str(work / "pq"), auto_commit=True, multithreading=False)

    def put() -> None:
        for body in bodies:
            queue.put(body)

    def drain() -> None:
        for _ in bodies:
            item = queue.get(block=False)
            _null_sink([Record.from_body(item)])
            queue.ack(item)

    return {"put": _rate(len(bodies), put), "drain": _rate(len(bodies), drain)}


def run(sizes: Sizes) -> dict[str, Any]:
    records = sample_records(sizes.journal_records + sizes.journal_single)
    bodies = [r.body for r in records[: sizes.journal_records]]
    single = [r.body for r in records[sizes.journal_records :]]
    with scratch_dir("journal-") as work:
        fsync_ms = _fsync_ms(work)
        j = _journal(bodies, single, work)
        pq = _persist_queue(bodies[: sizes.pq_records], work)
    figures = {
        # Disks differ a lot (and so does one cloud disk from minute to minute): read the rates
        # next to this figure and to persist-queue's, which was measured on the same disk just after.
        "fsync_ms_median": round(fsync_ms, 3),
        "record_bytes": round(sum(map(len, bodies)) / len(bodies)),
        "records": {"append_batched": len(bodies), "append_single": len(single), "persist_queue": sizes.pq_records},
        "batch_size": BATCH,
        "sefwd_rec_per_s": {k: round(v) for k, v in j.items()},
        "persist_queue_rec_per_s": {k: round(v) for k, v in pq.items()},
        "append_vs_persist_queue": round(j["append_batched"] / pq["put"], 1),
        "append_single_vs_persist_queue": round(j["append_single"] / pq["put"], 1),
        "drain_vs_persist_queue": round(j["drain"] / pq["drain"], 1),
    }
    return result(figures, [
        goal(f"append (batches of {BATCH}) >= {APPEND_GOAL:,} rec/s", j["append_batched"] >= APPEND_GOAL),
        goal(f"drain >= {DRAIN_GOAL:,} rec/s", j["drain"] >= DRAIN_GOAL),
        goal(f"append >= {VS_PQ_GOAL:g}x persist-queue put", j["append_batched"] >= VS_PQ_GOAL * pq["put"]),
        goal(f"drain >= {VS_PQ_GOAL:g}x persist-queue get+ack", j["drain"] >= VS_PQ_GOAL * pq["drain"]),
    ])
