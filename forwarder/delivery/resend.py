"""``sefwd deadletter replay SINK``: send a sink's dead letters again, deleting each batch only once
it is delivered, so a failed or killed replay loses nothing (at worst one batch arrives twice)."""
from __future__ import annotations

import random
import sys
import threading
import time

from forwarder.agent.config import Config
from forwarder.errors import ForwarderError
from forwarder.common.retry import Backoff
from forwarder.sinkapi import Ok, Reject, Retry, SinkContext, load_sink_factory
from forwarder.store.database import Store


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
    try:
        store = Store.open(config.state.dir)
        letters = store.dead_letters(sink_name)
    except ForwarderError as exc:
        print(f"sefwd: {exc}", file=sys.stderr)
        return 1
    if not letters:
        print(f"sink {sink_name}: no dead letters", file=sys.stderr)
        store.close()
        return 0
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
            ids = [dl.id for dl in chunk]
            attempt = 0
            while True:
                result = sink.send([dl.record for dl in chunk])
                if isinstance(result, Ok):
                    store.settle_dead(ids)
                    sent += len(chunk)
                    break
                if isinstance(result, Reject) or time.monotonic() >= deadline:
                    assert isinstance(result, (Reject, Retry))
                    store.settle_dead(ids, result.reason, getattr(result, "detail", "") or "replay gave up")
                    failed += len(chunk)
                    break
                stop.wait(min(backoff.delay(attempt, rng, result.delay), max(0.0, deadline - time.monotonic())))
                attempt += 1
            _progress(sent + failed, len(letters), start)
    except KeyboardInterrupt:
        failed = len(letters) - sent  # the rest are still dead letters: nothing was removed early
    except Exception as exc:  # a store fault or a sink that raises: what was not delivered stays
        print(f"sefwd: replay stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
        failed = len(letters) - sent
    finally:
        sink.close()
        store.close()
        if sys.stderr.isatty():
            sys.stderr.write("\n")
    print(f"sink {sink_name}: replayed {sent}, still dead {failed}", file=sys.stderr)
    return 0 if failed == 0 else 1
