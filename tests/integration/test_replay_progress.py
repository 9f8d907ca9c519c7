"""`sefwd deadletter replay` draws its progress bar (tqdm) only on a terminal: piped, it prints its
summary line and nothing else, so scripts and logs get no carriage-return noise."""
from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import uuid
from pathlib import Path

import orjson

from forwarder.store.database import Store
from tests.agent import ROOT, write_config
from benchmarks.peers.webhook_receiver import WebhookReceiver

COUNT = 5


def _dead_letters(state: Path) -> set[str]:
    """Five webhook dead letters, written the way a sink worker sets records aside."""
    ids = {str(uuid.uuid4()) for _ in range(COUNT)}
    bodies = [orjson.dumps({"specversion": "1.0", "id": i, "source": "/vm/test", "type": "scheduledevent.scheduled",
                            "subject": "E1", "time": "2026-11-24T00:00:00.000Z", "data": {}}) for i in sorted(ids)]
    store = Store.open(state)
    try:
        store.advance("hook", 0, [(body, "http_400", "refused") for body in bodies], now="2026-11-24T00:00:00Z")
    finally:
        store.close()
    return ids


def _replay(config: Path, stderr: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    env["PYTHONPATH"] = str(ROOT)
    env.pop("TQDM_DISABLE", None)
    return subprocess.Popen([sys.executable, "-m", "forwarder", "deadletter", "replay", "hook", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=str(ROOT))


def _config(tmp_path: Path, rx: WebhookReceiver) -> Path:
    sinks = f'[[sinks]]\ntype = "webhook"\nname = "hook"\nurl = "{rx.url}"\n'
    return write_config(tmp_path / "c.toml", "http://127.0.0.1:9", tmp_path / "state", sinks=sinks)


def test_piped_replay_prints_only_its_summary(tmp_path):
    with WebhookReceiver(default=200) as rx:
        config = _config(tmp_path, rx)
        ids = _dead_letters(tmp_path / "state")
        proc = _replay(config, subprocess.PIPE)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out == b""
        text = err.decode()
        assert text.splitlines()[-1] == f"sink hook: replayed {COUNT}, still dead 0"
        assert "\r" not in text and "%|" not in text and "record/s" not in text, text  # no bar, not even its last frame
        assert {r.json()["id"] for r in rx.wait_for(COUNT, 10)} == ids


def test_replay_on_a_terminal_draws_a_progress_bar(tmp_path):
    with WebhookReceiver(default=200) as rx:
        config = _config(tmp_path, rx)
        _dead_letters(tmp_path / "state")
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a width
        try:
            proc = _replay(config, slave)
            os.close(slave)
            chunks = []
            while True:  # read until the child closes the terminal (EIO on Linux, b"" elsewhere)
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            assert proc.wait(120) == 0
        finally:
            os.close(master)
        text = b"".join(chunks).decode(errors="replace")
        assert f"0/{COUNT}" in text and "record/s" in text, text  # tqdm's bar: n/total and the rate
        assert f"sink hook: replayed {COUNT}, still dead 0" in text
