"""``sefwd deadletter replay SINK``: send a sink's dead letters again, with a progress bar."""
from __future__ import annotations

import random
import sys
import threading
import time

from forwarder.config import Config
from forwarder.deadletter import DeadLetters, read_file
from forwarder.retry import Backoff
from forwarder.sinkapi import Ok, Reject, Retry, SinkContext, load_sink_factory


def _progress(done: int, total: int, start: float) -> None:
    if not sys.stderr.isatty():
        return
    width = 30
    filled = int(width * done / total) if total else width
    rate = done / max(1e-9, time.monotonic() - start)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} ({rate:.0f}/s)")
    sys.stderr.flush()


def replay(config: Config, sink_name: str, *, timeout: float = 300.0) -> int:
    """Re-send every dead letter of one sink; returns an exit code (0 when all went through)."""
    sink_cfg = next((s for s in config.sinks if s.name == sink_name), None)
    if sink_cfg is None:
        print(f"sefwd: no sink named {sink_name!r} in the config", file=sys.stderr)
        return 2
    dead = DeadLetters(config.state.dir / "deadletter", sink_name)
    taken = dead.take()
    if taken is None:
        print(f"sink {sink_name}: no dead letters", file=sys.stderr)
        return 0
    letters = read_file(taken)
    stop = threading.Event()
    sink = load_sink_factory(sink_cfg.type)(
        sink_cfg.options, SinkContext(name=sink_name, state_dir=config.state.dir / "sinks" / sink_name, stop=stop)
    )
    backoff, rng = Backoff(initial=0.5, maximum=10.0), random.Random()
    deadline = time.monotonic() + timeout
    start = time.monotonic()
    sent = failed = 0
    batch_size = max(1, sink.max_batch)
    try:
        for i in range(0, len(letters), batch_size):
            chunk = letters[i : i + batch_size]
            records = [dl.record for dl in chunk]
            attempt = 0
            while True:
                result = sink.send(records)
                if isinstance(result, Ok):
                    sent += len(records)
                    break
                if isinstance(result, Reject) or time.monotonic() >= deadline:
                    reason = result.reason if isinstance(result, (Reject, Retry)) else "unknown"
                    dead.add(records, reason, getattr(result, "detail", "") or "replay gave up")
                    failed += len(records)
                    break
                assert isinstance(result, Retry)
                stop.wait(min(backoff.delay(attempt, rng, result.delay), max(0.0, deadline - time.monotonic())))
                attempt += 1
            _progress(sent + failed, len(letters), start)
    except KeyboardInterrupt:
        rest = [dl.record for dl in letters[sent + failed :]]
        dead.add(rest, "replay_interrupted", "")
        failed += len(rest)
    finally:
        sink.close()
        taken.unlink()
        if sys.stderr.isatty():
            sys.stderr.write("\n")
    print(f"sink {sink_name}: replayed {sent}, still dead {failed}", file=sys.stderr)
    return 0 if failed == 0 else 1
