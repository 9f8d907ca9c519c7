"""``sefwd deadletter replay SINK``: send a sink's dead letters again, deleting each batch only once
it is delivered, so a failed or killed replay loses nothing (at worst one batch arrives twice)."""
from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol

from tqdm import tqdm

from forwarder.errors import ForwarderError
from forwarder.common.retry import Backoff
from forwarder.sinkapi import Ok, Reject, Retry, SinkContext, load_sink_factory
from forwarder.store.database import Store


def _progress_bar(total: int) -> tqdm[NoReturn]:
    """A progress bar on stderr, drawn only when stderr is a terminal: piped or redirected, the
    replay prints nothing but its summary line (stdout may carry records, e.g. the stdout sink)."""
    return tqdm(total=total, unit="record", file=sys.stderr, disable=not sys.stderr.isatty(),
                leave=False, dynamic_ncols=True)


def _counts(sink_name: str, sent: int, failed: int, json_out: bool) -> None:
    if json_out:
        import orjson

        sys.stdout.buffer.write(orjson.dumps({"sink": sink_name, "replayed": sent, "still_dead": failed}) + b"\n")
        sys.stdout.flush()
    print(f"sink {sink_name}: replayed {sent}, still dead {failed}", file=sys.stderr)


class SinkSettings(Protocol):
    """One configured sink as ``replay`` reads it (the agent's SinkConfig; no import of it here)."""

    @property
    def type(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def options(self) -> Mapping[str, Any]: ...


def replay(sinks: Sequence[SinkSettings], state_dir: Path, sink_name: str, *, timeout: float = 300.0,
           json_out: bool = False) -> int:
    """Re-send every dead letter of one sink; returns an exit code (0 when all went through).
    With ``json_out`` the counts are also printed on stdout as one JSON object."""
    sink_cfg = next((s for s in sinks if s.name == sink_name), None)
    if sink_cfg is None:
        print(f"sefwd: no sink named {sink_name!r} in the config", file=sys.stderr)
        return 2
    try:
        store = Store.open(state_dir)
        letters = store.dead_letters(sink_name)
    except ForwarderError as exc:
        print(f"sefwd: {exc}", file=sys.stderr)
        return 1
    # A damaged body cannot be sent: it stays a dead letter (`deadletter list` shows its raw bytes)
    # and never blocks the others.
    damaged = [dl for dl in letters if dl.record is None]
    letters = [dl for dl in letters if dl.record is not None]
    if damaged:
        print(f"sefwd: {len(damaged)} dead letter(s) of sink {sink_name} are damaged (not a record); kept, not sent "
              "(see `sefwd deadletter list`)", file=sys.stderr)
    if not letters:
        store.close()
        if json_out or damaged:
            _counts(sink_name, 0, len(damaged), json_out)
        else:
            print(f"sink {sink_name}: no dead letters", file=sys.stderr)
        return 1 if damaged else 0
    stop = threading.Event()
    try:
        sink = load_sink_factory(sink_cfg.type)(
            sink_cfg.options, SinkContext(name=sink_name, state_dir=state_dir / "sinks" / sink_name, stop=stop)
        )
    except Exception as exc:  # noqa: BLE001 - a third-party sink may raise anything
        print(f"sefwd: cannot build sink {sink_name}: {type(exc).__name__}: {exc}; its {len(letters)} dead "
              "letter(s) are kept", file=sys.stderr)
        store.close()
        return 1
    backoff, rng = Backoff(initial=0.5, maximum=10.0), random.Random()
    deadline = time.monotonic() + timeout
    sent = failed = 0
    interrupted = False
    batch_size = max(1, sink.max_batch)
    bar = _progress_bar(len(letters))
    try:
        for i in range(0, len(letters), batch_size):
            chunk = letters[i : i + batch_size]
            ids = [dl.id for dl in chunk]
            attempt = 0
            while True:
                result = sink.send([dl.record for dl in chunk if dl.record is not None])
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
            bar.update(len(chunk))
    except KeyboardInterrupt:
        failed = len(letters) - sent  # the rest are still dead letters: nothing was removed early
        interrupted = True
    except Exception as exc:  # a store fault or a sink that raises: what was not delivered stays
        failed = len(letters) - sent
        print(f"sefwd: replay stopped: {type(exc).__name__}: {exc}; the {failed} dead letter(s) not delivered "
              "are kept", file=sys.stderr)
    finally:
        bar.close()
        sink.close()
        store.close()
    failed += len(damaged)
    _counts(sink_name, sent, failed, json_out)
    if interrupted:
        print("sefwd: interrupted (Ctrl-C); the rest are still dead letters", file=sys.stderr)
        return 130
    return 0 if failed == 0 else 1
