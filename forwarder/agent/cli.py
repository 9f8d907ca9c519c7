"""The ``sefwd`` command line."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from forwarder.agent.version_info import VersionAction
from forwarder.errors import ConfigError, ForwarderError, UsageError

if TYPE_CHECKING:
    from forwarder.emulator import Emulator
    from forwarder.agent.poller import Poller
    from forwarder.agent.service import Agent
    from forwarder.store.database import SavedState
    from forwarder.agent.config import ImdsConfig
    from forwarder.imds.client import ImdsClient

log = logging.getLogger("forwarder")

# One-shot commands (`once`, `approve`) say what they wait for when IMDS has not answered after this
# many seconds (their IMDS request budget alone can space two or three requests over about 3 s);
# $SEFWD_WAIT_NOTICE_AFTER (seconds) sets another delay, e.g. for tests.
WAIT_NOTICE_AFTER = 5.0


def _wait_notice_after() -> float:
    """$SEFWD_WAIT_NOTICE_AFTER when it is a finite number of seconds (negative counts as 0), else 5."""
    try:
        value = float(os.environ["SEFWD_WAIT_NOTICE_AFTER"])
    except (KeyError, ValueError):
        return WAIT_NOTICE_AFTER
    return WAIT_NOTICE_AFTER if math.isnan(value) or value == math.inf else max(0.0, value)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_BAD_DOCUMENT = 3
EXIT_DEGRADED = 4  # `sefwd status`: the agent runs, but something needs attention
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it
IMDS_TURN_LOCK = "imds-turn.lock"  # in the state dir: one-shot commands that call IMDS take turns
_TURN_WIDTH = 32  # the turn file holds one time, space-padded to this width


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="FILE", help="config file (default: $SEFWD_CONFIG, then /etc/sefwd/config.toml, then built-in defaults)")


EXIT_CODES = ("exit codes: 0 ok, 1 failure (unreachable endpoint, missing permission, bad path), "
              "2 config or usage error, 130 Ctrl-C")


def _command(sub: argparse._SubParsersAction, name: str, summary: str, description: str, examples: str,
             exit_codes: str = EXIT_CODES) -> argparse.ArgumentParser:
    """A subcommand with a one-line summary (in ``sefwd --help``), a description and examples."""
    return sub.add_parser(name, help=summary, description=description,
                          epilog=f"examples:\n{examples}\n\n{exit_codes}",
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sefwd",
        description="Forward Azure Scheduled Events (IMDS) as durable CloudEvents records.",
        epilog="Try it without Azure: sefwd demo. Help on one command: sefwd COMMAND --help.\n"
               "exit codes: 0 ok, 1 failure, 2 config or usage error, 3 bad IMDS document (once), "
               "4 degraded (status), 130 Ctrl-C",
    )
    parser.add_argument("--version", action=VersionAction)
    parser.add_argument("--log-level", default=None, help="debug, info, warning or error (default: from config, info)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = _command(sub, "demo", "run a built-in scenario on the embedded IMDS emulator, records to stdout",
                 "Start the IMDS emulator with a scenario, run the agent against it with a temporary state "
                 "dir, print every record, and stop when the scenario is over (or at Ctrl-C) with a summary line.",
                 "  sefwd demo\n  sefwd demo --scenario spot-preempt --json | jq .type\n"
                 "  sefwd emulator --list-scenarios     # the scenarios there are")
    _add_config_arg(p)
    p.add_argument("--scenario", default="demo", help="built-in scenario name or scenario file (default: demo)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--pretty", action="store_true", default=None, help="human-readable lines (default on a terminal)")
    fmt.add_argument("--json", dest="pretty", action="store_false", help="one JSON record per line")
    p.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds (default 120)")
    from forwarder.emulator.cli import time_scale

    p.add_argument("--time-scale", type=time_scale, default=1.0, metavar="F",
                   help="multiply every real-time delay of the scenario (default 1; 0.5 runs twice as fast)")

    p = _command(sub, "run", "run the agent (the service)",
                 "Poll IMDS, store every change as a CloudEvents record and deliver it to the configured "
                 "sinks, until SIGTERM or Ctrl-C. Until IMDS first answers it says what it waits for.",
                 "  sefwd run                          # /etc/sefwd/config.toml, or $SEFWD_CONFIG\n"
                 "  sefwd run -c ./config.toml --log-level debug",
                 "exit codes: 0 stopped (SIGTERM or Ctrl-C; a second one exits at once), 1 failure, "
                 "2 config error")
    _add_config_arg(p)
    p.add_argument("--pretty", action="store_true", help="human-readable stdout sink output")
    p.add_argument("--dry-run", action="store_true",
                   help="plan, audit and log every hook and approval, perform none ([approval] dry_run = true)")

    p = _command(sub, "once", "poll IMDS once and print the current events as records",
                 "One GET of the Scheduled Events document, printed as records (one JSON line each) "
                 "on stdout; changes no state.",
                 "  sefwd once\n  sefwd once --pretty",
                 "exit codes: 0 ok, 1 IMDS not reachable, 2 config error, 3 IMDS answered a document "
                 "sefwd cannot read, 130 Ctrl-C")
    _add_config_arg(p)
    p.add_argument("--pretty", action="store_true", help="human-readable lines")

    from forwarder.emulator.cli import register as register_emulator

    register_emulator(sub)
    from forwarder.agent.keys_cli import register as register_keys

    register_keys(sub)

    p = _command(sub, "approve", "approve events now (POST StartRequests to IMDS), audited",
                 "Ask IMDS to start scheduled events now, within [approval] scope; every attempt "
                 "becomes an approval.* record. The result is printed on stdout.",
                 "  sefwd approve 602d9444-d2cd-49c7-8624-8643e7171297 --reason 'drained'\n"
                 "  sefwd approve ID1 ID2 --scope any --json\n"
                 "  sefwd approve ID --via arm --resource-id /subscriptions/S/resourceGroups/RG/providers/"
                 "Microsoft.Compute/virtualMachines/VM",
                 "exit codes: 0 approved, 1 refused or failed, 2 config error, 130 Ctrl-C")
    _add_config_arg(p)
    p.add_argument("event_ids", nargs="+", metavar="EVENT_ID")
    p.add_argument("--reason", help="why (kept in the audit record)")
    p.add_argument("--scope", choices=("self", "leader", "any", "self_or_leader"),
                   help="override [approval] scope for this approval (say 'any' to approve an event of several VMs from a non-leader)")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    from forwarder.agent.approve_arm import add_arguments as add_arm_arguments

    add_arm_arguments(p)

    p = _command(sub, "status", "backlog, dead letters and last poll per sink, current events",
                 "Read the agent's state dir (works with the agent up or down) and say whether it runs "
                 "and is healthy.",
                 "  sefwd status\n  sefwd status --json | jq .health",
                 "exit codes: 0 healthy, 1 not running (or state unreadable), 2 config error, "
                 "4 running but degraded (the reasons are on the health line)")
    _add_config_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = _command(sub, "deadletter", "inspect and re-send records a sink rejected",
                 "Records a sink refused for good are kept as dead letters, per sink.",
                 "  sefwd deadletter list\n  sefwd deadletter list hook --json\n  sefwd deadletter replay hook")
    dsub = p.add_subparsers(dest="deadletter_command", metavar="ACTION")
    dsub.required = True
    d = _command(dsub, "list", "list dead letters (of one sink, or all)",
                 "One line per dead letter: sink, time, reason, type, id, subject, detail.",
                 "  sefwd deadletter list\n  sefwd deadletter list hook --json | jq .record.id",
                 "exit codes: 0 ok, 1 state unreadable, 2 unknown sink name or config error")
    _add_config_arg(d)
    d.add_argument("sink", nargs="?", help="sink name")
    d.add_argument("--json", action="store_true", help="one JSON object per line")
    d = _command(dsub, "replay", "send a sink's dead letters again; what fails again stays a dead letter",
                 "Send one sink's dead letters again, retrying transient failures until --timeout.",
                 "  sefwd deadletter replay hook\n  sefwd deadletter replay hook --timeout 60 --json")
    _add_config_arg(d)
    d.add_argument("sink", help="sink name")
    d.add_argument("--timeout", type=float, default=300.0, help="give up retrying after this many seconds (default 300)")
    d.add_argument("--json", action="store_true", help='print {"sink": ..., "replayed": N, "still_dead": M} on stdout')

    p = _command(sub, "config", "validate the config or print an annotated example",
                 "Check a config file (every problem at once) or print an example with every key.",
                 "  sefwd config check -c ./config.toml\n  sefwd config example > config.toml")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION")
    csub.required = True
    c = _command(csub, "check", "validate; lists every problem",
                 "Load the config as the agent would (file, then SEFWD_* environment overrides) and list "
                 "every problem, or print the effective settings.",
                 "  sefwd config check\n  sefwd config check -c ./config.toml --json",
                 "exit codes: 0 valid, 2 invalid (every problem is listed)")
    _add_config_arg(c)
    c.add_argument("--json", action="store_true",
                   help='print {"valid": ..., "source": ..., "problems": [...]} on stdout')
    c = _command(csub, "show", "print the effective settings; needs no secret",
                 "Print what the config sets (file, then SEFWD_* overrides) without needing the sinks' "
                 "secrets: a problem outside [state] is listed as a warning, not an error.",
                 "  sefwd config show -c /etc/sefwd/config.toml\n  sefwd config show --json | jq .state_dir",
                 "exit codes: 0 shown (warnings included), 2 the file or [state] is invalid")
    _add_config_arg(c)
    c.add_argument("--json", action="store_true",
                   help='print {"source", "state_dir", "sinks", "valid", "warnings"} on stdout')
    _command(csub, "example", "print an annotated example config",
             "Every key of every section and of every built-in sink, with its default; optional "
             "sections are commented out.",
             "  sefwd config example > /etc/sefwd/config.toml", "exit codes: 0 ok")
    p = _command(sub, "completion", "print a shell completion script (bash or zsh)",
                 "Print a completion script for sefwd's commands and options, generated from this parser.",
                 "  source <(sefwd completion bash)                        # this bash session\n"
                 "  sefwd completion bash > /etc/bash_completion.d/sefwd\n"
                 "  sefwd completion zsh > \"${fpath[1]}/_sefwd\"            # then: compinit",
                 "exit codes: 0 ok, 2 unknown shell")
    p.add_argument("shell", choices=("bash", "zsh"))
    return parser


def _setup_logging(args: argparse.Namespace, config_level: str | None = None) -> None:
    from forwarder.common.logs import setup_logging

    setup_logging(args.log_level or config_level or "info")


_RECEIVED: list[int] = []  # the signals that asked a foreground command to stop


def _install_signals(stop: threading.Event) -> None:
    """First SIGTERM/SIGINT: stop gracefully. Second: exit at once (state on disk stays valid)."""

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            os._exit(128 + signum)
        _RECEIVED.append(signum)
        log.info("received %s, shutting down (send again to exit at once)", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    if hasattr(signal, "SIGXFSZ"):  # a file-size limit must be an EFBIG we handle, not a silent death
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def cmd_run(args: argparse.Namespace) -> int:
    from forwarder.agent.config import load_config
    from forwarder.agent.service import Agent

    config = load_config(args.config)
    if args.dry_run:
        import dataclasses

        config = dataclasses.replace(config, approval=dataclasses.replace(config.approval, dry_run=True))
    _setup_logging(args, config.agent.log_level)
    stop = threading.Event()
    _install_signals(stop)
    return Agent(config, stop=stop, pretty=args.pretty).run()


def cmd_once(args: argparse.Namespace) -> int:
    from forwarder.agent.config import load_config
    from forwarder.imds.differ import diff
    from forwarder.imds.document import parse_document
    from forwarder.errors import DocumentError, ImdsError
    from forwarder.records import RecordFactory, utcnow
    from forwarder.agent.service import resolve_identity
    from forwarder.store.database import SavedState
    from forwarder.agent.waiting import WaitNotice

    config = load_config(args.config)
    _setup_logging(args, config.agent.log_level)
    imds = _cli_imds(config.imds)
    notice = WaitNotice(_say, f"once: waiting for IMDS at {config.imds.endpoint} (the first answer can take up "
                        f"to {config.imds.first_call_timeout:g} s; Ctrl-C gives up)", first=_wait_notice_after())
    with notice, _imds_turn(config.state.dir):  # beside other one-shot commands (docs/imds-transport.md)
        try:
            fetch = imds.scheduled_events()
        except ImdsError as exc:
            print(f"sefwd: IMDS not reachable: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        except Exception as exc:  # noqa: BLE001 - `once` answers with its exit code, never a traceback
            print(f"sefwd: IMDS not reachable: unexpected {type(exc).__name__}: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        try:
            saved = _saved_state(config.state.dir)
        except (ForwarderError, OSError):
            saved = SavedState()
        try:
            vm = resolve_identity(imds, saved)
        except Exception as exc:  # noqa: BLE001 - a broken compute answer must not hide the events
            print(f"sefwd: instance metadata unusable ({type(exc).__name__}: {exc}); using a fallback identity",
                  file=sys.stderr)
            from forwarder.imds.identity import VmIdentity

            vm = VmIdentity.fallback()
    try:
        document = parse_document(fetch.body or b"")
        factory = RecordFactory(vm, imds.api_version, key=config.agent.record_key)
        records = factory.for_changes(diff(None, document, utcnow()), document)  # (serialized here too)
    except DocumentError as exc:
        print(f"sefwd: IMDS answered with a bad document: {exc}", file=sys.stderr)
        return EXIT_BAD_DOCUMENT
    except Exception as exc:  # noqa: BLE001 - whatever the document does, the answer is exit code 3
        print(f"sefwd: IMDS answered with a document sefwd cannot handle: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return EXIT_BAD_DOCUMENT
    try:
        _print_records(records, args.pretty)
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - e.g. stdout on a full disk
        print(f"sefwd: could not print the records: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"sefwd: {len(document.events)} event(s), DocumentIncarnation {document.incarnation}", file=sys.stderr)
    return EXIT_OK


def _print_records(records: Sequence[object], pretty: bool) -> None:
    from forwarder.common.terminal import render_pretty

    out = sys.stdout.buffer
    for r in records:
        if pretty:
            out.write(render_pretty(r.to_dict()).encode() + b"\n")  # type: ignore[attr-defined]
        else:
            out.write(r.body + b"\n")  # type: ignore[attr-defined]
    out.flush()


def cmd_demo(args: argparse.Namespace) -> int:
    from forwarder.agent.config import SinkConfig, load_config, parse_config
    from forwarder.agent.demo import Narrator, notify_available, protection_config
    from forwarder.emulator import Emulator, load_scenario
    from forwarder.agent.service import Agent

    config = load_config(args.config) if args.config else load_config(None, env={}, system_path=None)
    _setup_logging(args, "warning" if not args.log_level else None)
    pretty = sys.stdout.isatty() if args.pretty is None else args.pretty
    scenario = load_scenario(args.scenario)
    stop = threading.Event()
    _install_signals(stop)
    # The scenario's clock starts at the agent's first poll: on a busy machine a slow start (imports, the hold's
    # interpreters) must not eat the seconds in which its events come and go.
    emulator_ = Emulator(scenario=scenario, time_scale=args.time_scale, start_scenario=False)
    narrator = Narrator()
    with tempfile.TemporaryDirectory(prefix="sefwd-demo-") as tmp, emulator_ as emulator:
        sinks = config.sinks if args.config else (SinkConfig(type="stdout", name="stdout", options={}),)
        approval, probe, protect = config.approval, config.probe, config.protect
        if not args.config:  # the built-in demo shows protection too: forwarder.agent.demo
            inbox = narrator.open_inbox() if notify_available() else None
            shown = parse_config({**protection_config(Path(tmp), inbox), "state": {"dir": tmp}}, {}, "sefwd demo")
            approval, probe, protect, sinks = shown.approval, shown.probe, shown.protect, shown.sinks
            if inbox is None:
                print("sefwd demo: pip install 'scheduled-events-forwarder[notify]' to see the messages people get",
                      file=sys.stderr)
        elif not approval.rules:
            from forwarder.approval.policy import DEMO_RULES

            approval = dataclasses.replace(approval, rules=DEMO_RULES)
        config = dataclasses.replace(
            config,
            approval=approval,
            probe=probe,
            protect=protect,
            imds=dataclasses.replace(config.imds, endpoint=emulator.url, poll_interval=0.5, first_call_timeout=10.0),
            state=dataclasses.replace(config.state, dir=Path(tmp) / "state"),
            agent=dataclasses.replace(config.agent, heartbeat=0.0),
            sinks=sinks,
        )
        print(f"sefwd demo: scenario {args.scenario!r} on the embedded IMDS emulator at {emulator.url}", file=sys.stderr)
        agent = Agent(config, stop=stop, pretty=pretty)
        result: dict[str, int] = {}
        runner = threading.Thread(target=lambda: result.setdefault("rc", agent.run()), name="agent", daemon=True)
        runner.start()
        if agent.ready.wait(10) and agent.maintenance is not None and agent.maintenance.probe is not None:
            agent.maintenance.tracker.add_listener(narrator.watch_probe(agent.maintenance.probe.url))
        if agent.ready.wait(args.timeout) and agent.poller is not None:
            _first_poll(agent.poller, runner, stop, args.timeout)
        emulator.run_scenario(scenario)
        finished = _wait_finished(emulator, stop, args.timeout)
        interrupted = stop.is_set()
        if finished and not interrupted and agent.ready.wait(10) and agent.poller is not None:
            # One more poll after the scenario ended, so the last removal is seen.
            agent.poller.wait_for_polls(agent.poller.stats.polls + 2, 10)
            # And until the probe serves again after the last event's settle time (the demo's is 0 s), and the
            # hold's leave ran (its protect.left is committed at the next poll).
            deadline = time.monotonic() + max(probe.settle, protect.settle if protect else 0.0) + 2
            held = not _hold_over(agent)
            while not (narrator.probe_serving() and _hold_over(agent)) and time.monotonic() < deadline \
                    and not stop.wait(0.1):
                pass
            if held:
                agent.poller.wait_for_polls(agent.poller.stats.polls + 2, 10)
        stop.set()
        runner.join(30)
        narrator.close()
        records, events = _demo_counts(agent, emulator)
        signum = _RECEIVED[-1] if _RECEIVED else signal.SIGINT
        how = ("stopped by " + ("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name) if interrupted
               else "scenario finished" if finished else "the scenario did not finish in time")
        print(f"sefwd demo: {records} record(s) about {events} event(s), {how}", file=sys.stderr)
        if interrupted:
            return 128 + signum  # 130 for Ctrl-C, as shells report it
        if not finished:
            return EXIT_FAILURE
        return result.get("rc", EXIT_FAILURE)


def _first_poll(poller: Poller, runner: threading.Thread, stop: threading.Event, timeout: float) -> None:
    """Until the agent's first poll was answered, it ended, Ctrl-C or the timeout."""
    deadline = time.monotonic() + timeout
    while runner.is_alive() and not stop.is_set() and time.monotonic() < deadline:
        if poller.wait_for_polls(1, 0.2):
            return


