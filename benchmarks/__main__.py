"""`python -m benchmarks [--quick] [--only NAME] [--record]`: run the benchmarks, print a table, write results JSON
and plots (to the ignored benchmarks/results/tmp/, or with --record to the committed benchmarks/results/)."""
from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from benchmarks.common import MODES, machine_info, results_file
from benchmarks.footprint import HOSTILE_RETURN_MIB, HOSTILE_RSS_GOAL_MIB
from benchmarks.plots import draw

BENCHMARKS = ("poll_cost", "footprint", "latency", "journal", "backlog", "fleet", "eventhubs_send", "probe",
              "approver_state", "action_wakeup", "notice_window", "hold")
# Run only when named (--only): an hour by default.
ON_REQUEST = ("soak",)


def _at(value: Any, path: str) -> Any:
    """The value at dotted ``path`` inside nested dicts, or None."""
    for key in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _get(results: dict[str, Any], path: str) -> Any:
    """``"bench.a.b"`` inside ``results[bench]["figures"]``, or None."""
    name, _, rest = path.partition(".")
    return _at(results.get(name, {}).get("figures"), rest)


# The headline figures, named as in the performance issue, and where each benchmark keeps them.
SUMMARY: dict[str, dict[str, str] | str] = {
    "cpu_ms_per_poll": {"sefwd": "poll_cost.cpu_ms_per_poll.sefwd", "seed_sample": "poll_cost.cpu_ms_per_poll.seed_sample"},
    "rss_mib": {"stdout_only": "footprint.rss_mib.stdout_only", "all_sinks": "footprint.rss_mib.all_sinks"},
    "startup_ms": "footprint.startup_ms.stdout_only",
    # A stdout-only agent while IMDS serves oversized, nested, out-of-range and huge documents (issue 11).
    "hostile_rss_mib": {"baseline": "footprint.hostile_rss_mib.baseline_mib", "peak": "footprint.hostile_rss_mib.peak_mib",
                        "after": "footprint.hostile_rss_mib.after_mib"},
    "detection_latency_ms": {"p50": "latency.detection_latency_ms.p50", "p99": "latency.detection_latency_ms.p99",
                             "poll_interval_ms": "latency.detection_latency_ms.poll_interval_ms"},
    "processing_latency_ms": {"p50": "latency.processing_latency_ms.p50", "p99": "latency.processing_latency_ms.p99"},
    "journal": {"append_rps": "journal.sefwd_rec_per_s.append_batched", "drain_rps": "journal.sefwd_rec_per_s.drain",
                "append_single_rps": "journal.sefwd_rec_per_s.append_single",
                "fsync_floor_rps": "journal.fsync_floor_rec_per_s",
                "persist_queue_append_rps": "journal.persist_queue_rec_per_s.put",
                "persist_queue_drain_rps": "journal.persist_queue_rec_per_s.drain"},
    "backlog_100k_webhook_s": "backlog.projected_s_for_100k.batch_100",
    "fleet": {"agents": "fleet.agents", "cpu_percent": "fleet.cpu_percent", "rss_mib_each": "fleet.rss_mib_each.median",
              "eventhubs_records": "fleet.eventhubs_records", "unique_eventkeys": "fleet.unique_eventkeys"},
    # The Event Hubs sink's CPU per record in a burst, beside the thread-per-send sink it replaced.
    "eventhubs_cpu_ms_per_record": {
        "burst_amqp": "eventhubs_send.cpu_ms_per_record.after.amqp.burst",
        "burst_websocket": "eventhubs_send.cpu_ms_per_record.after.websocket.burst",
        "previous_burst_amqp": "eventhubs_send.cpu_ms_per_record.before.amqp.burst",
        "previous_burst_websocket": "eventhubs_send.cpu_ms_per_record.before.websocket.burst",
        "single_amqp": "eventhubs_send.cpu_ms_per_record.after.amqp.single",
        "single_websocket": "eventhubs_send.cpu_ms_per_record.after.websocket.single"},
    # The maintenance probe (issue 24): one answer's round trip, and how soon it turns 503 after an event appears.
    "probe": {"answer_p50_ms": "probe.answer_ms.p50", "answer_p99_ms": "probe.answer_ms.p99",
              "route_p99_us": "probe.route_us.p99", "flip_p50_ms": "probe.flip_ms.p50",
              "flip_p99_ms": "probe.flip_ms.p99", "poll_interval_ms": "probe.flip_ms.poll_interval_ms"},
    # The remote approver with its state on Azure Table Storage (Azurite): records/s by 1, 2 and 4 instances (issue 29).
    "approver_records_per_s": {"sqlite_1": "approver_state.records_per_s.sqlite_1",
                               "table_1": "approver_state.records_per_s.table_1",
                               "table_2": "approver_state.records_per_s.table_2",
                               "table_4": "approver_state.records_per_s.table_4"},
    # A due action's wake-up with every other worker busy, the workers' wait before and after issue 28's fix.
    "action_wakeup_ms": {"before_p99": "action_wakeup.workers_8.descheduled.before.p99_ms",
                         "after_p99": "action_wakeup.workers_8.descheduled.after.p99_ms",
                         "before_missed": "action_wakeup.workers_8.descheduled.before.missed_wakeups",
                         "after_missed": "action_wakeup.workers_8.descheduled.after.missed_wakeups"},
    # Against the notice window (issue 33): from the agent's histograms on /metrics (docs/notice-window.md).
    "notice_window": {"detection_p50_ms": "notice_window.detection_latency_ms.p50",
                      "detection_p99_ms": "notice_window.detection_latency_ms.p99",
                      "delivery_p50_ms": "notice_window.delivery_latency_ms.histogram_p50",
                      "delivery_p99_ms": "notice_window.delivery_latency_ms.histogram_p99"},
    # This VM's hold (issue 28): event in IMDS → the drain (enter) starts, with other hooks busy.
    "hold": {"enter_start_p50_ms": "hold.enter_start_ms.p50", "enter_start_p99_ms": "hold.enter_start_ms.p99",
             "poll_interval_ms": "hold.enter_start_ms.poll_interval_ms", "other_hooks_running": "hold.other_hooks_running"},
}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, where in SUMMARY.items():
        if isinstance(where, str):
            value = _get(results, where)
            if value is not None:
                out[key] = value
        else:
            sub = {k: _get(results, p) for k, p in where.items()}
            if any(v is not None for v in sub.values()):
                out[key] = sub
    return out


