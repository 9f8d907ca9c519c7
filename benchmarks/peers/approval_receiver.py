"""The VMs' approval callbacks (``POST /<vm>/approvals``) as one loopback HTTP server, for the remote
approver's scale-out tests and benchmark: answers "approved" and counts approvals per (VM, EventId).

``secret_of(vm)`` (optional) gives the ``whsec_`` secret that VM's callback verifies (Standard Webhooks,
the reference ``standardwebhooks`` package); a request failing it is answered 401 and counted in ``bad``.
``hold`` (optional) is an EventId whose first request is held until ``release`` is set and then lost
without an answer (the instance that sent it was killed: the approval never arrived).
"""
from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ApprovalReceiver:
    def __init__(self, *, secret_of: Callable[[str], str] | None = None, hold: str | None = None) -> None:
        self.approved: Counter[tuple[str, str]] = Counter()
        self.bad = 0
        self.held = threading.Event()
        self.release = threading.Event()
        lock = threading.Lock()
        rx = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                vm = self.path.split("/")[1]
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if secret_of is not None and not _verified(secret_of(vm), body, self.headers.items()):
                    with lock:
                        rx.bad += 1
                    self.send_error(401)
                    return
                ids = [r["EventId"] for r in json.loads(body)["StartRequests"]]
                with lock:
                    held = hold is not None and hold in ids and not rx.held.is_set()
                    if held:
                        rx.held.set()
                if held:
                    rx.release.wait(120)
                    self.close_connection = True
                    return  # lost with the killed instance: no answer, not approved
                with lock:
                    for event_id in ids:
                        rx.approved[(vm, event_id)] += 1
                raw = json.dumps({"status": "approved", "reason": "approved", "approved": ids}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url_template(self) -> str:
        """CALLBACK_URL_TEMPLATE pointing every VM here."""
        return f"http://127.0.0.1:{self.port}/{{vm_name}}/approvals"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _verified(secret: str, body: bytes, headers: Any) -> bool:
    from standardwebhooks.webhooks import Webhook

    try:
        Webhook(secret).verify(body, {k.lower(): v for k, v in headers})
    except Exception:  # noqa: BLE001 - the package raises several types for a bad signature
        return False
    return True
