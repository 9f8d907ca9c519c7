"""Lazy imports: a stdout/file/webhook agent never imports an Azure SDK or OpenTelemetry; a sink whose
extra is missing is a config error naming the pip extra."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from forwarder.emulator import Emulator
from tests.agent import ROOT, read_jsonl, wait_until, write_config
from tests.peers.http_peer import HttpPeer

# Runs `sefwd run` (forwarder.agent.cli.main) in the subprocess's main thread; a watcher thread waits for
# the test's go-ahead file, writes the imported module names, then stops the agent with SIGTERM.
RUNNER = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    config, go, result = sys.argv[1:4]

    def watch():
        while not os.path.exists(go):
            time.sleep(0.05)
        with open(result, "w") as f:
            json.dump(sorted(sys.modules), f)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()
    from forwarder.agent.cli import main
    sys.exit(main(["run", "--config", config]))
""")


def _modules_of_a_run(tmp_path, with_webhook: bool) -> list[str]:
    """Run an agent with file + stdout (+ webhook) sinks until an event is delivered; its sys.modules."""
    out = tmp_path / "out.jsonl"
    go, result = tmp_path / "go", tmp_path / "modules.json"
    with Emulator(vms=["web-0"]) as emu, HttpPeer() as receiver:
        sinks = (f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{out}"\n'
                 '[[sinks]]\ntype = "stdout"\nname = "stdout"\n')
        if with_webhook:
            sinks += f'[[sinks]]\ntype = "webhook"\nname = "hook"\nurl = "{receiver.url}/events"\n'
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state", sinks=sinks)
        event_id = emu.schedule(type="Reboot", resources=["web-0"], start_after=600)
        proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(config), str(go), str(result)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
        try:
            wait_until(lambda: any(r.get("subject") == event_id for r in read_jsonl(out)), 60, "the record in the file")
            if with_webhook:
                wait_until(lambda: any(event_id.encode() in r.body for r in receiver.requests), 30, "the webhook")
            go.touch()
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    assert event_id.encode() in stdout  # the stdout sink delivered too
    modules: list[str] = json.loads(result.read_text())
    assert "forwarder.agent.service" in modules and "forwarder.imds.client" in modules  # the check looked at a real run
    return modules


def test_stdout_file_webhook_agent_imports_no_azure_sdk_and_no_opentelemetry(tmp_path):
    modules = _modules_of_a_run(tmp_path, with_webhook=True)
    assert "sinks.webhook" in modules
    heavy = [m for m in modules if m.startswith(("azure", "opentelemetry", "prometheus_client"))]
    assert heavy == []


def test_polling_itself_never_loads_requests(tmp_path):
    # requests costs ~18 MiB and ~140 ms at start and was most of the CPU of an unchanged poll; the
    # IMDS client does without it, and only the webhook sink brings it in (docs/performance.md).
    modules = _modules_of_a_run(tmp_path, with_webhook=False)
    assert [m for m in modules if m.split(".")[0] in ("requests", "urllib3")] == []


def test_configured_sink_with_missing_extra_names_the_pip_extra(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'[state]\ndir = "{tmp_path / "s"}"\n'
                      '[[sinks]]\ntype = "appinsights"\nname = "ai"\nconnection_string_env = "TEST_AI_CONN"\n'
                      'credential = "managed_identity"\n')
    script = textwrap.dedent(f"""
        import sys
        sys.modules["azure.identity"] = None  # as if the extra were not installed
        from forwarder.agent.config import load_config
        from forwarder.errors import ConfigError
        try:
            load_config({str(config)!r}, env={{"TEST_AI_CONN": "InstrumentationKey=00000000-0000-0000-0000-000000000000"}})
        except ConfigError as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "sinks[0] (ai)" in out.stdout, out.stdout + out.stderr
    assert "pip install 'scheduled-events-forwarder[appinsights]'" in out.stdout