def _num(s: dict[str, Any], path: str) -> float | None:
    value = _at(s, path)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _check(s: dict[str, Any], paths: list[str], test: Callable[..., bool]) -> bool | None:
    values = [_num(s, p) for p in paths]
    return None if any(v is None for v in values) else bool(test(*values))


# The goals over the summary: (figure shown, goal text, check); None = not measured in this run.
GOALS: list[tuple[str, str, Callable[[dict[str, Any]], bool | None]]] = [
    ("cpu_ms_per_poll.sefwd", "<= seed_sample and <= 0.5 ms",
     lambda s: _check(s, ["cpu_ms_per_poll.sefwd", "cpu_ms_per_poll.seed_sample"], lambda a, b: a <= b and a <= 0.5)),
    ("rss_mib.stdout_only", "<= 40 MiB", lambda s: _check(s, ["rss_mib.stdout_only"], lambda a: a <= 40)),
    ("rss_mib.all_sinks", "<= 120 MiB", lambda s: _check(s, ["rss_mib.all_sinks"], lambda a: a <= 120)),
    ("startup_ms", "<= 400 ms", lambda s: _check(s, ["startup_ms"], lambda a: a <= 400)),
    ("hostile_rss_mib.peak", f"< {HOSTILE_RSS_GOAL_MIB:g} MiB, and after within {HOSTILE_RETURN_MIB:g} MiB of baseline",
     lambda s: _check(s, ["hostile_rss_mib.peak", "hostile_rss_mib.after", "hostile_rss_mib.baseline"],
                      lambda peak, after, base: peak < HOSTILE_RSS_GOAL_MIB and after <= base + HOSTILE_RETURN_MIB)),
    ("detection_latency_ms.p99", "<= 1.05 x poll interval + 20 ms",
     lambda s: _check(s, ["detection_latency_ms.p99", "detection_latency_ms.poll_interval_ms"], lambda p, i: p <= 1.05 * i + 20)),
    ("processing_latency_ms.p99", "<= 15 ms", lambda s: _check(s, ["processing_latency_ms.p99"], lambda a: a <= 15)),
    ("journal.append_rps", ">= 50k rec/s (batches of 64)", lambda s: _check(s, ["journal.append_rps"], lambda a: a >= 50_000)),
    ("journal.append_single_rps", "within 2x of the fsync floor",
     lambda s: _check(s, ["journal.append_single_rps", "journal.fsync_floor_rps"], lambda a, f: 2 * a >= f)),
    ("journal.drain_rps", ">= 50k rec/s", lambda s: _check(s, ["journal.drain_rps"], lambda a: a >= 50_000)),
    ("backlog_100k_webhook_s", "<= 30 s", lambda s: _check(s, ["backlog_100k_webhook_s"], lambda a: a <= 30)),
    ("fleet.cpu_percent", "<= 25 % of all cores", lambda s: _check(s, ["fleet.cpu_percent"], lambda a: a <= 25)),
    ("eventhubs_cpu_ms_per_record.burst_amqp", "<= 1 ms amortized (AMQPS burst)",
     lambda s: _check(s, ["eventhubs_cpu_ms_per_record.burst_amqp"], lambda a: a <= 1.0)),
    ("eventhubs_cpu_ms_per_record.burst_websocket", "<= 1 ms amortized (WebSocket burst)",
     lambda s: _check(s, ["eventhubs_cpu_ms_per_record.burst_websocket"], lambda a: a <= 1.0)),
    ("probe.answer_p50_ms", "<= 1 ms (loopback, a new connection per probe)",
     lambda s: _check(s, ["probe.answer_p50_ms"], lambda a: a <= 1.0)),
    ("probe.route_p99_us", "<= 100 us (the agent's own work per answer)",
     lambda s: _check(s, ["probe.route_p99_us"], lambda a: a <= 100)),
    ("probe.flip_p99_ms", "<= 1.05 x poll interval + 20 ms",
     lambda s: _check(s, ["probe.flip_p99_ms", "probe.poll_interval_ms"], lambda p, i: p <= 1.05 * i + 20)),
    ("hold.enter_start_p99_ms", "<= poll interval + 100 ms (with 50 other hooks running)",
     lambda s: _check(s, ["hold.enter_start_p99_ms", "hold.poll_interval_ms"], lambda p, i: p <= i + 100)),
]


