"""Start Azurite's table service (the Azure Storage emulator, npm package ``azurite``) on a free loopback port.

Installed by ``tests/peers/azurite/install.sh`` (``npm ci``: the version pinned by its package-lock.json);
``AzuritePeer.available()`` says whether node and the package are there. Tests and benchmarks share it.
The well-known development account (``devstoreaccount1``) is what Azurite accepts; the real SDK client
(``azure-data-tables``) talks to it with the connection string below, as it would to Azure.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

PEER_DIR = Path(__file__).resolve().parents[2] / "tests" / "peers" / "azurite"
BIN = PEER_DIR / "node_modules" / ".bin" / "azurite-table"
ACCOUNT = "devstoreaccount1"
# Azurite's published development key (the same in every installation; not a secret).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class AzuritePeer:
    """One ``azurite-table`` process, its data in a temporary directory removed on close."""

    def __init__(self, *, log: Path | None = None, start_timeout: float = 30.0,
                 tls: tuple[Path, Path] | None = None, oauth: bool = False) -> None:
        """``tls``: (certificate, key) PEM files: HTTPS. ``oauth``: accept bearer tokens too (Azurite's basic
        check: a JWT within its lifetime from a Microsoft issuer for a storage audience; HTTPS only)."""
        why = self.available()
        if why is not None:
            raise RuntimeError(f"Azurite is not available: {why}")
        self._dir = tempfile.TemporaryDirectory(prefix="azurite-")
        self._log = open(log, "ab") if log is not None else None
        self.scheme = "https" if tls is not None else "http"
        extra = [] if tls is None else ["--cert", str(tls[0]), "--key", str(tls[1])]
        if oauth:
            extra += ["--oauth", "basic"]
        for _attempt in range(3):  # the free port may be taken between the probe and Azurite's bind
            self.port = _free_port()
            self.proc = subprocess.Popen(
                [str(BIN), "--tableHost", "127.0.0.1", "--tablePort", str(self.port), "--location", self._dir.name,
                 "--skipApiVersionCheck", "--loose", "--disableProductStyleUrl", *extra],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if self._started(start_timeout):
                return
            self.proc.kill()
            self.proc.wait(10)
        self.close()
        raise RuntimeError("Azurite's table service did not start")

    def _started(self, timeout: float) -> bool:
        """Read Azurite's output until it says it listens (then keep draining it into the log)."""
        assert self.proc.stdout is not None
        ready = threading.Event()
        out = self.proc.stdout

        def drain() -> None:
            for line in iter(out.readline, b""):
                if self._log is not None:
                    self._log.write(line)
                    self._log.flush()
                if b"successfully started" in line:
                    ready.set()
            ready.set()  # the process ended: the caller sees it exited
        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if time.monotonic() > deadline:
                return False
        return self.proc.poll() is None

    @staticmethod
    def available() -> str | None:
        """Why Azurite cannot run here (no node, not installed), or None when it can."""
        if shutil.which("node") is None:
            return "node is not installed"
        if not BIN.exists():
            return "azurite is not installed: run sh tests/peers/azurite/install.sh (npm ci)"
        return None

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/{ACCOUNT}"

    @property
    def connection_string(self) -> str:
        """The development account's connection string for this instance (what azure-data-tables takes)."""
        return (f"DefaultEndpointsProtocol={self.scheme};AccountName={ACCOUNT};AccountKey={KEY};"
                f"TableEndpoint={self.endpoint};")

    def close(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        if self._log is not None:
            self._log.close()
        self._dir.cleanup()

    def __enter__(self) -> AzuritePeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
