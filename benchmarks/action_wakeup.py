"""Wake-up latency of a due action while the action workers are busy: the workers' wait before and
after issue 28's fix, side by side in one run.

Before, a worker that found no due row waited on a bare ``Condition.wait``: a wake-up the scheduler
sent between the worker's look at the store and its wait was lost, and the due row waited for the
worker's idle timeout (30 s in the agent, longer than a Spot eviction's notice). After, the worker
takes a mark before the look and waits for a wake-up newer than the mark (``forwarder.approval.wakeup``).

The model is the runner's loops on the real actions table (``forwarder.store.actions`` on a real
SQLite store): a scheduler thread (promote due rows, count them, wake that many workers, sleep until
the next row's time or a worker's "done"), and ``workers`` threads (mark, claim, wait; an action
"runs" for a random 20–120 ms). Rows fall due at random moments, so that about 70 % of the workers
are busy and workers finish and look while the scheduler promotes. The idle timeout is cut to
``IDLE`` s so that a lost wake-up costs that here; a row claimed more than ``IDLE`` / 2 after its
time counts as a missed wake-up. Each case runs twice: as is, and with the worker descheduled for
``GAP`` between its look and its wait (what a busy machine does to a thread now and then, made to
happen every time).
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.common import Sizes, goal, result, run_standalone, scratch_dir
from forwarder.approval.wakeup import Wakeup
from forwarder.store import actions as rows
from forwarder.store.actions import NewAction
from forwarder.store.database import Store

IDLE = 0.5  # the workers' idle timeout here (the agent's: 30 s)
GAP = 0.005  # the worker descheduled between its look and its wait
WORK = 0.02  # the free worker's action before the probe falls due
JITTER = 0.005  # the probe falls due up to this much before the free worker looks again
SCHEDULER_FLOOR = 0.05  # the runner's scheduler sleeps at least this long when a row is planned


@dataclass(frozen=True)
class _Plan:
    rounds: int
    workers: tuple[int, ...]


PLANS = {"full": _Plan(150, (8, 50)), "quick": _Plan(50, (8, 50)), "smoke": _Plan(5, (8,))}


class BareCondition:
    """The workers' wait before the fix: ``Condition.wait`` after the look (``mark`` is ignored)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()

    def mark(self) -> int:
        return 0

    def notify(self, n: int = 1) -> None:
        with self._cond:
            self._cond.notify(n)

    def notify_all(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait(self, mark: int, timeout: float, stop: threading.Event | None = None) -> bool:
        with self._cond:
            return self._cond.wait(timeout)


VARIANTS: dict[str, Callable[[], Any]] = {"before": BareCondition, "after": Wakeup}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else 0.0


def _trial(store: Store, variant: str, workers: int, rounds: int, gap: float, seed: int) -> dict[str, Any]:
    """``workers - 1`` workers busy all along; the free one runs a short action, and the probe row falls
    due just before that one ends (the worker looks at the store again): the probe's due → claim."""
    rng = random.Random(seed)
    signal = VARIANTS[variant]()
    stop, wake = threading.Event(), threading.Event()
    claimed: dict[int, float] = {}
    done = threading.Condition()

    def plan(hook: str, due: float) -> int:
        with store.transaction() as c:
            row = rows.insert(c, NewAction(kind=rows.HOOK, event_id="E", change="scheduled", event={}, due=due,
                                           hook=hook), time.time())
        wake.set()  # (the runner's wake() after a commit that planned actions)
        return row

    def schedule() -> None:
        while not stop.is_set():
            now = time.time()
            wait = IDLE
            nxt = rows.next_due(store)
            if nxt is not None and nxt <= now:
                rows.promote(store, now)
                nxt = rows.next_due(store)
            if nxt is not None:
                left = nxt - time.time()
                wait = 1.0 if left <= 0 else min(IDLE, max(SCHEDULER_FLOOR, left))
            waiting = store.query("SELECT count(*) FROM actions WHERE state = 'due'")[0][0]
            if waiting:
                signal.notify(int(waiting))
            if wake.wait(wait):
                wake.clear()

    def work() -> None:
        while not stop.is_set():
            mark = signal.mark()
            action = rows.claim(store, time.time())
            if action is None:
                if gap:
                    time.sleep(gap)
                signal.wait(mark, IDLE, stop)
                continue
            with done:
                claimed[action.id] = time.time()
                done.notify_all()
            if action.hook == "busy":
                stop.wait()
            elif action.hook == "short":
                time.sleep(WORK)
            with store.transaction() as c:
                rows.finish(c, action.id, rows.DONE, {}, time.time())
            wake.set()

    threads = [threading.Thread(target=schedule, daemon=True)] + [
        threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for thread in threads:
        thread.start()
    late: list[float] = []
    try:
        busy = [plan("busy", time.time()) for _ in range(workers - 1)]
        with done:
            done.wait_for(lambda: all(b in claimed for b in busy), 30)
        for _ in range(rounds):
            short = plan("short", time.time())
            with done:
                done.wait_for(lambda: short in claimed, 3 * IDLE + 5)
            # Due just before the free worker looks again; the scheduler, asleep for its floor, promotes
            # it when that worker's "done" wakes it: while the worker looks, or just after.
            due = claimed.get(short, time.time()) + WORK - rng.uniform(0.0005, JITTER)
            probe = plan("probe", due)
            with done:
                if done.wait_for(lambda: probe in claimed, 3 * IDLE + 5):
                    late.append((claimed[probe] - due) * 1000)
    finally:
        stop.set()
        wake.set()
        signal.notify_all()
        for thread in threads:
            thread.join(IDLE + 5)
    return {"workers": workers, "busy_workers": workers - 1, "rounds": rounds, "claimed": len(late),
            "p50_ms": round(_pct(late, 0.5), 1), "p99_ms": round(_pct(late, 0.99), 1),
            "max_ms": round(max(late, default=0.0), 1), "missed_wakeups": sum(1 for ms in late if ms > IDLE * 500)}


def run(sizes: Sizes) -> dict[str, Any]:
    plan = PLANS[sizes.name]
    figures: dict[str, Any] = {"idle_timeout_s": IDLE, "gap_ms": GAP * 1000}
    goals = []
    with scratch_dir("wakeup-") as tmp:
        for n, workers in enumerate(plan.workers):
            for case, gap in (("as_is", 0.0), ("descheduled", GAP)):
                for variant in VARIANTS:
                    store = Store.open(tmp / f"{variant}-{case}-{workers}", fsync=False)
                    try:
                        got = _trial(store, variant, workers, plan.rounds, gap, seed=28 + n)
                    finally:
                        store.close()
                    figures.setdefault(f"workers_{workers}", {}).setdefault(case, {})[variant] = got
                    if variant == "after":
                        goals.append(goal(f"{workers} workers, {case}: every probe claimed, no missed wake-up",
                                          got["claimed"] == got["rounds"] and got["missed_wakeups"] == 0))
    return result(figures, goals)


def _show(figures: dict[str, Any]) -> list[str]:
    lines = ["workers  case         variant  p50 ms  p99 ms  max ms  missed"]
    for key, cases in figures.items():
        if not key.startswith("workers_"):
            continue
        for case, variants in cases.items():
            for variant, f in variants.items():
                lines.append(f"{f['workers']:>7}  {case:<11}  {variant:<7} {f['p50_ms']:>7} {f['p99_ms']:>7} "
                             f"{f['max_ms']:>7} {f['missed_wakeups']:>7}")
    return lines


def main(argv: list[str] | None = None) -> int:
    return run_standalone("action_wakeup", "action_wakeup.json", run, prog="python -m benchmarks.action_wakeup",
                          description=__doc__ or "", quick_help="fewer actions", show=_show, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