def judge(summary: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for figure, text, check in GOALS:
        verdict = check(summary)
        if verdict is not None:
            rows.append({"figure": figure, "value": _num(summary, figure), "goal": text, "pass": verdict})
    return rows


def _flat(prefix: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _flat(f"{prefix}.{k}" if prefix else k, v)]
    return [(prefix, value)]


def _table(doc: dict[str, Any]) -> str:
    lines = []
    for name, res in doc["results"].items():
        lines.append(f"== {name} ({res['seconds']} s) {'PASS' if res['pass'] else 'FAIL'}")
        if res.get("error"):
            lines.append(f"  error: {res['error']}")
        for k, v in _flat("", res["figures"]):
            if isinstance(v, list) and len(v) > 12:  # raw samples: the plots show them
                v = f"[{len(v)} values]"
            lines.append(f"  {k:<45} {v}")
        lines += [f"  [{'pass' if g['pass'] else 'FAIL'}] {g['goal']}" for g in res["goals"]]
    lines.append("== summary (the performance issue's figures and goals)")
    lines += [f"  {k:<45} {v}" for k, v in _flat("", doc["summary"])]
    lines += [f"  [{'pass' if g['pass'] else 'FAIL'}] {g['figure']} = {g['value']:g} {g['goal']}" for g in doc["goals"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes: the whole run takes about 3 minutes (goal: under 10)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, only checks that everything runs")
    parser.add_argument("--only", action="append", choices=BENCHMARKS + ON_REQUEST, metavar="NAME",
                        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS + ON_REQUEST)} "
                             "(soak only when named)")
    parser.add_argument("--minutes", type=float, metavar="N",
                        help="how long the soak runs (default 60; --quick 10, --smoke 1)")
    parser.add_argument("--out", type=Path, help="results file (default benchmarks/results/tmp/latest.json, ignored by git)")
    parser.add_argument("--record", action="store_true",
                        help="rewrite the committed benchmarks/results/latest.json and its plots (a full or --quick run of every benchmark)")
    parser.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots (written beside the results file)")
    args = parser.parse_args(argv)
    if args.minutes is not None and not 0 < args.minutes < float("inf"):
        parser.error(f"--minutes must be a positive number, got {args.minutes:g}")
    args.out = results_file(parser, "latest.json", record=args.record, out=args.out, smoke=args.smoke, partial=bool(args.only))
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)  # expected warnings (fresh cursors, http) are noise here
    # A TERM (`kill`, a CI timeout) unwinds like Ctrl-C: every benchmark's peers and agents are stopped on the way
    # out, none is left running (a killed soak used to leave its agent and the Event Hubs peer behind).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    sizes = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    results: dict[str, Any] = {}
    for name in args.only or BENCHMARKS:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        start = time.monotonic()
        try:
            module = importlib.import_module(f"benchmarks.{name}")
            results[name] = module.run(sizes, minutes=args.minutes) if name == "soak" else module.run(sizes)
        except Exception as exc:  # one broken benchmark must not cost the others' figures
            traceback.print_exc()
            results[name] = {"figures": {}, "goals": [{"goal": "the benchmark ran to the end", "pass": False}],
                             "pass": False, "error": f"{type(exc).__name__}: {exc}"}
        results[name]["seconds"] = round(time.monotonic() - start, 1)
    summary = summarize(results)
    goals = judge(summary)
    doc = {"machine": machine_info(), "mode": "quick" if args.quick or args.smoke else "full", "smoke": args.smoke,
           "summary": summary, "goals": goals, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    print(_table(doc))
    print(f"results written to {args.out}")
    if not args.no_plots:
        for path in draw(doc, args.out.parent):
            print(f"plot written to {path}")
    return 0 if all(r["pass"] for r in results.values()) and all(g["pass"] for g in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
