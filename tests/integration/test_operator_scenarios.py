"""Issue 32 (operable at 3 a.m.): the operator scenarios, each against the real agent and real peers.

Status without the sinks' secrets; a sink answering 400 turning health degraded with the latest error
(status, /healthz, the metric); a refused IMDS port named within 2 s; a busy probe port failing before
anything says "started"; the emulator's --arm export lines pasted into `sefwd approve --via arm`.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from forwarder.emulator import Emulator
from tests.agent import ROOT, AgentProcess, closed_port, read_jsonl, wait_until
from tests.peers.http_peer import HttpPeer, Response

pytestmark = pytest.mark.timeout(120)

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def sefwd(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The CLI as an operator runs it: none of the service's SEFWD_* variables (so none of its secrets)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    full.update(env or {})
    full["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "forwarder", *args], capture_output=True, text=True,
                          timeout=timeout, env=full, cwd=str(ROOT))


def production_config(path: Path, endpoint: str, state: Path, pager_url: str, extra: str = "") -> Path:
    """docs/configuration.md's minimal production config, pointed at local peers."""
    path.write_text(
        f'[imds]\nendpoint = "{endpoint}"\npoll_interval = "500ms"\n'
        f'[state]\ndir = "{state}"\n'
        f'[agent]\nheartbeat = "0"\n{extra}\n'
        f'[[sinks]]\ntype = "file"\npath = "{state.parent / "events.jsonl"}"\n'
        f'[[sinks]]\ntype = "webhook"\nname = "pager"\nurl = "{pager_url}"\nsecret_env = "SEFWD_WEBHOOK_SECRET"\n'
        'max_age = "24h"\n'
    )
    return path


def http_get(url: str) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_read_only_commands_need_no_secret_and_json_is_one_document(tmp_path):
    state = tmp_path / "state"
    config = production_config(tmp_path / "config.toml", "http://127.0.0.1:9", state, "http://127.0.0.1:9/hook")
    status = sefwd("status", "--config", str(config))
    assert status.returncode == 1, status.stderr  # not running: 1, never 2 for a secret the operator lacks
    assert "SEFWD_WEBHOOK_SECRET" in status.stdout and "warning: config" in status.stdout
    answer = json.loads(sefwd("status", "--json", "--config", str(config)).stdout)  # one document
    assert answer["health"]["state"] == "not_running"
    assert any("SEFWD_WEBHOOK_SECRET" in w for w in answer["config_warnings"])
    listing = sefwd("deadletter", "list", "--config", str(config))
    assert listing.returncode == 0 and "warning: config" in listing.stderr and "0 dead letter(s)" in listing.stderr
    shown = sefwd("config", "show", "--config", str(config))
    assert shown.returncode == 0 and str(state) in shown.stdout and "pager" in shown.stdout
    # A broken [state] still stops them (nothing to read), and --json says so in one document too.
    bad = tmp_path / "bad.toml"
    bad.write_text('[state]\ndir = 5\n')
    failed = sefwd("status", "--json", "--config", str(bad))
    assert failed.returncode == 2 and json.loads(failed.stdout)["error"]["kind"] == "config"
    usage = sefwd("status", "--json", "--no-such-option")
    assert usage.returncode == 2 and json.loads(usage.stdout)["error"]["kind"] == "usage"
    assert "usage" in usage.stderr and "invalid configuration" not in usage.stderr


def test_a_sink_answering_400_turns_health_degraded_with_the_latest_error(tmp_path):
    """The pager refuses every record (400): status (run without the secret) exits 4 naming the latest
    error, /healthz answers 503, and the sink's degraded gauge is 1, within the 30 s window."""
    with Emulator(vms=["myVM"], rate_limit=None) as emu, HttpPeer(default=Response(400, body=b"bad")) as pager:
        pager.queue(Response(503))  # the first error is a retryable one; the latest (shown) is http_400
        config = production_config(tmp_path / "config.toml", emu.url, tmp_path / "state", pager.url,
                                   extra='[telemetry]\nlisten = "127.0.0.1:0"\n')
        agent = AgentProcess(config, tmp_path / "agent.log", env={"SEFWD_WEBHOOK_SECRET": SECRET})
        try:
            found = wait_until(lambda: re.search(r"/healthz on (http://\S+)", agent.logs()) or not agent.alive(), 60,
                               "the telemetry listener")
            assert isinstance(found, re.Match), agent.logs()[-3000:]
            base = found.group(1).rstrip("/")

            def degraded() -> Any:
                res = sefwd("status", "--json", "--config", str(config))
                if res.returncode != 4:
                    return None
                return json.loads(res.stdout)

            # Deadline: the 30 s window (a dead letter makes it degraded at once; the report follows within 5 s).
            report = wait_until(degraded, 35, "status to say degraded")
            pager_health = report["agent"]["sinks"]["pager"]["health"]
            assert pager_health["state"] == "dead_lettering" and pager_health["last_error"] == "http_400"
            assert pager_health["errors"] >= 2 and pager_health["failing_since"]
            assert any("sink pager is dead-lettering" in r and "http_400" in r for r in report["health"]["reasons"])
            assert report["agent"]["sinks"]["file"]["health"]["state"] == "ok"
            text = sefwd("status", "--config", str(config))
            assert text.returncode == 4 and "latest error http_400" in text.stdout, text.stdout
            status, body = http_get(base + "/healthz")
            assert status == 503 and "pager" in body and "http_400" in body, body
            metrics = wait_until(lambda: http_get(base + "/metrics")[1], 10, "metrics")
            assert re.search(r'sefwd_sink_degraded\w*\{[^}]*sink="pager"[^}]*\} 1', metrics), metrics[-2000:]
        finally:
            agent.terminate()


