"""No secret in any log line or stored file: a running agent at log_level = debug sends to webhook URLs
carrying ``?code=SECRET`` (one receiver redirects to a Location with user:password@, one is down), and
not one byte of a secret reaches its log, its state dir or ``sefwd status``."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from forwarder.emulator import Emulator
from forwarder.common.logs import redact
from tests.adversarial.hostile import HostileServer, Reply, Request
from tests.agent import AgentProcess, ROOT, closed_port, read_jsonl, wait_until, write_config

pytestmark = pytest.mark.timeout(180)

SECRET = "S3CRETcode"



def files_containing(folder: Path, needle: bytes) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and needle in p.read_bytes()]


@pytest.mark.slow  # every sink failing against a real agent
def test_no_secret_in_logs_dead_letters_or_status(tmp_path):
    def redirect(request: Request) -> Reply:
        return Reply(status=307, headers={
            "Location": f"http://user:{SECRET}pw@127.0.0.1:1/moved?code={SECRET}loc&sig={SECRET}sig"})

    with Emulator(vms=["vm0"], rate_limit=None) as emu, HostileServer(redirect) as receiver:
        sinks = (
            '[[sinks]]\ntype = "file"\nname = "file"\n'
            f'path = "{tmp_path / "out.jsonl"}"\n'
            '[[sinks]]\ntype = "webhook"\nname = "redirected"\n'
            f'url = "{receiver.url}/hook?code={SECRET}"\n'
            '[[sinks]]\ntype = "webhook"\nname = "down"\n'
            f'url = "http://127.0.0.1:{closed_port()}/hook?code={SECRET}&x=1"\ntimeout = "2s"\n'
        )
        config = write_config(tmp_path / "c.toml", emu.vm_url("vm0"), tmp_path / "state", sinks=sinks)
        agent = AgentProcess(config, tmp_path / "agent.log")
        try:
            wait_until(lambda: read_jsonl(tmp_path / "out.jsonl"), 60, "the agent's first records")
            receiver.wait_requests(1, 60)
            assert f"code={SECRET}" in receiver.requests[0].target  # the receiver did get its key
            logs = lambda: agent.logs()  # noqa: E731
            # Each path that used to leak has run: urllib3's request line, the redirect, the refused connection.
            wait_until(lambda: '"POST /hook?code=*** HTTP/1.1" 307' in logs(), 60, "urllib3's debug line, redacted")
            wait_until(lambda: "redirect to http://***@127.0.0.1:1/moved?code=***&sig=***" in logs(), 60,
                       "the redirect logged, redacted")
            wait_until(lambda: "sink 'down': cannot reach" in logs(), 60, "the unreachable receiver logged")
            wait_until(lambda: files_containing(tmp_path / "state", b"redirect to http://***@"), 60,
                       "the dead letter stored with its redacted reason")
            assert agent.alive()
        finally:
            rc = agent.terminate()
        assert rc == 0
        status = subprocess.run([sys.executable, "-m", "forwarder", "status", "--config", str(config)],
                                capture_output=True, cwd=str(ROOT), timeout=60)
        check = subprocess.run([sys.executable, "-m", "forwarder", "config", "check", "--config", str(config)],
                               capture_output=True, cwd=str(ROOT), timeout=60)
    # The agent has stopped: status says so with its documented exit code (1), config check passes.
    assert status.returncode == 1 and b"NOT running" in status.stdout, (status.stdout, status.stderr)
    assert check.returncode == 0, check.stderr
    everything = agent.logs().encode() + status.stdout + status.stderr + check.stdout + check.stderr
    assert SECRET.encode() not in everything, [line for line in agent.logs().splitlines() if SECRET in line][:5]
    assert files_containing(tmp_path / "state", SECRET.encode()) == []


@pytest.mark.parametrize("text, secret", [
    ("https://u:pw-Secret@host.example/p", "pw-Secret"),
    ("http://u:a/b?c@host/p", "a/b?c"),
    ("GET https://h/f?code=Secret1&api-version=2020-07-01 failed", "Secret1"),
    ('"POST /api/hook?code=Secret2 HTTP/1.1" 200 0', "Secret2"),
    ("Max retries exceeded with url: /hook?code=Secret3 (Caused by NewConnectionError", "Secret3"),
    ("Incremented Retry for (url='/hook?token=Secret4')", "Secret4"),
    ("Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=Secret5=", "Secret5"),
    ("redirect to sb://x:Secret6@ns/ not followed", "Secret6"),
    ("wss://h/?sig=Secret7#frag", "Secret7"),
])
def test_redaction_rule(text, secret):
    shown = redact(text)
    assert secret not in shown and "***" in shown
    assert redact(shown) == shown  # applying it twice changes nothing


def test_every_sinks_reject_detail_is_redacted():
    """Dead letters store Reject.detail; a third-party sink's detail is redacted like the webhook's."""
    from forwarder.sinkapi import Reject

    reject = Reject("http_3xx_redirect", "redirect to https://user:Secret8@h/x?code=Secret9 not followed")
    assert "Secret8" not in reject.detail and "Secret9" not in reject.detail
    assert reject.detail == "redirect to https://***@h/x?code=*** not followed"


def test_uncaught_exceptions_are_redacted_too():
    """A traceback printed by Python itself (main thread or a worker) goes through the same rule."""
    script = (
        "import threading\n"
        "from forwarder.common.logs import setup_logging\n"
        "setup_logging('info')\n"
        "def boom():\n"
        "    raise ConnectionError('Max retries exceeded with url: /hook?code=Secret10')\n"
        "t = threading.Thread(target=boom, name='worker'); t.start(); t.join()\n"
        "raise ValueError('bad redirect to https://u:Secret11@h/')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, cwd=str(ROOT), timeout=60)
    err = done.stderr.decode()
    assert done.returncode == 1
    assert "uncaught exception in thread worker" in err and "Traceback" in err and "ValueError" in err, err
    assert "Secret10" not in err and "Secret11" not in err, err