def _hold_over(agent: Agent) -> bool:
    """Whether this VM serves again as far as [protect] goes (or it has none): the leave ran."""
    return agent.protection is None or agent.protection.status()["state"] == "serving"


def _wait_finished(emulator: Emulator, stop: threading.Event, timeout: float) -> bool:
    """Until the scenario ended (True), Ctrl-C or the timeout (False): a stop is seen at once."""
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        if emulator.finished.is_set():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        stop.wait(min(0.1, left))
    return False


def _demo_counts(agent: Agent, emulator: Emulator) -> tuple[int, int]:
    """Records the demo's sinks got (the most any sink got) and scheduled events the scenario made."""
    dispatcher = agent.dispatcher
    records = max((w.stats.delivered for w in dispatcher.workers.values()), default=0) if dispatcher is not None else 0
    try:
        history = emulator.stats().get("history") or []
        events = len({h.get("event_id") for h in history if isinstance(h, dict) and h.get("event_id")})
    except Exception:  # noqa: BLE001 - a summary line must not fail the demo
        events = 0
    return records, events


def cmd_approve(args: argparse.Namespace) -> int:
    import getpass

    from forwarder.agent.approve_arm import check_arguments, cmd_approve_arm

    if args.via == "arm":  # from any machine with Azure credentials: no config, no IMDS
        _setup_logging(args, "warning")
        return cmd_approve_arm(args)
    check_arguments(args)

    import orjson

    from forwarder.approval.approver import APPROVED, Approver
    from forwarder.agent.config import load_config
    from forwarder.imds.client import RETRY_DEADLINE
    from forwarder.imds.identity import VmIdentity
    from forwarder.agent.service import resolve_identity
    from forwarder.store.database import Store
    from forwarder.agent.waiting import WaitNotice, imds_trouble

    config = load_config(args.config)
    # The result goes to stdout; at the default level no log line repeats it on stderr.
    _setup_logging(args, "warning")

    def audit(entry: dict[str, object]) -> None:
        # The store's inbox: the running agent commits it as a record; with no agent running, the next start does.
        config.state.dir.mkdir(parents=True, exist_ok=True)
        store = Store.open(config.state.dir)
        try:
            store.inbox_add(entry)
        finally:
            store.close()

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid:{os.getuid()}" if hasattr(os, "getuid") else "unknown"
    # IMDS request budget (docs/imds-transport.md): one request per window, the one the agent leaves
    # free, and one `sefwd approve` at a time. The agent's saved identity spares the compute GET.
    config.state.dir.mkdir(parents=True, exist_ok=True)
    # IMDS may be slow or unreachable (each call retries for up to 90 s): say so after 5 s, not nothing
    # (the request budget alone spaces its two or three requests over up to about 3 s).
    imds = _cli_imds(config.imds)

    def waiting() -> str:  # a refused or unroutable endpoint is named, not taken for a slow IMDS
        trouble = imds_trouble(imds)
        return (f"approve: waiting for IMDS at {config.imds.endpoint}: {trouble}; retrying for up to "
                f"{RETRY_DEADLINE:g} s (Ctrl-C gives up)" if trouble else
                f"approve: waiting for IMDS at {config.imds.endpoint} (retrying for up to "
                f"{RETRY_DEADLINE:g} s per request; Ctrl-C gives up)")

    with WaitNotice(_say, waiting, first=_wait_notice_after(), cause=lambda: imds_trouble(imds)), \
            _imds_turn(config.state.dir):
        try:
            saved = _saved_state(config.state.dir)
            known = VmIdentity.from_dict(saved.vm) if saved.vm else None
            vm = known if known is not None and known.known else resolve_identity(imds, saved)
            approver = Approver(config.approval, imds, lambda: vm, audit, config.state.dir, threading.Event())
            attempt = approver.approve(args.event_ids, actor="cli", approver=user, reason=args.reason,
                                       scope=args.scope)
        finally:
            imds.close()
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(attempt.answer()) + b"\n")
    else:
        for event_id in attempt.approved:
            print(f"approved {event_id}")
        for event_id in attempt.already_approved:
            print(f"already approved {event_id}")
        for event_id, why in attempt.refused.items():
            print(f"refused {event_id}: {why}")
        if attempt.detail:
            print(attempt.detail, file=sys.stderr)
    return EXIT_OK if attempt.outcome == APPROVED else EXIT_FAILURE


