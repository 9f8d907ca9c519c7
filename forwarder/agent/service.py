"""Wire the agent together from a Config and run it until stopped."""
from __future__ import annotations

import logging
import os
import threading
from datetime import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING

from forwarder import __version__
from forwarder.agent.config import Config
from forwarder.delivery.dispatcher import Dispatcher
from forwarder.errors import ConfigError, ImdsError, ImdsTimeout, ImdsUnreachable, StateError
from forwarder.agent.extension_heartbeat import HeartbeatFile
from forwarder.agent.gc_sweep import GcSweep
from forwarder.imds.identity import VmIdentity
from forwarder.imds.client import ImdsClient
from forwarder.agent.poller import Poller
from forwarder.agent.preflight import check_start
from forwarder.records import RecordFactory, rfc3339, utcnow
from forwarder.common.retry import Backoff
from forwarder.store.recovery import Loss, lock_state_dir, open_agent_store
from forwarder.sinkapi import Sink, SinkContext, load_sink_factory
from forwarder.agent.status import StatusReporter, format_age
from forwarder.store.database import DB_FILE, SavedState, Store
from forwarder.agent.telemetry import NO_TELEMETRY, AgentTelemetry, create_telemetry
from forwarder.store.outbox import StoreOutbox
from forwarder.agent.waiting import WaitNotice, imds_trouble

if TYPE_CHECKING:  # imported at run time only when approvals are configured
    from forwarder.approval.approver import Approver
    from forwarder.approval.runner import ActionRunner
    from forwarder.approval.callback import ApprovalRequest, CallbackServer, Verdict
    from forwarder.approval.refusals import RefusalAggregator
    from forwarder.agent.probe import Maintenance
    from forwarder.agent.maintenance import MaintenanceTracker, MaintenanceView
    from forwarder.protect.runtime import Protection

log = logging.getLogger(__name__)


def build_sinks(config: Config, stop: threading.Event, *, pretty: bool = False) -> dict[str, Sink]:
    """Instantiate every configured sink (imports its module only now)."""
    sinks: dict[str, Sink] = {}
    problems: list[str] = []
    for sc in config.sinks:
        try:
            factory = load_sink_factory(sc.type)
            ctx = SinkContext(name=sc.name, state_dir=config.state.dir / "sinks" / sc.name, stop=stop, pretty=pretty)
            sinks[sc.name] = factory(sc.options, ctx)
        except (LookupError, ImportError, ValueError, OSError) as exc:
            problems.append(f"sink {sc.name!r} ({sc.type}): {exc}")
    if problems:
        for sink in sinks.values():
            sink.close()
        raise ConfigError(problems)
    return sinks


def resolve_identity(imds: ImdsClient, state: SavedState) -> VmIdentity:
    """Instance metadata at start; the saved identity if IMDS cannot say (ids must stay stable)."""
    try:
        vm = VmIdentity.from_compute(imds.compute())
        if vm.known:
            return vm
        log.warning("instance metadata carries no vmId/resourceId")
    except ImdsError as exc:
        log.warning("could not read instance metadata: %s", exc)
    if state.vm:
        return VmIdentity.from_dict(state.vm)
    return VmIdentity.fallback()


def _report_state_changes(reporter: StatusReporter, tracker: MaintenanceTracker
                          ) -> Callable[[MaintenanceView, datetime], None]:
    """A maintenance listener: a new probe state (or event) is in the status report at once, so
    `sefwd status` shows a maintenance when the probe does, not up to the reporter's 5 s later. It
    only pokes the reporter: the write happens on the reporter's thread, not the poller's."""

    def key(view: MaintenanceView) -> tuple[str, str | None]:
        return view.state, view.event.event_id if view.event else None

    last = [key(tracker.view())]  # (the report written at start has this state already)

    def listener(view: MaintenanceView, now: datetime) -> None:
        if key(view) != last[0]:
            last[0] = key(view)
            reporter.poke()

    return listener


