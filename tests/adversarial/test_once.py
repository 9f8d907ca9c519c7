"""`sefwd once` against a hostile IMDS: every failure is its documented exit code, never a traceback.

0 IMDS answered with a usable document, 1 IMDS not reachable (or answered nonsense), 3 a bad
document, 2 a configuration error.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.adversarial.hostile import HostileServer, Reply, Request
from tests.agent import ROOT, write_config

pytestmark = pytest.mark.timeout(120)

GOOD = {"DocumentIncarnation": 1, "Events": [{
    "EventId": "E-1", "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm"],
    "EventStatus": "Scheduled", "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT", "Description": "",
    "EventSource": "Platform", "DurationInSeconds": -1}]}
BIG = orjson.dumps(GOOD).replace(b'"DurationInSeconds":-1', b'"DurationInSeconds":' + b"9" * 40)


def huge() -> Iterator[bytes]:
    for _ in range(2000):
        yield b" " * 65536


CASES = {
    "good": (Reply.json(GOOD), 0, "1 event(s)"),
    # Bounded, not refused: DurationInSeconds becomes null with its text in DurationInSecondsRaw.
    "big-integer": (Reply(body=BIG, headers={"Content-Type": "application/json"}), 0, "DurationInSecondsRaw"),
    "not-json": (Reply(body=b"<html>proxy error</html>"), 3, "bad document"),
    "garbage-status-line": (Reply(raw=b"SSH-2.0-OpenSSH_9.6\r\n\r\n", close=True), 1, "malformed HTTP answer"),
    "oversized": (Reply(body=huge, headers={"Content-Length": str(2000 * 65536)}), 1, "byte cap"),
    "chunked-oversized": (Reply(body=huge), 1, "byte cap"),
    "slow-drip": (Reply.json(GOOD, drip=1.0), 1, "deadline for the whole answer"),
    "throttled": (Reply.json({"error": "Too many requests"}, status=429, headers={"Retry-After": "3600"}), 1, "429"),
    "interim-103": (Reply.json(GOOD, interim=[b"HTTP/1.1 103 Early Hints\r\n\r\n"]), 0, "1 event(s)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_once_exit_codes(tmp_path: Path, case: str) -> None:
    reply, code, says = CASES[case]

    def handler(req: Request) -> Reply:
        if "/metadata/instance" in req.target:
            return Reply(body=b"{not json", close=True)  # a broken compute answer must not matter
        return reply

    with HostileServer(handler) as server:
        config = write_config(tmp_path / "sefwd.toml", server.url, tmp_path / "state")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
        env.update(PYTHONPATH=str(ROOT), SEFWD_IMDS_TIMEOUT="1s", SEFWD_IMDS_FIRST_CALL_TIMEOUT="1s")
        done = subprocess.run([sys.executable, "-m", "forwarder", "once", "--config", str(config)],
                              capture_output=True, env=env, cwd=str(ROOT), timeout=90)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == code, err
    assert "Traceback" not in err
    assert says in err


def test_once_with_a_bad_endpoint_is_a_config_error(tmp_path: Path) -> None:
    config = write_config(tmp_path / "sefwd.toml", "http://user:secret@127.0.0.1:9", tmp_path / "state")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "forwarder", "once", "--config", str(config)],
                          capture_output=True, env=env, cwd=str(ROOT), timeout=60)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2, err
    assert "user:password@" in err and "Traceback" not in err
    assert "secret" not in err  # the credential is never echoed