def _say(line: str) -> None:
    """A progress line for a person, on stderr (stdout carries results only)."""
    print(line, file=sys.stderr, flush=True)


def _cli_imds(cfg: ImdsConfig) -> ImdsClient:
    """An IMDS client for a one-shot command beside the agent: the 1 request per window it leaves."""
    from forwarder.imds.client import CLI_REQUEST_BUDGET, ImdsClient, RequestBudget

    return ImdsClient.from_config(cfg, budget=RequestBudget(CLI_REQUEST_BUDGET))


@contextlib.contextmanager
def _imds_turn(state_dir: Path) -> Iterator[None]:
    """One-shot commands calling IMDS (`approve`, `once`) take turns: their budget is one for all.

    An exclusive flock on a file in the state dir, held while the command talks to IMDS (all its
    requests have deadlines, so a wait is bounded). The file holds when the last holder finished;
    the next one starts a budget window after it, so two commands' requests never share a window.
    Without flock (Windows), or without a file the command may open, it goes ahead alone.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    from forwarder.common.owned_files import UnsafeFileError, open_owned, owned_by_me

    path = state_dir / IMDS_TURN_LOCK
    fd = -1
    # Never a link, a FIFO or someone else's file: root runs this in the service user's directory.
    for write, create in ((True, True), (False, False)):  # (a reader of a state dir it cannot write)
        try:
            fd, created = open_owned(state_dir, IMDS_TURN_LOCK, write=write, create=create)
            break
        except UnsafeFileError as exc:
            log.warning("IMDS turn lock %s: %s; going ahead alone", path, exc.strerror)
            break
        except OSError:
            continue
    if fd < 0:
        log.debug("no IMDS turn lock at %s; going ahead alone", path)
        yield
        return
    from forwarder.imds.client import BUDGET_WINDOW

    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            last = float(os.pread(fd, _TURN_WIDTH, 0).strip() or b"0")
        except (OSError, ValueError):
            last = 0.0
        pause = min(BUDGET_WINDOW, last + BUDGET_WINDOW - time.time())
        if pause > 0:
            time.sleep(pause)  # rate pacing: the previous command's last request is still in its window
        try:
            yield
        finally:
            try:
                if created or owned_by_me(fd):  # another user's file is overwritten in place, never truncated
                    os.ftruncate(fd, 0)
                os.pwrite(fd, repr(time.time()).encode().ljust(_TURN_WIDTH), 0)
            except OSError:
                pass  # a read-only file: the next command may start within this window
    finally:
        os.close(fd)


def _saved_state(state_dir: Path) -> SavedState:
    """The agent's saved state (its VM identity) for a one-shot command; empty when unreadable."""
    from forwarder.store.database import DB_FILE, SavedState, Store

    if not (state_dir / DB_FILE).is_file():
        return SavedState()
    try:
        store = Store.open(state_dir)
        try:
            return store.load_state()
        finally:
            store.close()
    except ForwarderError:
        return SavedState()


