"""One host rotating its source address inside its IPv6 /64 must not escape the callback's request
rate limit (issue 20, item 7): the connection cap, the refusal aggregation and the rate limit key a
client by one function (IPv4 address, or the IPv6 /64).

The many addresses of one /64 need a network namespace of our own (``unshare -rn``): the real
callback server and the real clients run in a child process inside it, nothing on the machine changes.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forwarder.approval.callback import _client_host
from forwarder.approval.refusals import client_group
from tests.agent import ROOT

ADDRESSES = 8
RATE = 2  # requests per minute per client

CHILD = r"""
import json, socket, subprocess, sys, time
from pathlib import Path
from forwarder.approval.callback import CallbackServer, Verdict
from forwarder.approval.settings import CallbackSettings
from forwarder.common.signing import generate_secret, parse_secret

n, rate, tmp = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
for i in range(1, n + 2):
    subprocess.run(["ip", "-6", "addr", "add", f"2001:db8:0:7::{i:x}/64", "dev", "lo", "nodad"], check=True)
settings = CallbackSettings(host="2001:db8:0:7::1", port=0, keys=(parse_secret(generate_secret()),), rate_limit=rate)
server = CallbackServer(settings, lambda r: Verdict(200, {}), lambda a: None, tmp / "replay.db").start()
port = int(server.url.rsplit(":", 1)[1])
statuses = []
for i in range(2, n + 2):  # one request from each address of the /64
    s = socket.create_connection(("2001:db8:0:7::1", port), timeout=10, source_address=(f"2001:db8:0:7::{i:x}", 0))
    s.sendall(b"POST /approvals HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    answer = b""
    while b"\r\n" not in answer:
        chunk = s.recv(4096)
        if not chunk:
            break
        answer += chunk
    statuses.append(int(answer.split(b" ", 2)[1]) if answer else 0)
    s.close()
server.stop()
print(json.dumps(statuses))
"""


def _namespace_available() -> bool:
    if not shutil.which("unshare") or not shutil.which("ip"):
        return False
    done = subprocess.run(["unshare", "-rn", "true"], capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not _namespace_available(), reason="no unprivileged network namespace here (unshare -rn)")
def test_rotating_addresses_inside_one_ipv6_64_share_one_rate_limit(tmp_path: Path) -> None:
    done = subprocess.run(["unshare", "-rn", sys.executable, "-c", CHILD, str(ADDRESSES), str(RATE), str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    statuses = json.loads(done.stdout.strip().splitlines()[-1])
    limited = statuses.count(429)
    print(f"{ADDRESSES} addresses of one /64, rate {RATE}/min: {limited} rate-limited")
    assert len(statuses) == ADDRESSES and 0 not in statuses
    # The burst of one client is RATE requests: every request after it is refused, whatever address.
    assert limited == ADDRESSES - RATE, statuses


def test_one_client_key_for_caps_aggregation_and_rate_limit() -> None:
    for address, key in ((("2001:db8::1", 5, 0, 0), "2001:db8::/64"), (("::ffff:10.0.0.1", 1), "10.0.0.1"),
                         (("10.0.0.1", 9), "10.0.0.1")):
        assert _client_host(address) == key
    assert client_group("[2001:db8::ffff:1]:9") == _client_host(("2001:db8::1", 1)) == "2001:db8::/64"
