"""The agent's self-report (kept in the store's meta table) and its reading by ``sefwd status``."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from forwarder import __version__
from forwarder.errors import ForwarderError
from forwarder.agent.sink_health import describe_sink_health
from forwarder.common.logs import RateLimitedLog, redact
from forwarder.records import rfc3339, utcnow
from forwarder.store.actions import STATES
from forwarder.store.actions import counts as action_counts
from forwarder.store.database import DB_FILE, Store

STATUS_KEY = "status"
log = logging.getLogger(__name__)


def _steady(data: dict[str, Any]) -> dict[str, Any]:
    """The snapshot less what moves on every poll (poll count, last poll time)."""
    imds = data.get("imds")
    if not isinstance(imds, dict):
        return data
    return {**data, "imds": {k: v for k, v in imds.items() if k not in ("polls", "last_poll_ok")}}


class StatusReporter:
    """Writes the status report from a snapshot callable: within ``interval`` seconds of a change, and
    at least every ``refresh`` seconds so the last-poll time stays current.

    A rewrite costs about a millisecond of CPU (serialize, write, rename); doing it every couple of
    seconds on an idle agent cost more than the polls themselves (docs/performance.md).
    """

    def __init__(self, store: Store, snapshot: Callable[[], dict[str, Any]], stop: threading.Event,
                 interval: float = 5.0, refresh: float = 30.0) -> None:
        self.store = store
        self._snapshot = snapshot
        self._stop = stop
        self._interval = interval
        self._refresh = refresh
        self._written: dict[str, Any] | None = None
        self._written_at = 0.0
        self._errors = RateLimitedLog(log)
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def poke(self) -> None:
        """Look for a change now rather than at the next interval (from any thread; the write is this
        reporter's, off the caller's thread)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._wake.wait(self._interval):
                self._wake.clear()
            if self._stop.is_set():
                break
            try:
                data = self._snapshot()
                if _steady(data) != self._written or time.monotonic() - self._written_at >= self._refresh:
                    self.write(data)
            except Exception as exc:  # the report is advisory: it must never stop for good
                self._errors.log(logging.ERROR, "status", "cannot write the status report: %s", exc)

    def write(self, data: dict[str, Any] | None = None, **extra: Any) -> None:
        data = self._snapshot() if data is None else data
        self._written = _steady(data)
        self._written_at = time.monotonic()
        data = {**data, **extra}
        data["updated"] = rfc3339(utcnow())
        data["pid"] = os.getpid()
        data["version"] = __version__
        try:
            with self.store.transaction() as c:
                c.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (STATUS_KEY, orjson.dumps(data)))
        except (OSError, ForwarderError):
            pass  # a full disk must not stop the agent over a report


def agent_running(state_dir: Path) -> bool:
    """Whether an agent holds the state dir's lock."""
    try:
        import fcntl
    except ImportError:
        return True  # Windows: the service manager knows; say so rather than guess
    from forwarder.common.owned_files import UnsafeFileError, open_owned

    try:  # never a link, a FIFO or another user's file: `sudo sefwd status` reads the service user's dir
        fd, _ = open_owned(state_dir, "agent.lock", write=False)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except UnsafeFileError:
        return False  # no agent's lock: the agent's own lock is a plain file it created
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def read_status(state_dir: Path) -> dict[str, Any]:
    """Everything ``sefwd status`` shows, read from the store (works with the agent up or down)."""
    out: dict[str, Any] = {"state_dir": str(state_dir), "running": agent_running(state_dir), "agent": None,
                           "document_incarnation": None, "current_events": [], "dead_letters": {}, "backlog": {},
                           "lost": {}, "actions": {}}
    if not (state_dir / DB_FILE).is_file():
        return out
    try:
        store = Store.open(state_dir)
    except ForwarderError as exc:
        out["error"] = str(exc)
        return out
    try:
        meta = store.meta()
        try:
            out["agent"] = orjson.loads(meta[STATUS_KEY]) if meta.get(STATUS_KEY) else None
            doc = orjson.loads(meta["document"]) if meta.get("document") else None
        except (ValueError, TypeError):
            doc = None
        out["document_incarnation"] = doc.get("DocumentIncarnation") if isinstance(doc, dict) else None
        out["current_events"] = doc.get("Events", []) if isinstance(doc, dict) else []
        out["dead_letters"] = store.dead_counts()
        out["backlog"] = {s: store.backlog(s, n) for s, n in store.query("SELECT sink, next FROM cursors")}
        out["lost"] = store.losses()
        out["actions"] = action_counts(store)
    except ForwarderError as exc:
        out["error"] = str(exc)
    finally:
        store.close()
    if not out["running"] and isinstance(out["agent"], dict):
        out["events_as_of"] = out["agent"].get("updated")  # the agent is down: the events may be stale
    return out


