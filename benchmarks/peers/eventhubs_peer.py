"""Start the Node.js Event Hubs AMQP peer (benchmarks/peers/eventhubs/server.js) and talk to its control port.

The peer needs ``node`` and its npm dependencies: ``npm ci --prefix benchmarks/peers/eventhubs``
(``benchmarks/peers/eventhubs/install.sh``; ``tests/peers/eventhubs/install.sh`` runs it too).
``EventHubsPeer.available()`` says whether both are there.
With ``tls=True`` it also listens as the service does, behind a certificate from a test CA
(trustme): AMQPS and AMQP over secure WebSocket (``/$servicebus/websocket``).
"""
from __future__ import annotations

import json
import shutil
import tempfile
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

PEER_DIR = Path(__file__).resolve().parent / "eventhubs"
SERVER = PEER_DIR / "server.js"

# The namespace host the test certificate names beside 127.0.0.1 and localhost; ``.test`` never
# resolves (RFC 6761), so only a proxy that maps it can reach the peer under this name.
NAMESPACE_HOST = "sefwd.servicebus.test"
WS_PATH = "/$servicebus/websocket"

# Error conditions the real service uses.
SERVER_BUSY = "com.microsoft:server-busy"
RESOURCE_LIMIT = "amqp:resource-limit-exceeded"


class EventHubsPeer:
    """One ``node server.js`` process: an AMQP listener on 127.0.0.1 plus an HTTP control port."""

    def __init__(self, *, hub: str = "hub1", partitions: int = 4, max_message_size: int = 1024 * 1024,
                 down: bool = False, tls: bool = False, log: Path | None = None) -> None:
        self.hub = hub
        args = ["node", str(SERVER), "--hub", hub, "--partitions", str(partitions),
                "--max-message-size", str(max_message_size)]
        if down:
            args.append("--down")
        self._certs: tempfile.TemporaryDirectory[str] | None = None
        self.ca_file: str | None = None
        if tls:
            args += self._make_certs()
        self._log = open(log, "ab") if log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(args, cwd=str(PEER_DIR), stdout=subprocess.PIPE,
                                     stderr=self._log, stdin=subprocess.DEVNULL)
        line = self._first_line(timeout=20.0)
        ports = json.loads(line)
        self.port: int = ports["amqp_port"]
        self.amqps_port: int | None = ports["amqps_port"]
        self.wss_port: int | None = ports["wss_port"]
        self.control_port: int = ports["control_port"]

    def _make_certs(self) -> list[str]:
        import trustme

        self._certs = tempfile.TemporaryDirectory(prefix="eventhubs-peer-")
        d = Path(self._certs.name)
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1", "localhost", NAMESPACE_HOST)
        ca.cert_pem.write_to_path(str(d / "ca.pem"))
        cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
        cert.private_key_pem.write_to_path(str(d / "key.pem"))
        self.ca_file = str(d / "ca.pem")
        return ["--tls-cert", str(d / "cert.pem"), "--tls-key", str(d / "key.pem")]

    @staticmethod
    def available() -> str | None:
        """Why the peer cannot run here (no node, no rhea or ws), or None when it can."""
        if shutil.which("node") is None:
            return "node is not installed"
        for package in ("rhea", "ws"):
            if not (PEER_DIR / "node_modules" / package).is_dir():
                return f"{package} is not installed: run sh benchmarks/peers/eventhubs/install.sh (npm ci)"
        return None

    def _first_line(self, timeout: float) -> bytes:
        assert self.proc.stdout is not None
        box: list[bytes] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        if not box or not box[0].strip():
            self.close()
            raise RuntimeError(f"eventhubs peer did not start within {timeout}s (exit code {self.proc.poll()})")
        return box[0]

    # -- addresses ---------------------------------------------------------------------------
    def connection_string(self, *, entity: bool = True) -> str:
        """An emulator connection string (plain AMQP to this peer's port)."""
        cs = (f"Endpoint=sb://127.0.0.1:{self.port};SharedAccessKeyName=RootManageSharedAccessKey;"
              "SharedAccessKey=SAS_KEY_VALUE;UseDevelopmentEmulator=true")
        return cs + (f";EntityPath={self.hub}" if entity else "")

    def service_connection_string(self, host: str = NAMESPACE_HOST) -> str:
        """A connection string as the portal gives it (TLS, no port): reach the peer via a custom endpoint or proxy."""
        return (f"Endpoint=sb://{host}/;SharedAccessKeyName=RootManageSharedAccessKey;"
                f"SharedAccessKey=SAS_KEY_VALUE;EntityPath={self.hub}")

    # -- control port ------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode() if method == "POST" else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.control_port}{path}", data=data, method=method,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def events(self) -> list[dict[str, Any]]:
        """Every event received so far, in arrival order (one per Data section of a batch)."""
        return list(self._call("GET", "/events"))

    def stats(self) -> dict[str, Any]:
        """Counters: connections, tcp_connections, open_connections, cbs_requests, transfers, events, ..."""
        return dict(self._call("GET", "/stats"))

    def faults(self, **faults: Any) -> None:
        """Inject faults: cbs_status/cbs_count, link_error/link_count, reject/reject_count, delay_ms, silent,
        on_transfer/on_transfer_count ({"how": close|detach|drop, "keep": stored before the disconnect?})."""
        self._call("POST", "/faults", faults)

    def clear_faults(self) -> None:
        self._call("POST", "/faults", {"cbs_status": None, "link_error": None, "reject": None,
                                       "delay_ms": 0, "silent": False, "on_transfer": None})

    def disconnect(self, how: str = "close", **error: str) -> int:
        """Close every AMQP connection ("close"), detach its hub links ("detach"), reset it ("drop") or stop
        reading and answering it ("freeze") now; returns how many connections."""
        return int(self._call("POST", "/disconnect", {"how": how, **error})["connections"])

    def reset(self) -> None:
        """Forget events and counters and clear faults."""
        self._call("POST", "/reset")

    def down(self) -> None:
        """Stop listening and drop every AMQP connection (stored events stay)."""
        self._call("POST", "/down")

    def up(self) -> None:
        """Listen again on the same port."""
        self._call("POST", "/up")

    def wait_events(self, n: int, timeout: float = 10.0,
                    predicate: Callable[[list[dict[str, Any]]], bool] | None = None) -> list[dict[str, Any]]:
        """Poll until at least ``n`` events arrived (and ``predicate`` holds), or fail."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.events()
            if len(got) >= n and (predicate is None or predicate(got)):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"peer got {len(got)} events, expected {n} within {timeout}s")
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._log is not subprocess.DEVNULL:
            self._log.close()  # type: ignore[union-attr]
        if self._certs is not None:
            self._certs.cleanup()

    def __enter__(self) -> EventHubsPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
