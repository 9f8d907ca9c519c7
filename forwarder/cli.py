"""The ``sefwd`` command line."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from forwarder import __version__
from forwarder.errors import ConfigError, ForwarderError

if TYPE_CHECKING:
    from forwarder.config import ImdsConfig
    from forwarder.imds import ImdsClient
    from forwarder.store import SavedState

log = logging.getLogger("forwarder")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_BAD_DOCUMENT = 3
EXIT_DEGRADED = 4  # `sefwd status`: the agent runs, but something needs attention
IMDS_TURN_LOCK = "imds-turn.lock"  # in the state dir: one-shot commands that call IMDS take turns


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="FILE", help="config file (default: $SEFWD_CONFIG, then /etc/sefwd/config.toml, then built-in defaults)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sefwd",
        description="Forward Azure Scheduled Events (IMDS) as durable CloudEvents records.",
    )
    parser.add_argument("--version", action="version", version=f"sefwd {__version__}")
    parser.add_argument("--log-level", default=None, help="debug, info, warning or error (default: from config, info)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("demo", help="run a built-in scenario on the embedded IMDS emulator, records to stdout")
    _add_config_arg(p)
    p.add_argument("--scenario", default="demo", help="built-in scenario name or scenario file (default: demo)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--pretty", action="store_true", default=None, help="human-readable lines (default on a terminal)")
    fmt.add_argument("--json", dest="pretty", action="store_false", help="one JSON record per line")
    p.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds (default 120)")

    p = sub.add_parser("run", help="run the agent (the service)")
    _add_config_arg(p)
    p.add_argument("--pretty", action="store_true", help="human-readable stdout sink output")

    p = sub.add_parser("once", help="poll IMDS once and print the current events as records")
    _add_config_arg(p)
    p.add_argument("--pretty", action="store_true", help="human-readable lines")

    from forwarder.emulator.cli import register as register_emulator

    register_emulator(sub)

    p = sub.add_parser("approve", help="approve events now (POST StartRequests to IMDS), audited")
    _add_config_arg(p)
    p.add_argument("event_ids", nargs="+", metavar="EVENT_ID")
    p.add_argument("--reason", help="why (kept in the audit record)")
    p.add_argument("--scope", choices=("self", "leader", "any", "self_or_leader"),
                   help="override [approval] scope for this approval (say 'any' to approve an event of several VMs from a non-leader)")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")

    p = sub.add_parser("status", help="backlog, dead letters and last poll per sink, current events")
    _add_config_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("deadletter", help="inspect and re-send records a sink rejected")
    dsub = p.add_subparsers(dest="deadletter_command", metavar="ACTION")
    dsub.required = True
    d = dsub.add_parser("list", help="list dead letters (of one sink, or all)")
    _add_config_arg(d)
    d.add_argument("sink", nargs="?", help="sink name")
    d.add_argument("--json", action="store_true", help="one JSON object per line")
    d = dsub.add_parser("replay", help="send a sink's dead letters again; what fails again stays a dead letter")
    _add_config_arg(d)
    d.add_argument("sink", help="sink name")
    d.add_argument("--timeout", type=float, default=300.0, help="give up retrying after this many seconds (default 300)")

    p = sub.add_parser("config", help="validate the config or print an annotated example")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION")
    csub.required = True
    c = csub.add_parser("check", help="validate; lists every problem")
    _add_config_arg(c)
    csub.add_parser("example", help="print an annotated example config")
    return parser


def _setup_logging(args: argparse.Namespace, config_level: str | None = None) -> None:
    from forwarder.logutil import setup_logging

    setup_logging(args.log_level or config_level or "info")


def _install_signals(stop: threading.Event) -> None:
    """First SIGTERM/SIGINT: stop gracefully. Second: exit at once (state on disk stays valid)."""

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            os._exit(128 + signum)
        log.info("received %s, shutting down (send again to exit at once)", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    if hasattr(signal, "SIGXFSZ"):  # a file-size limit must be an EFBIG we handle, not a silent death
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def cmd_run(args: argparse.Namespace) -> int:
    from forwarder.config import load_config
    from forwarder.service import Agent

    config = load_config(args.config)
    _setup_logging(args, config.agent.log_level)
    stop = threading.Event()
    _install_signals(stop)
    return Agent(config, stop=stop, pretty=args.pretty).run()


def cmd_once(args: argparse.Namespace) -> int:
    from forwarder.config import load_config
    from forwarder.differ import diff
    from forwarder.document import parse_document
    from forwarder.errors import DocumentError, ImdsError
    from forwarder.records import RecordFactory, utcnow
    from forwarder.service import resolve_identity

    config = load_config(args.config)
    _setup_logging(args, config.agent.log_level)
    imds = _cli_imds(config.imds)
    with _imds_turn(config.state.dir):  # beside other one-shot commands (docs/imds-transport.md)
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
            from forwarder.identity import VmIdentity

            vm = VmIdentity.fallback()
    try:
        document = parse_document(fetch.body or b"")
        factory = RecordFactory(vm, config.imds.api_version)
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
    from sinks.stdout import render_pretty

    out = sys.stdout.buffer
    for r in records:
        if pretty:
            out.write(render_pretty(r.to_dict()).encode() + b"\n")  # type: ignore[attr-defined]
        else:
            out.write(r.body + b"\n")  # type: ignore[attr-defined]
    out.flush()


def cmd_demo(args: argparse.Namespace) -> int:
    from forwarder.config import SinkConfig, load_config
    from forwarder.emulator import Emulator, load_scenario
    from forwarder.service import Agent

    config = load_config(args.config) if args.config else load_config(None, env={}, system_path=None)
    _setup_logging(args, "warning" if not args.log_level else None)
    pretty = sys.stdout.isatty() if args.pretty is None else args.pretty
    scenario = load_scenario(args.scenario)
    stop = threading.Event()
    _install_signals(stop)
    with tempfile.TemporaryDirectory(prefix="sefwd-demo-") as tmp, Emulator(scenario=scenario) as emulator:
        sinks = config.sinks if args.config else (SinkConfig(type="stdout", name="stdout", options={}),)
        approval = config.approval
        if not approval.rules:
            from forwarder.approval.policy import DEMO_RULES

            approval = dataclasses.replace(approval, rules=DEMO_RULES)
        config = dataclasses.replace(
            config,
            approval=approval,
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
        finished = emulator.wait_finished(args.timeout)
        if finished and agent.ready.wait(10) and agent.poller is not None:
            # One more poll after the scenario ended, so the last removal is seen.
            agent.poller.wait_for_polls(agent.poller.stats.polls + 2, 10)
        stop.set()
        runner.join(30)
        if not finished:
            print("sefwd demo: the scenario did not finish in time", file=sys.stderr)
            return EXIT_FAILURE
        return result.get("rc", EXIT_FAILURE)


def cmd_approve(args: argparse.Namespace) -> int:
    import getpass

    import orjson

    from forwarder.approval.approver import APPROVED, Approver
    from forwarder.config import load_config
    from forwarder.identity import VmIdentity
    from forwarder.service import resolve_identity
    from forwarder.store import Store

    config = load_config(args.config)
    _setup_logging(args, config.agent.log_level)

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
    with _imds_turn(config.state.dir):
        imds = _cli_imds(config.imds)
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


def _cli_imds(cfg: ImdsConfig) -> ImdsClient:
    """An IMDS client for a one-shot command beside the agent: the 1 request per window it leaves."""
    from forwarder.imds import CLI_REQUEST_BUDGET, ImdsClient, RequestBudget

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
    path = state_dir / IMDS_TURN_LOCK
    fd = -1
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):  # (a reader of a state dir it cannot write)
        try:
            fd = os.open(path, flags, 0o640)
            break
        except OSError:
            continue
    if fd < 0:
        log.debug("no IMDS turn lock at %s; going ahead alone", path)
        yield
        return
    from forwarder.imds import BUDGET_WINDOW

    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            last = float(os.pread(fd, 32, 0) or b"0")
        except (OSError, ValueError):
            last = 0.0
        pause = min(BUDGET_WINDOW, last + BUDGET_WINDOW - time.time())
        if pause > 0:
            time.sleep(pause)  # rate pacing: the previous command's last request is still in its window
        try:
            yield
        finally:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, repr(time.time()).encode(), 0)
            except OSError:
                pass  # a read-only file: the next command may start within this window
    finally:
        os.close(fd)


def _saved_state(state_dir: Path) -> SavedState:
    """The agent's saved state (its VM identity) for a one-shot command; empty when unreadable."""
    from forwarder.store import DB_FILE, SavedState, Store

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

    from forwarder.config import load_config
    from forwarder.status import format_status, health, read_status

    config = load_config(args.config)
    status = read_status(config.state.dir)
    state, reasons = health(status)
    status["health"] = {"state": state, "reasons": reasons}
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(status, option=orjson.OPT_INDENT_2) + b"\n")
    else:
        print(format_status(status))
    # Scripts can trust the code: 0 healthy, 1 not running, 4 running but degraded.
    return {"healthy": EXIT_OK, "not_running": EXIT_FAILURE}.get(state, EXIT_DEGRADED)