def health(s: dict[str, Any]) -> tuple[str, list[str]]:
    """``not_running``, ``degraded`` (with the reasons) or ``healthy``: what `sefwd status` exits with."""
    if not s.get("running"):
        return "not_running", ["the agent is not running"]
    reasons = []
    agent = s.get("agent") or {}
    imds = agent.get("imds") or {}
    if not agent:
        reasons.append("no status report yet")
    elif imds.get("waiting_since"):
        reasons.append(f"waiting for IMDS since {imds['waiting_since']}"
                       + (f": {imds['last_error']}" if imds.get("last_error") else ""))
    if s.get("error"):
        reasons.append("the store is unreadable")
    if imds.get("consecutive_failures"):
        reasons.append(f"the last {imds['consecutive_failures']} IMDS poll(s) failed"
                       + (f": {imds['last_error']}" if imds.get("last_error") and not imds.get("waiting_since") else ""))
    reasons += [_sink_reason(name, sk) for name, sk in sorted((agent.get("sinks") or {}).items()) if sk.get("stuck")]
    if agent.get("data_lost"):
        reasons.append("data was lost at start")
    return ("degraded", reasons) if reasons else ("healthy", [])


def _sink_reason(name: str, sink: dict[str, Any]) -> str:
    """Why a sink makes the agent degraded, with its latest error (an older report has no health: "stuck")."""
    health = sink.get("health")
    if not isinstance(health, dict):
        return f"sink {name} is stuck"
    return f"sink {name} is {describe_sink_health(health)}"


def _sink_line(name: str, sk: dict[str, Any], s: dict[str, Any]) -> str:
    """One sink's line: its health first (ok / failing since / dead-lettering), then its figures."""
    health = sk.get("health")
    if isinstance(health, dict):
        state = describe_sink_health(health) + (" [DEGRADED]" if health.get("degraded") else "")
    else:
        state = "STUCK" if sk.get("stuck") else "ok"
    oldest = sk.get("oldest_undelivered_age_s")
    return (
        f"  sink {name}: {state}; backlog {s['backlog'].get(name, sk.get('backlog', 0))}"
        + (f" (oldest {format_age(oldest)})" if oldest is not None else "")
        + f", delivered {sk.get('delivered', 0)}, retries {sk.get('retries', 0)}, "
        f"dead letters {s['dead_letters'].get(name, 0)}"
        + (f", filtered {sk['filtered']} (" + ", ".join(f"{r} {n}" for r, n in sorted(sk.get("filtered_by_reason", {}).items()))
           + ")" if sk.get("filtered") else "")
        + (f", last error {redact(str(sk['last_error']))}"
           if sk.get("last_error") and not (isinstance(health, dict) and health.get("last_error")) else "")
    )