def test_a_refused_imds_port_is_named_within_2_s_and_no_record_carries_a_made_up_identity(tmp_path):
    port = closed_port()
    out = tmp_path / "out.jsonl"
    config = tmp_path / "config.toml"
    config.write_text(f'[imds]\nendpoint = "http://127.0.0.1:{port}"\n[state]\ndir = "{tmp_path / "state"}"\n'
                      f'[[sinks]]\ntype = "file"\npath = "{out}"\n')
    agent = AgentProcess(config, tmp_path / "agent.log")
    try:
        # The 2 s count from the agent's start (its store open), not from the interpreter's imports.
        wait_until(lambda: (tmp_path / "state" / "state.db").exists(), 30, "the agent to open its store")
        line = wait_until(lambda: re.search(r"WARNING .*waiting for IMDS at \S+: .*connection refused.*", agent.logs()),
                          2.0, "the refused port named in the log")
        assert "first answer can take" not in line.group(0)

        def status_names_it() -> Any:
            res = sefwd("status", "--config", str(config))
            return res.returncode == 4 and "connection refused" in res.stdout and res.stdout

        wait_until(status_names_it, 10, "status to name the refusal")
    finally:
        assert agent.terminate() == 0
    assert "stopped before IMDS answered; no record written" in agent.logs()
    assert read_jsonl(out) == []  # no forwarder.started with a /host/<name> source


def test_a_busy_probe_port_fails_before_started(tmp_path):
    import socket

    with socket.socket() as busy, Emulator(vms=["myVM"], rate_limit=None) as emu:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = tmp_path / "out.jsonl"
        config = tmp_path / "config.toml"
        config.write_text(f'[imds]\nendpoint = "{emu.url}"\n[state]\ndir = "{tmp_path / "state"}"\n'
                          f'[probe]\nlisten = "127.0.0.1:{port}"\n[[sinks]]\ntype = "file"\npath = "{out}"\n')
        res = sefwd("run", "--config", str(config))
    assert res.returncode == 1, res.stderr  # not 2: a port in use is not a config error
    assert f"probe.listen 127.0.0.1:{port}: cannot listen: port {port} is in use" in res.stderr
    assert "started" not in res.stderr and "invalid configuration" not in res.stderr
    assert not out.exists() or read_jsonl(out) == []


def test_emulator_arm_exports_pasted_into_approve_via_arm(tmp_path):
    pytest.importorskip("azure.mgmt.core")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "SEFWD_", "IDENTITY_", "MSI_"))}
    env.update({"PYTHONPATH": str(ROOT), "HOME": str(tmp_path), "AZURE_CONFIG_DIR": str(tmp_path / ".azure"),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"})
    emulator = subprocess.Popen([sys.executable, "-m", "forwarder", "emulator", "--listen", "127.0.0.1:0", "--arm"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=str(ROOT))
    try:
        assert emulator.stdout is not None
        printed = []
        for line in emulator.stdout:  # the export block ends with the approve hint
            printed.append(line)
            if line.startswith("# then: sefwd approve"):
                break
        ca = re.search(r"REQUESTS_CA_BUNDLE=(\S+)", "".join(printed))
        assert ca is not None and Path(ca.group(1)).is_file(), printed
        resource = re.search(r"--resource-id (\S+)", printed[-1])
        assert resource is not None
        # Pasted as printed, then docs/emulator.md's two commands (the EventId from `ctl schedule`).
        script = "".join(printed) + (
            'set -e\nID=$(python -m forwarder emulator ctl "$SEFWD_IMDS_ENDPOINT" schedule --type Reboot '
            '--start-after 5m | python -c "import json,sys; print(json.load(sys.stdin)[\'EventId\'])")\n'
            f'python -m forwarder approve "$ID" --via arm --resource-id {resource.group(1)}\n'
            # The emulator took it through its ARM side (the event itself may be over by now: a Reboot runs on).
            'python -m forwarder emulator ctl "$SEFWD_IMDS_ENDPOINT" state | python -c "import json,sys; '
            'print(*[r.get(\'via\') for r in json.load(sys.stdin)[\'start_requests\'] if sys.argv[1] in r[\'event_ids\']])"'
            ' "$ID"\n')
        res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                             timeout=90)
        assert res.returncode == 0, res.stderr
        assert re.match(r"approved \S+\narm\n$", res.stdout), res.stdout
        assert res.stderr.count("\n") <= 2, res.stderr  # no credential dump on the way
    finally:
        emulator.terminate()
        emulator.wait(30)
    assert not Path(ca.group(1)).exists()  # the throwaway certificate is gone with the emulator
