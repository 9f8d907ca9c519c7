"""What `sefwd demo` adds to show protection: the probe flipping, this VM's hold (a drain and its undo), a message to people.

Everything the demo configures for it is in :func:`protection_config` (one place, in the config file's own
shape), and what it prints about it (on stderr, beside the records on stdout) in :class:`Narrator`.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import threading
from collections.abc import Callable
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

from forwarder.records import utcnow

# The drain and its undo: print what a real hook would do (a real one would call kubectl, az, systemctl).
_DRAIN = ("import os; print('draining', os.environ['SEFWD_EVENT_TYPE'], os.environ['SEFWD_EVENT_ID'][:8], "
          "'with', os.environ['SEFWD_SECONDS_LEFT'], 's left')")
_UNDO = "import os; print('back in service after', os.environ['SEFWD_EVENT_TYPE'], os.environ['SEFWD_EVENT_ID'][:8])"
PROTECTED = ["Reboot", "Redeploy", "Preempt", "Terminate"]
DRAIN_LEAD_S = 5  # the drain is due at NotBefore - 5 s: a second after the scenario's Reboot appears


def notify_available() -> bool:
    """Whether the ``[notify]`` extra (Apprise, jinja2) is installed."""
    return all(importlib.util.find_spec(name) is not None for name in ("apprise", "jinja2"))


def protection_config(state_dir: Path, inbox_url: str | None) -> dict[str, Any]:
    """The demo's protection, as a config file would say it: the probe, this VM's hold (a drain a second
    after the Reboot appears, ``NotBefore - 5s`` of the scenario's 6 s notice, and its undo after the
    Reboot), the Reboot approved once drained, and a notify sink posting to the demo's own inbox
    (``inbox_url``, None without the ``[notify]`` extra)."""
    config: dict[str, Any] = {
        # No settle time: the probe serves again as the Reboot ends, and the demo need not wait for it.
        "probe": {"listen": "127.0.0.1:0", "settle": "0s", "state_file": str(state_dir / "maintenance.json")},
        # This VM's hold: only its own events of these types (the scenario's Redeploy is another VM's).
        "protect": {"enter": [sys.executable, "-c", _DRAIN], "leave": [sys.executable, "-c", _UNDO],
                    "at": f"notbefore - {DRAIN_LEAD_S}s", "event_types": PROTECTED,
                    "deadline_margin": "1s",  # the drain must end 1 s before NotBefore (SEFWD_SECONDS_LEFT)
                    "settle": "0s"},  # the undo as soon as the Reboot is over
        "approval": {
            "rules": [
                {"name": "short-freeze", "action": "approve", "event_type": "Freeze", "event_status": "Scheduled",
                 "duration_min": 0, "duration_max": 8},
                # The drain first: the user's Reboot is approved (starts early) only once this VM's enter succeeded.
                {"name": "user-initiated", "action": "approve", "event_source": "User", "event_status": "Scheduled",
                 "after_hooks": True},
                {"name": "everything-else", "action": "hold"},
            ],
        },
        "sinks": [{"type": "stdout", "name": "stdout"}],
    }
    if inbox_url is not None:
        config["sinks"].append({
            "type": "notify", "name": "people", "urls": [f"json://{inbox_url.split('://', 1)[1]}"],
            "filter": {"record_types": ["scheduledevent", "protect"], "event_types": PROTECTED, "affects_this_vm": True,
                       "changes": ["scheduled", "completed", "canceled", "ended"]}})
    return config


class Narrator:
    """Prints the protection side of the demo's timeline on ``out``: probe answers, messages to people."""

    def __init__(self, out: IO[str] | None = None, clock: Callable[[], datetime] = utcnow) -> None:
        self.out = out or sys.stderr
        self.clock = clock
        self._lock = threading.Lock()
        self._probe_state: str | None = None
        self._messages = 0
        self.inbox: _Inbox | None = None

    def line(self, what: str, text: str) -> None:
        with self._lock:
            print(f"{self.clock():%Y-%m-%dT%H:%M:%SZ}  {what}  {text}", file=self.out, flush=True)

    # -- the probe ---------------------------------------------------------------------------
    def watch_probe(self, url: str) -> Callable[[Any, datetime], None]:
        """A maintenance listener that prints the probe's answer whenever it changes."""
        self._probe_state = "serving"

        def changed(view: Any, now: datetime) -> None:
            if view.state == self._probe_state:
                return
            self._probe_state = view.state
            if view.serving:
                self.line("probe", f"200 serving again  (GET {url})")
                return
            event = view.event
            about = f"{event.event_type} {event.event_id[:8]}…" if event is not None else ""
            if view.state == "settling":
                until = f", serving again at {view.until:%H:%M:%SZ}" if view.until is not None else ""
                self.line("probe", f"503 settling: {about} ended{until}")
                return
            left = f", NotBefore in {int(view.seconds_left + 0.999)}s" if view.seconds_left is not None else ""
            self.line("probe", f"503 {view.state}: {about} {event.status if event else ''}{left}  "
                               f"(GET {url}: the load balancer takes the VM out)")

        return changed

    def probe_serving(self) -> bool:
        """Whether the probe's last printed answer is 200 (or it was never watched)."""
        return self._probe_state in (None, "serving")

    # -- messages to people ------------------------------------------------------------------
    def open_inbox(self) -> str:
        """A loopback HTTP server standing for a chat channel; its URL (the notify sink posts there)."""
        self.inbox = _Inbox(self)
        return self.inbox.url

    def message(self, title: str, body: str) -> None:
        """The first message in full (what people read), later ones by their title: a short timeline."""
        with self._lock:
            first, self._messages = self._messages == 0, self._messages + 1
        self.line("notify", title)
        for line in [line for line in body.splitlines() if line.strip()] if first else []:
            print(f"{'':22}│ {line}", file=self.out, flush=True)

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()


class _Inbox:
    """Apprise's ``json://`` target on 127.0.0.1: every message it gets is narrated."""

    def __init__(self, narrator: Narrator) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server naming
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    message = json.loads(body)
                    narrator.message(str(message.get("title") or ""), str(message.get("message") or ""))
                except (ValueError, AttributeError):
                    pass  # not a message: nothing to show
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="demo-inbox", daemon=True)  # shutdown() waits one poll
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/people"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