def format_age(seconds: float) -> str:
    """``2m15s`` rather than ``135.0s``: an age for people."""
    whole = int(seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if whole < 60:
        return f"{whole}s"
    parts = [(whole // 86400, "d"), (whole % 86400 // 3600, "h"), (whole % 3600 // 60, "m"), (whole % 60, "s")]
    return "".join(f"{n}{unit}" for n, unit in parts if n)


def _events_heading(s: dict[str, Any], count: int) -> str:
    """The events line: which document, and, with the agent down, as of when (they may be stale)."""
    incarnation = s.get("document_incarnation")
    which = f"DocumentIncarnation {incarnation}" if incarnation is not None else "no document read yet"
    agent = s.get("agent") or {}
    if s.get("running") or not agent.get("updated"):
        return f"current events ({which}): {count}"
    when = "when the agent stopped" if agent.get("stopped") else "the agent's last report (it did not stop cleanly)"
    return f"events as of {agent['updated']}, {when}; not current ({which}): {count}"


def format_status(s: dict[str, Any]) -> str:
    """A human page for ``sefwd status``."""
    lines = []
    agent = s.get("agent") or {}
    running = "running" if s["running"] else "NOT running"
    lines.append(f"agent: {running} (state dir {s['state_dir']})")
    state, reasons = health(s)
    lines.append(f"health: {state.replace('_', ' ')}" + (f" ({'; '.join(reasons)})" if reasons and s["running"] else ""))
    if agent:
        age = ""
        try:
            from datetime import datetime

            updated = datetime.fromisoformat(agent["updated"].replace("Z", "+00:00"))
            age = f", report {int((utcnow() - updated).total_seconds())}s old"
        except (KeyError, ValueError):
            pass
        imds = agent.get("imds", {})
        if imds.get("waiting_since") and s["running"]:
            lines.append(f"waiting for IMDS at {imds.get('endpoint')} since {imds['waiting_since']} "
                         + (f"(no answer yet; latest error: {imds['last_error']})" if imds.get("last_error")
                            else "(no answer yet)"))
        lines.append(
            f"last poll ok: {imds.get('last_poll_ok') or 'never'}; polls {imds.get('polls', 0)}, "
            f"IMDS errors {imds.get('imds_errors', 0)}, bad documents {imds.get('bad_documents', 0)}{age}"
        )
        probe = agent.get("maintenance")
        if isinstance(probe, dict):
            lines.append(f"maintenance probe: {probe.get('state') or '-'}" + (
                f" ({probe.get('EventType') or '-'} {probe.get('EventId')} {probe.get('EventStatus') or '-'}, until "
                f"{probe.get('until') or 'it ends'})" if probe.get("EventId") else ""))
        hold = agent.get("protect")
        if isinstance(hold, dict):  # [protect]: this VM's hold (forwarder.protect.hold.status)
            lines.append(f"protect: {hold.get('state')}" + (
                f" (hold {hold.get('hold')} for {', '.join(hold.get('EventIds') or hold.get('AllEventIds') or [])}; "
                f"enter {hold.get('enter')}, leave {hold.get('leave') or 'not yet'})" if hold.get("state") != "serving" else ""))
        st = agent.get("store", {})
        if st:
            lines.append(f"store: {st.get('path', '')}, {st.get('size_bytes', 0)} bytes of records, "
                         f"next {st.get('next_index', 0)}")
        for name, sk in sorted(agent.get("sinks", {}).items()):
            lines.append(_sink_line(name, sk, s))
        if agent.get("data_lost"):
            lost = agent["data_lost"]
            aside = f"; set aside as {lost.get('RenamedTo')}" if lost.get("RenamedTo") else ""
            detail = f" ({lost['Detail']})" if lost.get("Detail") else ""
            lines.append(f"DATA LOST at start: {lost.get('Reason') or 'unknown reason'}{detail}{aside}")
    elif s["running"]:
        lines.append("no status report yet (the agent is starting)")
    else:
        lines.append("no status report yet (the agent has not run with this state dir)")
    for name, reasons in sorted(s.get("lost", {}).items()):
        lines.append(f"  lost ({'whole store' if name == '*' else 'sink ' + name}): "
                     + ", ".join(f"{r} {n}" for r, n in sorted(reasons.items())))
    if s.get("error"):
        lines.append(f"store unreadable: {s['error']}")
    extra = {k: v for k, v in s["dead_letters"].items() if k not in (agent.get("sinks") or {})}
    for name, n in extra.items():
        lines.append(f"  sink {name} (not configured now): dead letters {n}")
    by_kind = s.get("actions") or {}
    if by_kind:
        totals = {state: sum(k.get(state, 0) for k in by_kind.values()) for state in STATES}
        lines.append("actions: " + ", ".join(f"{state} {n}" for state, n in totals.items() if n)
                     + " (" + "; ".join(f"{kind}: " + ", ".join(f"{st} {n}" for st, n in sorted(states.items()))
                                        for kind, states in sorted(by_kind.items())) + ")")
    for problem in s.get("config_warnings") or []:
        lines.append(f"warning: config: {problem}")
    events = s.get("current_events") or []
    lines.append(_events_heading(s, len(events)))
    for e in events:
        lines.append(
            f"  {e.get('EventId')} {e.get('EventType')} {e.get('EventStatus')} NotBefore={e.get('NotBefore') or '-'} "
            f"Resources={','.join(e.get('Resources') or [])}"
        )
    return "\n".join(lines)