def cmd_status(args: argparse.Namespace) -> int:
    import orjson

    from forwarder.agent.read_view import load_for_reading
    from forwarder.agent.status import format_status, health, read_status

    view = load_for_reading(args.config)  # the state dir only: no sink secret needed
    status = read_status(view.state_dir)
    state, reasons = health(status)
    status["health"] = {"state": state, "reasons": reasons}
    status["config_warnings"] = list(view.warnings)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(status, option=orjson.OPT_INDENT_2) + b"\n")
    else:
        print(format_status(status))
    # Scripts can trust the code: 0 healthy, 1 not running, 4 running but degraded.
    return {"healthy": EXIT_OK, "not_running": EXIT_FAILURE}.get(state, EXIT_DEGRADED)


def cmd_deadletter(args: argparse.Namespace) -> int:
    from forwarder.agent.config import load_config
    from forwarder.store.database import DB_FILE, Store

    if args.deadletter_command == "list":
        import orjson

        from forwarder.agent.read_view import load_for_reading

        view = load_for_reading(args.config)  # the state dir only: no sink secret needed
        _warn_config(view.warnings)
        configured = list(view.sink_names)
        store = Store.open(view.state_dir) if (view.state_dir / DB_FILE).is_file() else None
        try:
            counts = store.dead_counts() if store is not None else {}
            # A sink no longer configured may still hold dead letters; any other name is a typo.
            if args.sink is not None and args.sink not in configured and args.sink not in counts:
                problem = f"no sink named {args.sink!r} (configured: {', '.join(configured) or 'none'})"
                return _failed(args, "usage", problem, [problem], EXIT_CONFIG)
            letters = store.dead_letters(args.sink) if store is not None else []
        finally:
            if store is not None:
                store.close()
        for dl in letters:
            if dl.record is None:  # damaged: shown with its reason and raw bytes, never blocking the rest
                if args.json:
                    raw = {"sink": dl.sink, "time": dl.time, "reason": dl.reason, "detail": dl.detail, "record": None,
                           "damaged": dl.damage, "raw": dl.raw_text(), "raw_bytes": len(dl.raw)}
                    sys.stdout.buffer.write(orjson.dumps(raw) + b"\n")
                else:
                    print(f"{dl.sink}\t{dl.time}\t{dl.reason}\tdamaged\t{dl.damage}\t{dl.raw_text(80)!r}")
            elif args.json:
                obj = {"sink": dl.sink, "time": dl.time, "reason": dl.reason, "detail": dl.detail, "record": dl.record.to_dict()}
                sys.stdout.buffer.write(orjson.dumps(obj) + b"\n")
            else:
                e = dl.record.to_dict()
                print(f"{dl.sink}\t{dl.time}\t{dl.reason}\t{e.get('type')}\t{e.get('id')}\t{e.get('subject', '')}\t{dl.detail[:80]}")
        print(f"{len(letters)} dead letter(s)", file=sys.stderr)
        return EXIT_OK
    from forwarder.delivery.resend import replay

    config = load_config(args.config)
    return replay(config.sinks, config.state.dir, args.sink, timeout=args.timeout, json_out=args.json)