def cmd_deadletter(args: argparse.Namespace) -> int:
    from forwarder.config import load_config
    from forwarder.store import DB_FILE, Store

    config = load_config(args.config)
    if args.deadletter_command == "list":
        import orjson

        configured = [s.name for s in config.sinks]
        store = Store.open(config.state.dir) if (config.state.dir / DB_FILE).is_file() else None
        try:
            counts = store.dead_counts() if store is not None else {}
            # A sink no longer configured may still hold dead letters; any other name is a typo.
            if args.sink is not None and args.sink not in configured and args.sink not in counts:
                print(f"sefwd: no sink named {args.sink!r} (configured: {', '.join(configured) or 'none'})",
                      file=sys.stderr)
                return EXIT_CONFIG
            letters = store.dead_letters(args.sink) if store is not None else []
        finally:
            if store is not None:
                store.close()
        for dl in letters:
            if args.json:
                obj = {"sink": dl.sink, "time": dl.time, "reason": dl.reason, "detail": dl.detail, "record": dl.record.to_dict()}
                sys.stdout.buffer.write(orjson.dumps(obj) + b"\n")
            else:
                e = dl.record.to_dict()
                print(f"{dl.sink}\t{dl.time}\t{dl.reason}\t{e.get('type')}\t{e.get('id')}\t{e.get('subject', '')}\t{dl.detail[:80]}")
        print(f"{len(letters)} dead letter(s)", file=sys.stderr)
        return EXIT_OK
    from forwarder.replay import replay

    return replay(config, args.sink, timeout=args.timeout)


def cmd_config(args: argparse.Namespace) -> int:
    from forwarder.config import EXAMPLE_CONFIG, describe, load_config

    if args.config_command == "example":
        sys.stdout.write(EXAMPLE_CONFIG)
        return EXIT_OK
    config = load_config(args.config)
    print(describe(config))
    print("config OK", file=sys.stderr)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
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
        if args.command == "emulator":
            from forwarder.emulator.cli import run as run_emulator

            return run_emulator(args)
    except ConfigError as exc:
        print(f"sefwd: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except ForwarderError as exc:
        print(f"sefwd: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:
        return EXIT_OK
    parser.error(f"unknown command {args.command!r}")
    return EXIT_CONFIG
