"""The hold inside the running agent: planned in the poller's commits, run by its own worker, shown in status."""
from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from forwarder.imds.differ import STARTED, Change
from forwarder.imds.document import Document, Event
from forwarder.imds.identity import VmIdentity
from forwarder.protect import hold
from forwarder.protect.settings import ProtectConfig
from forwarder.protect.worker import HoldWorker, hold_dir
from forwarder.sinkapi import Record
from forwarder.store.database import Store

log = logging.getLogger(__name__)

PlanFn = Callable[[sqlite3.Connection, list[Change], list[Record], Document], list[dict[str, Any]]]


class Protection:
    """This VM's hold: ``plan`` (the poller's transaction), ``gate_for`` (approvals), the worker, ``status``."""

    def __init__(self, config: ProtectConfig, store: Store, vm: Callable[[], VmIdentity], stop: threading.Event, *,
                 state_dir: Path, dry_run: bool = False, output_limit: int = 4096, env_allow: Sequence[str] = (),
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.store = store
        self.vm = vm
        self.dry_run = dry_run
        self.clock = clock
        # Before any other worker starts: transitions a crash left running are due again.
        recovered = HoldWorker.recover(store, clock(), hold_dir(state_dir))
        if recovered:
            log.warning("protect: %d transition(s) were running when the agent stopped: taking them up again", recovered)
        self.worker = HoldWorker(config, store, stop, output_limit=output_limit, env_allow=env_allow,
                                 hold_dir=hold_dir(state_dir), clock=clock)

    def plan(self, c: sqlite3.Connection, changes: list[Change], records: list[Record],
             document: Document) -> list[dict[str, Any]]:
        """The poller's planning step: the hold follows the committed document."""
        started = [change.event.event_id for change in changes if change.kind == STARTED]
        return hold.plan(c, document, self.vm(), self.config, now=self.clock(), dry_run=self.dry_run, started=started)

    def chain(self, then: PlanFn | None) -> PlanFn:
        """The hold first (an approval planned next can wait for its enter), then ``then`` (the approval planner)."""
        def plan(c: sqlite3.Connection, changes: list[Change], records: list[Record],
                 document: Document) -> list[dict[str, Any]]:
            entries = self.plan(c, changes, records, document)
            return entries + (then(c, changes, records, document) if then is not None else [])
        return plan

    def reconcile(self, document: Document | None) -> None:
        """At start, on the saved document: the hold as it should be (the config may have changed since)."""
        with self.store.transaction() as c:
            for entry in hold.plan(c, document, self.vm(), self.config, now=self.clock(), dry_run=self.dry_run):
                self.store.inbox_put(c, entry)

    def gate_for(self, c: sqlite3.Connection, event: Event) -> int | None:
        return hold.gate(c, event, self.vm(), self.config, self.dry_run)

    def status(self) -> dict[str, Any]:
        with self.store.transaction() as c:
            return hold.status(c, self.dry_run)

    def start(self) -> Protection:
        self.worker.start()
        return self

    def wake(self, *_: object) -> None:
        self.worker.wake()

    def close(self) -> None:
        self.worker.close()