def cmd_config(args: argparse.Namespace) -> int:
    from forwarder.agent.config import describe, load_config
    from forwarder.agent.config_example import shipped

    if args.config_command == "example":
        sys.stdout.write(shipped())
        return EXIT_OK
    if args.config_command == "show":
        return _config_show(args)
    if args.json:
        import orjson

        try:
            config = load_config(args.config)
        except ConfigError as exc:
            answer = {"valid": False, "source": args.config, "problems": exc.problems}
            sys.stdout.buffer.write(orjson.dumps(answer, option=orjson.OPT_INDENT_2) + b"\n")
            return EXIT_CONFIG
        answer = {"valid": True, "source": config.source, "problems": []}
        sys.stdout.buffer.write(orjson.dumps(answer, option=orjson.OPT_INDENT_2) + b"\n")
        return EXIT_OK
    config = load_config(args.config)
    print(describe(config))
    print("config OK", file=sys.stderr)
    return EXIT_OK


def _warn_config(warnings: Sequence[str]) -> None:
    """A read-only command's config problems (a sink's secret not set, say): said, never fatal."""
    for problem in warnings:
        print(f"sefwd: warning: config: {problem}", file=sys.stderr)


def _config_show(args: argparse.Namespace) -> int:
    """The effective settings; a missing secret (or any problem outside [state]) is a warning."""
    from forwarder.agent.config import describe
    from forwarder.agent.read_view import load_for_reading

    view = load_for_reading(args.config)
    if args.json:
        import orjson

        answer = {"source": view.source, "state_dir": str(view.state_dir), "sinks": list(view.sink_names),
                  "valid": view.config is not None, "warnings": list(view.warnings)}
        sys.stdout.buffer.write(orjson.dumps(answer, option=orjson.OPT_INDENT_2) + b"\n")
        return EXIT_OK
    if view.config is not None:
        print(describe(view.config))
    else:
        print(f"source: {view.source}\nstate: {view.state_dir}\nsinks ({len(view.sink_names)}): "
              + ", ".join(view.sink_names))
        for problem in view.warnings:
            print(f"warning: {problem}")
    return EXIT_OK


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab

    sys.stdout.write(shtab.complete(build_parser(), args.shell) + "\n")
    return EXIT_OK