class Agent:
    """The running service: one poller, its state, its sinks."""

    def __init__(self, config: Config, *, stop: threading.Event | None = None, pretty: bool = False) -> None:
        self.config = config
        self.stop = stop or threading.Event()
        self.pretty = pretty
        self.poller: Poller | None = None
        self.dispatcher: Dispatcher | None = None
        self.approver: Approver | None = None
        self.actions: ActionRunner | None = None
        self.callback: CallbackServer | None = None
        self.telemetry: AgentTelemetry = NO_TELEMETRY
        self.ready = threading.Event()
        self.loss: Loss | None = None
        self.refusals: RefusalAggregator | None = None
        self.waiting_since: datetime | None = None  # until IMDS first answered (status: "waiting for IMDS")
        self.maintenance: Maintenance | None = None  # [probe] or telemetry: forwarder.agent.probe
        self.imds: ImdsClient | None = None
        self.protection: Protection | None = None  # [protect]: this VM's hold (forwarder.protect)

    def waiting_message(self) -> str:
        imds = self.config.imds
        waited = (utcnow() - self.waiting_since).total_seconds() if self.waiting_since is not None else 0.0
        still = f"still waiting for IMDS at {imds.endpoint} after {format_age(waited)}" if waited >= 1 else \
            f"waiting for IMDS at {imds.endpoint}"
        trouble = self.imds_trouble()
        if trouble:  # refused, unroutable, an error status: not the slow first call, so say what it is
            return f"{still}: {trouble}; retrying"
        return f"{still}; the first answer can take up to {format_age(imds.first_call_timeout)}"

    def imds_trouble(self) -> str | None:
        """The IMDS client's latest failure other than a timeout (None while none, or once answered)."""
        return imds_trouble(self.imds) if self.imds is not None and not self._answered() else None

    def _answered(self) -> bool:
        return self.poller is not None and self.poller.stats.last_ok_wall is not None

    def _start_delivery(self, store: Store) -> Dispatcher:
        """The sinks, and a dispatcher delivering the store's records to them."""
        cfg = self.config
        # The sinks' stop is the end of delivery (the dispatcher's halt, after the drain), not the agent's
        # stop: during the drain a sink must still send what is left, and only then cut its waits short.
        halt = threading.Event()
        sinks = self.telemetry.instrument_sinks(build_sinks(cfg, halt, pretty=self.pretty))
        backoff = Backoff(
            initial=cfg.delivery.retry_initial,
            maximum=cfg.delivery.retry_max,
            retry_after_cap=cfg.delivery.retry_after_cap,
        )
        dispatcher = Dispatcher(store, sinks, backoff=backoff, max_age={s.name: s.max_age for s in cfg.sinks},
                                filters={s.name: s.filter for s in cfg.sinks}, halt=halt,
                                stuck_after=cfg.agent.degraded_after)
        dispatcher.start()
        return dispatcher

    def _start_approvals(self, poller: Poller, store: Store) -> None:
        """Policy, hooks and the callback server, only when configured (none is by default)."""
        ap = self.config.approval
        if not (ap.rules or ap.hooks or ap.callback):
            return
        from forwarder.approval.approver import Approver
        from forwarder.approval.planner import Planner
        from forwarder.approval.runner import ActionRunner

        # Actions: planned in the poller's commits, run by workers from the store (also the callback's
        # approvals a crash left posting, resolved by asking IMDS).
        planner = Planner(ap, lambda: poller.factory.vm, store)
        poller.plan = planner.plan
        if self.protection is not None:  # the hold is planned first; an approval after hooks waits for its enter
            planner.gate_for = self.protection.gate_for
            poller.plan = self.protection.chain(planner.plan)
        if poller.current is not None:  # resumed: the saved document may hold events never acted on
            document = poller.current
            planner.reconsider(document, lambda change: poller.factory.preview(change, document), store.approved)
        # Each worker its own IMDS client: a client's pooled connections are not shared.
        self.actions = ActionRunner(ap, store, lambda: ImdsClient.from_config(self.config.imds, stop=self.stop),
                                    lambda: poller.factory.vm, self.stop,
                                    on_outcome=self.telemetry.action_finished).start()
        poller.on_changes = self.actions.wake
        poller.on_checked = self.actions.checked  # recovered rows run after the first poll checked them
        if self.protection is not None:
            wake_actions, wake_hold = self.actions.wake, self.protection.wake

            def wake_both(*args: object) -> None:
                wake_hold()
                wake_actions()

            poller.on_changes = wake_both
        # Its own IMDS client: approvals run on other threads, and a client's pooled connections are not shared.
        client = ImdsClient.from_config(self.config.imds, stop=self.stop)
        self.approver = approver = Approver(ap, client, lambda: poller.factory.vm, poller.submit_audit,
                                            self.config.state.dir, self.stop)
        approver.actions = store  # callback approvals: an action row marked posting before the POST
        if ap.callback is not None:
            from forwarder.approval.approver import audit_entry
            from forwarder.approval.callback import CallbackServer, Verdict
            from forwarder.approval.refusals import RefusalAggregator

            def decide(request: ApprovalRequest) -> Verdict:
                attempt = approver.approve(request.event_ids, actor="callback", approver=request.approver,
                                           client=request.client, reason=request.reason)
                return Verdict(attempt.status, attempt.answer())

            def submit(fields: dict[str, object]) -> None:
                poller.submit_audit(audit_entry(str(fields.get("Outcome") or "refused"), "callback",
                                                str(fields.get("Reason") or "refused"),
                                                **{k: v for k, v in fields.items() if k not in ("Outcome", "Actor", "Reason")}))

            # One approval.refused record per reason and client per window, with a count: a flood
            # of refused requests cannot fill the store or push real events out.
            self.refusals = refusals = RefusalAggregator(submit, self.stop)
            refusals.start()
            self.callback = CallbackServer(ap.callback, decide, refusals.submit, self.config.state.dir / DB_FILE,
                                           identity=lambda: poller.factory.vm.source).start()
            log.info("approval callback listening on %s", self.callback.url)

    def snapshot(self, dispatcher: Dispatcher, poller: Poller) -> dict[str, object]:
        st = poller.stats
        data = dispatcher.snapshot()
        if self.loss is not None:
            data["data_lost"] = self.loss.record_data()
        data["imds"] = {
            "endpoint": self.config.imds.endpoint,
            "waiting_since": rfc3339(self.waiting_since) if st.last_ok_wall is None else None,
            # While waiting: what is wrong besides slowness; once answered: the error of failing polls.
            "last_error": self.imds_trouble() if st.last_ok_wall is None else (
                str(self.imds.last_error) if st.consecutive_failures and self.imds is not None
                and self.imds.last_error is not None else None),
            "api_version": poller.factory.api_version,
            "polls": st.polls,
            "imds_errors": st.imds_errors,
            "bad_documents": st.bad_documents,
            "cycle_errors": st.cycle_errors,
            "consecutive_failures": st.consecutive_failures,
            "last_poll_ok": rfc3339(st.last_ok_wall),
            "outbox_errors": st.outbox_errors,
            "bad_audits": st.bad_audits,
        }
        if self.protection is not None:
            data["protect"] = self.protection.status()
        if self.maintenance is not None and self.config.probe.enabled:
            view = self.maintenance.tracker.view().as_dict()
            del view["seconds_left"]  # "until" says it, and the report is rewritten only when something changes
            data["maintenance"] = view
        return data

    def _identity(self, imds: ImdsClient, state: SavedState) -> VmIdentity | None:
        """This VM's identity before any record. While nothing answers at the IMDS address (refused,
        unroutable, timing out) and none was saved, keep asking rather than make one up; None when
        stopped first. An IMDS that answers without an identity still gives the host-name fallback."""
        while True:
            vm = resolve_identity(imds, state)
            if vm.known or state.vm:
                return vm
            if self.stop.is_set():
                return None
            if not isinstance(imds.last_error, (ImdsUnreachable, ImdsTimeout)):
                return vm
            if self.stop.wait(1.0):  # (each round already retried with backoff; never a busy loop)
                return None

    def _open_store(self) -> tuple[Store, SavedState] | None:
        """The store, retried while the disk refuses (full, I/O errors): no crash loop; None if stopped."""
        cfg = self.config
        attempt = 0
        while True:
            try:
                store, self.loss = open_agent_store(cfg.state.dir, fsync=cfg.journal.fsync, max_size=cfg.journal.max_size)
                try:
                    return store, store.load_state()
                except StateError:
                    store.close()
                    raise
            except StateError as exc:
                delay = min(30.0, 1.0 * 2 ** attempt)
                attempt += 1
                log.error("cannot open the store, retrying in %.0fs: %s", delay, exc)
                if self.stop.wait(delay):
                    return None

    def run(self) -> int:
        """Until stopped: 0 once stopped cleanly, 1 if stopped before the store could be opened."""
        rc = self._run()
        if rc == 0:
            log.info("sefwd stopped")
        return rc

    def _run(self) -> int:
        cfg = self.config
        lock = lock_state_dir(cfg.state.dir)  # first: a second agent on this state dir is told so, not "port in use"
        try:
            check_start(cfg)  # a busy port stops the agent here, before any "started" (StartError, exit 1)
            opened = self._open_store()
            if opened is None:
                return 1
            store, state = opened
            resumed = state.document is not None
            imds = self.imds = ImdsClient.from_config(cfg.imds, stop=self.stop)
            # Before the sinks are built, so they can be observed; a no-op unless [telemetry] is set.
            telemetry = self.telemetry = create_telemetry(cfg.telemetry, cfg.state.dir)
            dispatcher = self.dispatcher = self._start_delivery(store)
            # From the first second, say what we wait for (instance metadata, then the first poll
            # can each take long): on stderr every 30 s, and in the status report for `sefwd status`.
            self.waiting_since = utcnow()
            early = StatusReporter(store, lambda: {"imds": {"endpoint": cfg.imds.endpoint,
                                                            "waiting_since": rfc3339(self.waiting_since),
                                                            "last_error": self.imds_trouble()}}, self.stop)
            early.write()
            reporter: StatusReporter | None = None

            def say(line: str) -> None:  # a cause (refused, unroutable) is a warning, and in the status at once
                log.log(logging.WARNING if self.imds_trouble() else logging.INFO, "%s", line)
                if reporter is None:
                    early.write()
                else:
                    reporter.poke()

            # The first line after half a second: by then a refused or unroutable endpoint is known and named.
            notice = WaitNotice(say, self.waiting_message, done=self._answered, stop=self.stop, first=0.5,
                                cause=self.imds_trouble).start()
            heartbeat_file: HeartbeatFile | None = None
            try:
                vm = self._identity(imds, state)
                if vm is None:  # stopped before IMDS ever answered: no record with a made-up identity
                    log.info("stopped before IMDS answered; no record written")
                    return 0
                factory = RecordFactory(vm, cfg.imds.api_version, sequence=state.sequence, key=cfg.agent.record_key)
                self.poller = poller = Poller(
                    telemetry.instrument_imds(imds), state, factory, telemetry.instrument_outbox(StoreOutbox(store)),
                    poll_interval=cfg.imds.poll_interval,
                    heartbeat=cfg.agent.heartbeat,
                    compute_refresh=cfg.imds.compute_refresh,
                    stop=self.stop,
                )
                log.info(
                    "sefwd %s started: VM %s, IMDS %s (api-version %s, every %.3gs), state %s, sinks %s",
                    __version__, vm.source, cfg.imds.endpoint, cfg.imds.api_version,
                    cfg.imds.poll_interval, cfg.state.dir, ", ".join(s.name for s in cfg.sinks),
                )
                poller.emit_lifecycle(
                    "started", Resumed=resumed, Pid=os.getpid(), Sinks=[s.name for s in cfg.sinks],
                    PollIntervalSeconds=cfg.imds.poll_interval,
                )
                # A loss found at start (self.loss) is announced by the poller's first turn: its
                # forwarder.data_lost record waits in the store's inbox until it commits.
                if cfg.protect is not None:
                    from forwarder.protect.runtime import Protection

                    protection = self.protection = Protection(
                        cfg.protect, store, lambda: poller.factory.vm, self.stop, state_dir=cfg.state.dir,
                        dry_run=cfg.approval.dry_run, output_limit=cfg.approval.hook_output_limit,
                        env_allow=cfg.approval.hook_env)
                    protection.reconcile(poller.current)  # the hold the saved document calls for
                    poller.plan = protection.chain(None)
                    poller.on_changes = protection.wake
                self._start_approvals(poller, store)
                if self.protection is not None:  # after the action runner's recovery of running rows
                    self.protection.start()
                reporter = StatusReporter(store, lambda: self.snapshot(dispatcher, poller), self.stop,
                                          interval=cfg.agent.status_interval)
                reporter.write()
                reporter.start()
                GcSweep(self.stop).start()  # memory that levels off (forwarder.agent.gc_sweep)
                poller.on_first_answer = reporter.write  # "waiting for IMDS" ends in the report at once
                if cfg.agent.heartbeat_file is not None:  # set by the Azure VM extension
                    heartbeat_file = HeartbeatFile(cfg.agent.heartbeat_file, lambda: self.snapshot(dispatcher, poller),
                                                   self.stop).start()
                if cfg.probe.enabled or telemetry.enabled:
                    from forwarder.agent.probe import Maintenance

                    maintenance = self.maintenance = Maintenance.from_config(
                        cfg.probe, lambda: poller.factory.vm, cfg.state.dir,
                        refresh=max(10.0, cfg.imds.poll_interval + cfg.imds.timeout)).start(poller.current)
                    poller.on_document = maintenance.tracker.observe
                    telemetry.bind(maintenance=maintenance.tracker)
                    if cfg.probe.enabled:
                        maintenance.tracker.add_listener(_report_state_changes(reporter, maintenance.tracker))
                telemetry.bind(snapshot=dispatcher.snapshot, poller=poller)
                telemetry.start()
                self.ready.set()
                poller.run()
                notice.close()
                if self.callback is not None:  # no new approvals once stopping
                    self.callback.stop()
                    self.callback = None
                if self.refusals is not None:
                    self.refusals.flush(force=True)
                if self.actions is not None:  # hooks terminated, their rows left to run again at the next start
                    self.actions.close()
                if self.protection is not None:  # (stop is set: a running transition is cut, to run again)
                    self.protection.close()
                poller.drain_inbox()
                # Stopping: the stopped record must still get out, so do not let `stop` abort it.
                poller.emit_lifecycle("stopped", Reason="shutdown", UptimeSeconds=poller.heartbeat_data()["UptimeSeconds"])
            finally:
                notice.close()
                if self.maintenance is not None:
                    self.maintenance.stop()
                if self.callback is not None:
                    self.callback.stop()
                if self.actions is not None:
                    self.stop.set()
                    self.actions.close()
                if self.protection is not None:
                    self.stop.set()
                    self.protection.close()
                if self.approver is not None:
                    self.approver.imds.close()
                dispatcher.close(cfg.agent.drain_timeout)
                telemetry.stop()  # after the drain, so the last deliveries are counted
                imds.close()
                if self.poller is not None:
                    StatusReporter(store, lambda: self.snapshot(dispatcher, poller), self.stop).write(stopped=True)
                if heartbeat_file is not None:
                    heartbeat_file.close()
                store.close()
        finally:
            if lock is not None:
                os.close(lock)
        return 0

