"""``sefwd emulator``: run the IMDS emulator, list scenarios, or drive a running one (``ctl``)."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

import orjson

from forwarder.imds.event_types import EVENT_TYPES
from forwarder.emulator.faults import FAULT_KINDS, FAULT_PATHS, OUT_OF_RANGE_FIELDS
from forwarder.errors import ForwarderError, UsageError
from forwarder.common.values import parse_duration, parse_size

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:8169"


def time_scale(text: str) -> float:
    """``--time-scale``: a finite number, 0 or more (0: every real-time delay at once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, got {text!r}")
    return value


def register(subparsers: Any, prog: str | None = None) -> None:
    """Add the ``emulator`` subcommand (and its ``ctl`` client) to an argparse subparsers object;
    ``prog`` names the command in usage lines (``python -m forwarder.emulator``)."""
    name = prog or "sefwd emulator"
    p = subparsers.add_parser(
        "emulator", help="run the Azure IMDS emulator (Scheduled Events, instance compute, managed identity)",
        description="Serve a faithful IMDS on loopback. The default VM is at the root; every VM also at\n"
                    "/vm/<name>. With 'ctl URL ACTION', drive a running emulator instead (see 'ctl --help').",
        usage=f"{name} [options]\n       {name} ctl URL ACTION [...]",
        epilog="examples:\n"
               f"  {name} --scenario host-maintenance-reboot\n"
               f"  {name} --list-scenarios\n"
               f"  {name} ctl http://127.0.0.1:8169 schedule --type Reboot --start-after 5m\n\n"
               "exit codes: 0 ok (also after Ctrl-C or SIGTERM), 1 failure (busy port, emulator not reachable), "
               "2 usage error",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **({"prog": prog} if prog else {}),
    )
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                   help=f"address to bind (default {DEFAULT_LISTEN}; port 0 picks a free one)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --listen address (the emulator has no authentication)")
    p.add_argument("--scenario", metavar="NAME|FILE", help="built-in scenario name or scenario TOML file")
    p.add_argument("--list-scenarios", action="store_true", help="print the built-in scenarios and exit")
    p.add_argument("--json", action="store_true", help="with --list-scenarios: one JSON object per scenario")
    p.add_argument("--vm", action="append", dest="vms", metavar="NAME",
                   help="an emulated VM (repeatable; the first is the default VM at the root prefix)")
    p.add_argument("--rate-limit", type=float, default=5, metavar="N",
                   help="requests per second per VM before 429 (default 5; 0 disables)")
    p.add_argument("--time-scale", type=time_scale, default=1.0, metavar="F",
                   help="multiply every real-time delay of the timeline (0.5 runs twice as fast)")
    p.add_argument("--first-call-delay", default=None, metavar="DURATION",
                   help='delay of the first Scheduled Events call per VM (real IMDS: up to "2m"; default 0)')
    p.add_argument("--terminate-notice", default=None, metavar="DURATION",
                   help='NotBefore notice of Terminate events (5m to 15m; default "5m")')
    p.add_argument("--etag", action="store_true", help="send ETag and answer If-None-Match with 304")
    p.add_argument("--eventgrid-url", default=None, metavar="URL",
                   help="also push every change of an event to URL as Event Grid ScheduledEventEmitted events "
                        "(after the subscription validation handshake), as the platform's system topic does")
    p.add_argument("--max-api-version", default=None, metavar="VERSION",
                   help="newest Scheduled Events api-version served; newer ones answer 404 as where they are "
                        "not available (e.g. 2020-07-01: no 2024-07-09)")
    p.add_argument("--arm-tls", nargs=2, metavar=("CERT", "KEY"),
                   help="also serve Azure Resource Manager scheduled-event acknowledgement over HTTPS with this "
                        "certificate and key (PEM), on the --listen host")
    p.add_argument("--arm", action="store_true",
                   help="also serve Azure Resource Manager acknowledgement over HTTPS with a certificate made now "
                        "(a throwaway CA), and print the export lines `sefwd approve --via arm` needs")
    p.add_argument("--arm-port", type=int, default=0, metavar="PORT",
                   help="with --arm or --arm-tls: its port (default: any free)")
    p.add_argument("--exit-when-finished", action="store_true",
                   help="exit 0 once the scenario's last step ran and its events are gone")
    csub = p.add_subparsers(dest="emulator_command", title="control a running emulator (optional)",
                            metavar="ctl URL ACTION")
    c = csub.add_parser("ctl", help="control a running emulator through its /_emulator/ API", prog=f"{name} ctl",
                        description="Drive a running emulator through its /_emulator/ API; prints the answer as JSON.",
                        epilog=f"examples:\n  {name} ctl http://127.0.0.1:8169 state\n"
                               f"  {name} ctl http://127.0.0.1:8169 fault status --status 500 --count 3",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("url", help="base URL of the emulator, e.g. http://127.0.0.1:8169")
    actions = c.add_subparsers(dest="ctl_action", metavar="ACTION")
    actions.required = True
    actions.add_parser("state", help="print events, incarnation and counters as JSON")
    s = actions.add_parser("schedule", help="add an event")
    s.add_argument("--type", default="Reboot", choices=list(EVENT_TYPES))
    s.add_argument("--id", help="EventId (default: a new GUID)")
    s.add_argument("--source", choices=["Platform", "User"])
    s.add_argument("--description")
    s.add_argument("--duration", type=int, help="DurationInSeconds (-1 unknown)")
    s.add_argument("--resources", nargs="+", metavar="VM", help="VM names in Resources")
    s.add_argument("--not-before", help='RFC 1123 / ISO time, or "+15m" from now')
    s.add_argument("--start-after", help='shorthand for --not-before +DELAY (unapproved, it starts at NotBefore)')
    s.add_argument("--complete-after", help="remove this long after Started")
    s.add_argument("--started", action="store_true", help="appear already Started (hardware failure)")
    for action in ("start", "cancel", "complete"):
        a = actions.add_parser(action, help=f"{action} an event now" + (" (ignores NotBefore)" if action == "start" else ""))
        a.add_argument("event_id")
    ap = actions.add_parser("approve", help="approve an event as a VM of the availability set would")
    ap.add_argument("event_id")
    ap.add_argument("--vm", help="the approving VM (default: the last in Resources)")
    u = actions.add_parser("update", help="change fields of an event")
    u.add_argument("event_id")
    u.add_argument("--description")
    u.add_argument("--duration", type=int)
    u.add_argument("--resources", nargs="+", metavar="VM")
    u.add_argument("--not-before")
    u.add_argument("--start-after")
    f = actions.add_parser("fault", help="inject a fault (every kind of the control API, with its options)")
    f.add_argument("kind", choices=FAULT_KINDS)
    f.add_argument("--count", type=int, default=1, help="matching responses it serves (default 1)")
    f.add_argument("--status", type=int, help="status: the HTTP status (default 500); html: default 200")
    f.add_argument("--retry-after", help="status: the Retry-After header (429 defaults to 1)")
    f.add_argument("--delay", help="slow/hang: how long; drip: between bytes (1s); interim: between 1xx answers (100ms)")
    f.add_argument("--vm", help="only this VM's requests (default any)")
    f.add_argument("--path", default="scheduledevents", choices=FAULT_PATHS, help="which endpoint (default scheduledevents)")
    f.add_argument("--method", help="only this HTTP method")
    f.add_argument("--size", type=_size, help='oversized: the answer\'s size, e.g. "64MiB" (the default) or bytes')
    f.add_argument("--chunked", action="store_true", help="oversized: chunked, without a Content-Length")
    f.add_argument("--depth", type=int, help="nested: nesting levels of the unknown field (default 10000)")
    f.add_argument("--statuses", type=_statuses, metavar="CODES",
                   help="interim: the 1xx answers sent first, comma-separated (default 100,103)")
    f.add_argument("--field", choices=OUT_OF_RANGE_FIELDS, help="out_of_range: which values (default all)")
    actions.add_parser("reset", help="drop events, faults and counters")
    sc = actions.add_parser("scenario", help="run a scenario (built-in name or a file on the emulator's host)")
    sc.add_argument("name")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _statuses(text: str) -> list[int]:
    try:
        return [int(code) for code in text.replace(" ", "").split(",") if code]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 1xx codes separated by commas, e.g. 100,103, got {text!r}") from None


def _setup_logging(level_name: str | None) -> None:
    level = getattr(logging, (level_name or "info").upper(), logging.INFO)
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(stream=sys.stderr, level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    else:
        root.setLevel(level)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``sefwd emulator``; returns the exit code."""
    if getattr(args, "emulator_command", None) == "ctl":
        return _ctl(args)
    from forwarder.emulator.scenario import builtin_scenarios, load_scenario
    from forwarder.emulator.server import Emulator
    from forwarder.common.listen import host_port_text, parse_listen
    from forwarder.common.loopback import is_loopback

    if args.list_scenarios:
        for name in builtin_scenarios():
            if getattr(args, "json", False):
                print(orjson.dumps({"name": name, "description": load_scenario(name).description}).decode())
            else:
                print(f"{name:26} {load_scenario(name).description}")
        return 0
    try:
        host, port = parse_listen(args.listen, bare_port_host="127.0.0.1")
    except ValueError as exc:
        raise UsageError([f"--listen: {exc}"]) from None
    if not is_loopback(host) and not args.allow_remote:
        raise UsageError([f"--listen {args.listen} is not a loopback address: add --allow-remote to expose "
                           "the emulator (it has no authentication) to the network"])
    problems = []
    timings: dict[str, float | None] = {}
    for key in ("first_call_delay", "terminate_notice"):
        value = getattr(args, key)
        try:
            timings[key] = parse_duration(value) if value is not None else None
        except ValueError as exc:
            problems.append(f"--{key.replace('_', '-')}: {exc}")
    if args.arm and args.arm_tls:
        problems.append("--arm makes its own certificate: give --arm or --arm-tls CERT KEY, not both")
    if args.eventgrid_url is not None and not args.eventgrid_url.startswith(("http://", "https://")):
        problems.append(f"--eventgrid-url: must be an http(s) URL, got {args.eventgrid_url!r}")
    if args.max_api_version is not None:
        from forwarder.emulator.model import SE_VERSIONS

        if args.max_api_version not in SE_VERSIONS:
            problems.append(f"--max-api-version: must be one of {', '.join(SE_VERSIONS)}, got {args.max_api_version!r}")
    if args.arm_tls:
        from forwarder.common.listen import tls_server_context

        try:
            tls_server_context(*args.arm_tls)
        except OSError as exc:  # ssl.SSLError included; never the files' content
            problems.append(f"--arm-tls: cannot load the certificate and key: {exc.strerror or type(exc).__name__}")
    if problems:
        raise UsageError(problems)
    _setup_logging(getattr(args, "log_level", None))
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    arm_tls = tuple(args.arm_tls) if args.arm_tls else None
    made = None
    if args.arm:
        from forwarder.emulator.arm_certs import make_arm_certificate

        try:
            made = make_arm_certificate()
        except ImportError as exc:
            raise UsageError([str(exc)]) from None
        arm_tls = (str(made.cert), str(made.key))
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        emulator = Emulator(host, port, scenario=args.scenario, vms=args.vms, rate_limit=args.rate_limit or None,
                            time_scale=args.time_scale, first_call_delay=timings["first_call_delay"],
                            terminate_notice=timings["terminate_notice"], etag=args.etag,
                            max_api_version=args.max_api_version,
                            arm_tls=arm_tls, arm_port=args.arm_port)
        try:
            emulator.start()
        except OSError as exc:  # a busy port, a missing permission: one line, not a traceback
            raise ForwarderError(f"cannot listen on {host_port_text(host, port)}: {exc.strerror or exc}") from None
        if args.eventgrid_url:
            emulator.publish_to(args.eventgrid_url)
        try:
            print(f"IMDS emulator at {emulator.url} (default VM {emulator.default_vm}; "
                  f"others at {emulator.url}/vm/<name>; control API {emulator.url}/_emulator/state)",
                  file=sys.stderr, flush=True)
            if arm_tls is not None:
                from forwarder.emulator.arm_certs import export_lines

                print(f"Azure Resource Manager at {emulator.arm_url} (tokens from {emulator.url}"
                      "/metadata/identity/oauth2/token)", file=sys.stderr, flush=True)
                vm = emulator.default_vm
                resource = str(emulator.stats()["vms"][vm]["resourceId"])
                # On stdout, alone: what a person pastes, or a script reads (`eval`), into another shell.
                print("\n".join(export_lines(emulator.url, emulator.arm_url, made.ca if made else None, resource)),
                      flush=True)
            while not stop.is_set():
                if args.exit_when_finished and emulator.finished.is_set():
                    log.info("scenario finished, exiting")
                    break
                stop.wait(0.2)
        finally:
            emulator.stop()
        if stop.is_set():  # Ctrl-C or SIGTERM: the usual way to stop a server, so exit 0
            print("IMDS emulator stopped", file=sys.stderr, flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if made is not None:
            made.remove()
    return 0


def _ctl_request(base: str, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    import urllib.error
    import urllib.request  # only `emulator ctl` needs an HTTP client

    data = orjson.dumps(body) if body is not None else None
    req = urllib.request.Request(base.rstrip("/") + "/_emulator/" + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status, orjson.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        payload = exc.read()
        try:
            return exc.code, orjson.loads(payload)
        except orjson.JSONDecodeError:
            return exc.code, {"error": payload.decode(errors="replace")}
    except (urllib.error.URLError, OSError) as exc:
        raise ForwarderError(f"emulator at {base} not reachable: {exc}") from None


def _ctl(args: argparse.Namespace) -> int:
    action = args.ctl_action
    if action == "state":
        status, out = _ctl_request(args.url, "GET", "state")
    elif action == "schedule":
        spec = {k: v for k, v in {
            "id": args.id, "type": args.type, "source": args.source, "description": args.description,
            "duration": args.duration, "resources": args.resources, "not_before": args.not_before,
            "start_after": args.start_after, "complete_after": args.complete_after,
            "status": "Started" if args.started else None,
        }.items() if v is not None}
        status, out = _ctl_request(args.url, "POST", "events", spec)
    elif action in ("start", "cancel", "complete"):
        status, out = _ctl_request(args.url, "POST", f"events/{args.event_id}/{action}", {})
    elif action == "approve":
        body = {"vm": args.vm} if args.vm else {}
        status, out = _ctl_request(args.url, "POST", f"events/{args.event_id}/approve", body)
    elif action == "update":
        fields = {k: v for k, v in {
            "description": args.description, "duration": args.duration, "resources": args.resources,
            "not_before": args.not_before, "start_after": args.start_after,
        }.items() if v is not None}
        status, out = _ctl_request(args.url, "POST", f"events/{args.event_id}/update", fields)
    elif action == "fault":
        spec = {k: v for k, v in {
            "kind": args.kind, "count": args.count, "status": args.status, "retry_after": args.retry_after,
            "delay": args.delay, "vm": args.vm, "path": args.path, "method": args.method, "size": args.size,
            "chunked": args.chunked or None, "depth": args.depth, "statuses": args.statuses, "field": args.field,
        }.items() if v is not None}
        status, out = _ctl_request(args.url, "POST", "faults", spec)
    elif action == "reset":
        status, out = _ctl_request(args.url, "POST", "reset", {})
    else:
        status, out = _ctl_request(args.url, "POST", "scenario", {"name": args.name})
    sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0 if status < 400 else 1