def _os_problem(exc: OSError) -> str:
    """One line for an OSError a user can cause (a missing permission, a bad path, a busy port)."""
    import errno

    what = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is not None:
        what = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 is not None else "") + f": {what}"
    if exc.errno in (errno.EACCES, errno.EPERM):
        what += " (run as the user that owns the agent's files, or with sudo)"
    return what


def _dispatch(args: argparse.Namespace) -> int | None:
    if args.command == "run":
        return cmd_run(args)
    if args.command == "once":
        return cmd_once(args)
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "config":
        return cmd_config(args)
    if args.command == "approve":
        return cmd_approve(args)
    if args.command == "status":
        return cmd_status(args)
    if args.command == "deadletter":
        return cmd_deadletter(args)
    if args.command == "completion":
        return cmd_completion(args)
    if args.command == "keys":
        from forwarder.agent.keys_cli import run as run_keys

        return run_keys(args)
    if args.command == "emulator":
        from forwarder.emulator.cli import run as run_emulator

        return run_emulator(args)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Every failure a user can cause ends as one line on stderr and a documented exit code:
    0 ok, 1 failure, 2 config or usage, 3 bad document (``once``), 4 degraded (``status``), 130 Ctrl-C.
    """
    args: argparse.Namespace | None = None
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        rc = _dispatch(args)
    except UsageError as exc:
        if args is None:  # argparse refused the line: --json still asks for a JSON answer
            args = argparse.Namespace(json="--json" in (sys.argv[1:] if argv is None else argv))
        return _failed(args, "usage", str(exc), exc.problems, EXIT_CONFIG)
    except ConfigError as exc:
        return _failed(args, "config", str(exc), exc.problems, EXIT_CONFIG)
    except ForwarderError as exc:
        return _failed(args, "failure", str(exc), [], EXIT_FAILURE)
    except KeyboardInterrupt:
        return _failed(args, "interrupted", "interrupted (Ctrl-C)", [], EXIT_INTERRUPTED)
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_OK
    except OSError as exc:
        return _failed(args, "failure", _os_problem(exc), [], EXIT_FAILURE)
    except Exception as exc:  # noqa: BLE001 - a bug still gets one line; the traceback only at debug level
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            import traceback

            traceback.print_exc()
        return _failed(args, "unexpected", f"unexpected error: {type(exc).__name__}: {exc} "
                       "(run with --log-level debug to see where)", [], EXIT_FAILURE)
    if rc is None:
        parser.error(f"unknown command {args.command!r}")
    return rc


def _failed(args: argparse.Namespace | None, kind: str, message: str, problems: list[str], rc: int) -> int:
    """One line on stderr; with ``--json`` also one JSON document on stdout, so a script always gets one."""
    print(f"sefwd: {message}", file=sys.stderr)
    if args is not None and getattr(args, "json", False) is True:
        import orjson

        answer = {"error": {"kind": kind, "message": message, "problems": problems}, "exit_code": rc}
        try:
            sys.stdout.buffer.write(orjson.dumps(answer, option=orjson.OPT_INDENT_2) + b"\n")
            sys.stdout.flush()
        except (OSError, ValueError):
            pass  # a closed stdout: the stderr line and the code still tell
    return rc


class _Parser(argparse.ArgumentParser):
    """argparse, but a wrong command line is a UsageError: one path for exit 2 and the ``--json`` answer."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        raise UsageError([message])


def _quiet_stdout() -> None:
    """After a closed pipe (``sefwd ... | head``), do not fail again flushing stdout at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
