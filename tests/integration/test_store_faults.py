"""Storage faults with the real agent: a full file system, a damaged or deleted database, wrong file
types in the state dir, a killed `deadletter replay`, a callback flood with a sink down."""
from __future__ import annotations

import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import orjson
import pytest
import requests

from forwarder.emulator import Emulator
from forwarder.common.signing import generate_secret
from forwarder.store.database import Store
from forwarder.store.recovery import SCHEMA_TABLES
from tests.agent import ROOT, AgentProcess, callback_url, read_jsonl, wait_until
from tests.integration.test_cli import sefwd
from benchmarks.peers.webhook_receiver import Reply, WebhookReceiver


def cfg(tmp_path: Path, emu: Emulator, rx: WebhookReceiver, state: Path, extra: str = "") -> Path:
    path = tmp_path / "c.toml"
    path.write_text(
        f'[imds]\nendpoint = "{emu.url}"\npoll_interval = "500ms"\nfirst_call_timeout = "10s"\n'
        f'[state]\ndir = "{state}"\n'
        f'[agent]\nheartbeat = "0"\ndrain_timeout = "1s"\nlog_level = "debug"\n'
        f'[delivery]\nretry_initial = "100ms"\nretry_max = "500ms"\n{extra}\n'
        f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{tmp_path / "out.jsonl"}"\n'
        f'[[sinks]]\ntype = "webhook"\nname = "hook"\nurl = "{rx.url}"\ntimeout = "2s"\n'
    )
    return path


def hook_records(rx: WebhookReceiver) -> list[dict]:
    return [r.json() for r in rx.requests if r.body]


def of_type(records: list[dict], rtype: str) -> list[dict]:
    return [r for r in records if r["type"] == rtype]


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 4 MiB tmpfs (root only; skipped where mounting is not permitted)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(directory: Path) -> Path:
    """Write a file until the file system is full; returns it."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as fh:  # unbuffered: nothing left for close() to fail on
        try:
            while True:
                fh.write(b"\0" * 65536)
        except OSError:
            pass
    return filler


def test_full_file_system_stops_commits_loudly_and_everything_delivers_when_space_returns(tmp_path, small_fs):
    with Emulator(vms=["myVM"], rate_limit=None) as emu, WebhookReceiver(default=200) as rx:
        config = cfg(tmp_path, emu, rx, small_fs / "state")
        agent = AgentProcess(config, tmp_path / "a.log")
        out = tmp_path / "out.jsonl"
        wait_until(lambda: of_type(hook_records(rx), "forwarder.started"), 60, "agent up")
        filler = fill(small_fs)
        ids = [emu.schedule(type="Reboot", resources=["myVM"], start_after=600) for _ in range(3)]
        wait_until(lambda: "could not commit" in agent.logs(), 60, "a loud failure")
        polls = emu.stats()["requests"]["myVM"]["GET"]
        wait_until(lambda: emu.stats()["requests"]["myVM"]["GET"] >= polls + 5, 30, "polls go on while the disk is full")
        assert not [r for r in read_jsonl(out) if r.get("subject") in ids]
        status = orjson.loads(sefwd("status", "--config", str(config), "--json").stdout)  # readable while full
        assert status["running"] is True
        filler.unlink()
        scheduled = lambda: {r["subject"] for r in of_type(hook_records(rx), "scheduledevent.scheduled")}  # noqa: E731
        wait_until(lambda: scheduled() >= set(ids), 60, "the changes committed and delivered once space returned")
        filler = fill(small_fs)  # full again while the sinks' cursors move: delivery must survive that too
        for event_id in ids:
            emu.cancel(event_id)
        wait_until(lambda: agent.logs().count("could not commit") >= 2, 60, "the second failure")
        filler.unlink()
        # (canceled, or ended with an unknown outcome: cancels the agent could not commit one by one
        # reach it as one step of several documents, which proves no cancel: docs/outcomes.md)
        canceled = lambda: {r["subject"] for r in hook_records(rx)  # noqa: E731
                            if r["type"] in ("scheduledevent.canceled", "scheduledevent.ended")}
        wait_until(lambda: canceled() >= set(ids), 60, "cancels delivered")
        wait_until(lambda: {r["id"] for r in read_jsonl(out)} <= {r["id"] for r in hook_records(rx)}, 30, "both sinks level")
        assert agent.alive() and "thread died" not in agent.logs()
        assert agent.terminate(timeout=30) == 0
    records = list({r["id"]: r for r in read_jsonl(out)}.values())
    seqs = sorted(int(r["sequence"]) for r in records)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "no record lost: sequence has no gap"


def test_a_start_on_a_full_file_system_waits_for_space_and_never_sets_a_good_database_aside(tmp_path, small_fs):
    state = small_fs / "state"
    with Emulator(vms=["myVM"], rate_limit=None) as emu, WebhookReceiver(default=200) as rx:
        config = cfg(tmp_path, emu, rx, state)
        agent = AgentProcess(config, tmp_path / "a1.log")
        first = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: [r for r in hook_records(rx) if r.get("subject") == first], 60, "first run delivered")
        assert agent.terminate() == 0
        filler = fill(small_fs)
        second = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        agent = AgentProcess(config, tmp_path / "a2.log")
        wait_until(lambda: "cannot open the store" in agent.logs() or "could not commit" in agent.logs(), 60,
                   "a loud failure while the disk is full")
        filler.unlink()
        wait_until(lambda: [r for r in hook_records(rx) if r.get("subject") == second], 60, "delivered once space returned")
        assert agent.terminate() == 0
    assert not list(state.glob("state.db.damaged-*")) and not of_type(hook_records(rx), "forwarder.data_lost")
    firsts = [r for r in hook_records(rx) if r.get("subject") == first and r["type"] == "scheduledevent.scheduled"]
    assert len({r["id"] for r in firsts}) == 1, "the state survived: the first event was not re-sent as Initial"


def undelivered(state: Path, sink: str) -> set[int]:
    """Sequence numbers of the records a sink has not delivered yet."""
    store = Store.open(state)
    try:
        rows = store.query("SELECT body FROM records WHERE id >= (SELECT next FROM cursors WHERE sink = ?)", (sink,))
    finally:
        store.close()
    return {int(orjson.loads(b)["sequence"]) for (b,) in rows}


def _checkpointed(state: Path) -> None:
    """After a clean stop the WAL is folded into state.db: damage to state.db hits the records."""
    assert (state / "state.db").is_file() and not (state / "state.db-wal").exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage_header", "flipped_pages", "emptied"])
def test_damaged_database_is_set_aside_salvaged_and_the_loss_announced(tmp_path, damage):
    state = tmp_path / "state"
    with Emulator(vms=["myVM"], rate_limit=None) as emu, WebhookReceiver(default=503) as rx:
        config = cfg(tmp_path, emu, rx, state)
        # No drain: the webhook refuses everything in this run (its records must stay undelivered).
        agent = AgentProcess(config, tmp_path / "a1.log", env={"SEFWD_AGENT_DRAIN_TIMEOUT": "0s"})
        ids = [emu.schedule(type="Reboot", resources=["myVM"], start_after=600) for _ in range(12)]
        wait_until(lambda: len(of_type(read_jsonl(tmp_path / "out.jsonl"), "scheduledevent.scheduled")) >= 12, 60,
                   "records committed while the webhook is down")
        assert agent.terminate() == 0
        written = undelivered(state, "hook")
        _checkpointed(state)
        db = state / "state.db"
        data = bytearray(db.read_bytes())
        if damage == "truncated":
            db.write_bytes(bytes(data[: len(data) // 2]))
        elif damage == "emptied":
            db.write_bytes(b"")
        elif damage == "garbage_header":
            db.write_bytes(b"\x99" * 100 + bytes(data[100:]))
        else:
            # Every other page after the first, from its b-tree page header on: free space inside
            # a page may hold nothing, so damage there would go unnoticed by any check.
            rng = random.Random(12)  # (the same damage every run)
            for page in range(1, len(data) // 4096, 2):
                data[page * 4096 : page * 4096 + 300] = rng.randbytes(300)
            db.write_bytes(bytes(data))
        rx.set_policy(200)
        rx.clear()  # (the refused attempts of the first run)
        agent = AgentProcess(config, tmp_path / "a2.log")
        lost = wait_until(lambda: of_type(hook_records(rx), "forwarder.data_lost"), 60, "the loss announced to the webhook")
        wait_until(lambda: of_type(read_jsonl(tmp_path / "out.jsonl"), "forwarder.data_lost"), 30, "and to the file sink")
        wait_until(lambda: (Store.open(state).meta().get("status") or b"").find(b"data_lost") >= 0, 30, "status shows it")
        status = orjson.loads(sefwd("status", "--config", str(config), "--json").stdout)
        assert agent.terminate() == 0
    data_lost = lost[0]["data"]
    assert data_lost["Reason"] in ("database_damaged", "database_unusable") and data_lost["RenamedTo"].startswith("state.db.damaged-")
    assert (state / data_lost["RenamedTo"]).is_file(), "the damaged database is kept, never deleted"
    assert status["agent"]["data_lost"]["RenamedTo"] == data_lost["RenamedTo"]
    assert status["lost"]["*"][data_lost["Reason"]] == 1
    assert "renamed it to" in agent.logs()
    delivered = {r["subject"] for r in of_type(hook_records(rx), "scheduledevent.scheduled")}
    assert delivered <= set(ids)
    # Every salvaged record reached the webhook (the loss was announced after them), or was set
    # aside as unreadable; what was written and not salvaged is counted, unless the record says
    # the records table was unreadable beyond counting.
    recovered = {int(r["sequence"]) for r in hook_records(rx)} & written
    unusable = [d for d in Store.open(state).dead_letters("hook") if d.reason == "record_damaged"]
    assert len(recovered) + len(unusable) == data_lost["SalvagedRecords"], (recovered, data_lost)
    if "records" in data_lost["UncountedTables"]:
        assert damage in ("emptied", "garbage_header", "flipped_pages") and len(recovered) < len(written)
    else:
        assert data_lost["SalvagedRecords"] + data_lost["UnreadableRows"] == len(written), (len(written), data_lost)
    if damage in ("emptied", "garbage_header"):  # nothing of the file is readable
        assert data_lost["SalvagedRecords"] == 0 and data_lost["UncountedTables"][:2] == ["records", "dead_letters"]
        # ... and every other table the store had is named too, none silently dropped (issue 20)
        assert set(data_lost["UncountedTables"]) == set(SCHEMA_TABLES)
        assert data_lost["UncountedRows"] == dict.fromkeys(SCHEMA_TABLES)
    if damage == "truncated":  # the first half of the file holds the schema: the loss is counted
        assert "records" not in data_lost["UncountedTables"]


@pytest.mark.parametrize("oddity", ["db_is_a_directory", "wal_is_a_directory", "lock_is_a_directory", "stray_files"])
def test_wrong_file_types_and_stray_files_never_stop_the_agent(tmp_path, oddity):
    state = tmp_path / "state"
    state.mkdir()
    if oddity == "db_is_a_directory":
        (state / "state.db").mkdir()
        (state / "state.db" / "inside").write_text("x")
    elif oddity == "wal_is_a_directory":
        (state / "state.db-wal").mkdir()
    elif oddity == "lock_is_a_directory":
        (state / "agent.lock").mkdir()
    else:
        (state / "seg-99999999999999999999.log").write_bytes(b"")
        (state / "journal").write_text("not a directory")
        (state / "cursors").mkdir()
        (state / "state.db-shm.tmp").write_bytes(os.urandom(64))
    with Emulator(vms=["myVM"], rate_limit=None) as emu, WebhookReceiver(default=200) as rx:
        config = cfg(tmp_path, emu, rx, state)
        agent = AgentProcess(config, tmp_path / "a.log")
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: [r for r in hook_records(rx) if r.get("subject") == event_id], 60, "delivery despite the oddity")
        assert agent.terminate() == 0
    assert (state / "state.db").is_file()
    if oddity != "stray_files":
        assert list(state.glob("*.aside-*")) or list(state.glob("state.db.damaged-*")), "the odd entry is kept aside"


def test_deleted_database_never_reuses_a_sequence_number(tmp_path):
    state = tmp_path / "state"
    with Emulator(vms=["myVM"], rate_limit=None) as emu, WebhookReceiver(default=200) as rx:
        config = cfg(tmp_path, emu, rx, state)
        agent = AgentProcess(config, tmp_path / "a1.log")
        emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: of_type(hook_records(rx), "scheduledevent.scheduled"), 60, "first run delivered")
        assert agent.kill() is None
        before = {int(r["sequence"]) for r in hook_records(rx)}
        for p in state.glob("state.db*"):
            p.unlink()
        agent = AgentProcess(config, tmp_path / "a2.log")
        wait_until(lambda: len(of_type(hook_records(rx), "scheduledevent.scheduled")) >= 2, 60, "re-sent as Initial")
        assert agent.terminate() == 0
    after = {int(r["sequence"]) for r in hook_records(rx)} - before
    assert after and min(after) > max(before), "a new database starts above every number handed out before"


def test_killed_deadletter_replay_loses_nothing(tmp_path):
    state = tmp_path / "state"
    with Emulator(vms=["myVM"], rate_limit=None) as emu, WebhookReceiver(default=400) as rx:
        config = cfg(tmp_path, emu, rx, state)
        agent = AgentProcess(config, tmp_path / "a.log")
        for _ in range(6):
            emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        wait_until(lambda: (state / "state.db").is_file(), 60, "the store")
        store = Store.open(state)
        wait_until(lambda: store.dead_counts().get("hook", 0) >= 7, 60, "dead letters")
        assert agent.terminate() == 0
        dead = {d.record.id for d in store.dead_letters("hook")}
        rx.set_policy(Reply(200, delay=0.5))  # slow enough to kill the replay half-way (4 answers, 2.5 s, left)
        rx.clear()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
        env["PYTHONPATH"] = str(ROOT)
        replay = subprocess.Popen([sys.executable, "-m", "forwarder", "deadletter", "replay", "hook", "--config", str(config)],
                                  env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: rx.count >= 3, 60, "replay under way")
        replay.send_signal(signal.SIGKILL)
        replay.wait(30)
        first = {r["id"] for r in hook_records(rx)}
        left = {d.record.id for d in store.dead_letters("hook")}
        assert left | first == dead, "every dead letter was delivered or is still there"
        assert left and len(left) < len(dead)
        rx.set_policy(200)
        done = sefwd("deadletter", "replay", "hook", "--config", str(config))
        assert done.returncode == 0, done.stderr
        assert {r["id"] for r in hook_records(rx)} == dead and store.dead_counts() == {}


RAISING_SINK = """
class RaisingSink:
    OPTIONS = {}
    max_batch = 2

    @classmethod
    def check(cls, options):
        return []

    def __init__(self, options, context):
        pass

    def send(self, batch):
        raise RuntimeError("the sink blew up")

    def close(self):
        pass
"""


def test_a_sink_that_raises_during_deadletter_replay_loses_no_dead_letter(tmp_path):
    # A third-party sink, installed as a plugin (entry point), that raises instead of answering.
    plugin = tmp_path / "plugin"
    (plugin / "raising_sink-1.0.dist-info").mkdir(parents=True)
    (plugin / "raising_sink.py").write_text(RAISING_SINK)
    (plugin / "raising_sink-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: raising-sink\nVersion: 1.0\n")
    (plugin / "raising_sink-1.0.dist-info" / "entry_points.txt").write_text(
        "[scheduled_events_forwarder.sinks]\nraising = raising_sink:RaisingSink\n")
    state = tmp_path / "state"
    config = tmp_path / "c.toml"
    config.write_text(f'[state]\ndir = "{state}"\n[[sinks]]\ntype = "raising"\nname = "x"\n')
    store = Store.open(state)
    bodies = [orjson.dumps({"id": f"dl{i}", "type": "scheduledevent.scheduled", "sequence": str(i)}) for i in range(3)]
    store.advance("x", 1, [(b, "http_400", "refused") for b in bodies], now="2026-01-01T00:00:00Z")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{plugin}"
    done = subprocess.run([sys.executable, "-m", "forwarder", "deadletter", "replay", "x", "--config", str(config)],
                          env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "replay stopped: RuntimeError: the sink blew up; the 3 dead letter(s) not delivered are kept" in done.stderr
    assert "replayed 0, still dead 3" in done.stderr and "Traceback" not in done.stderr
    kept = store.dead_letters("x")
    assert [(bytes(d.record.body), d.reason, d.detail) for d in kept] == [(b, "http_400", "refused") for b in bodies]
    store.close()


def test_callback_flood_with_a_sink_down_costs_a_few_records_and_evicts_no_scheduled_event(tmp_path):
    state = tmp_path / "state"
    extra = ('[journal]\nmax_size = "1MiB"\n[approval.callback]\nlisten = "127.0.0.1:0"\n'
             'secret_env = "CB_SECRET"\nrate_limit = 60\n')
    with Emulator(vms=["myVM"], rate_limit=None) as emu, WebhookReceiver(default=503) as rx:
        config = cfg(tmp_path, emu, rx, state, extra)
        agent = AgentProcess(config, tmp_path / "a.log", env={"CB_SECRET": generate_secret()})
        url = callback_url(agent)
        ids = [emu.schedule(type="Reboot", resources=["myVM"], start_after=600) for _ in range(3)]
        wait_until(lambda: len(of_type(read_jsonl(tmp_path / "out.jsonl"), "scheduledevent.scheduled")) >= 3, 60, "events")
        answers: list[int] = []

        def flood() -> None:
            answered = dropped = 0
            with requests.Session() as s:
                while answered < 300:
                    try:
                        answer = s.post(url, data=b'{"StartRequests":[]}', headers={"webhook-id": uuid.uuid4().hex},
                                        timeout=10)
                    except requests.ConnectionError:
                        # A connection over the per-client cap (8 open, counting those the server is still
                        # closing) is dropped before any request is read: nothing answered, nothing audited.
                        dropped += 1
                        assert dropped <= 300, f"{dropped} connections dropped, {answered} answered"
                        continue
                    answers.append(answer.status_code)
                    answered += 1

        threads = [threading.Thread(target=flood) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert answers.count(429) > 1000 and len(answers) == 1200, collections.Counter(answers)
        rx.set_policy(200)
        wait_until(lambda: {r["subject"] for r in of_type(hook_records(rx), "scheduledevent.scheduled")} >= set(ids), 60,
                   "every scheduled event delivered once the sink is back")
        assert agent.terminate() == 0
    refused = of_type(read_jsonl(tmp_path / "out.jsonl"), "approval.refused")
    assert 2 <= len(refused) <= 4, [(r["data"]["Reason"], r["data"]["Count"]) for r in refused]
    assert sum(r["data"]["Count"] for r in refused) == len(answers)
    assert Store.open(state).losses() == {}


def test_state_dir_layout_after_a_run_is_one_database(tmp_path):
    state = tmp_path / "state"
    with Emulator(vms=["myVM"], rate_limit=None) as emu, WebhookReceiver(default=200) as rx:
        agent = AgentProcess(cfg(tmp_path, emu, rx, state), tmp_path / "a.log")
        wait_until(lambda: hook_records(rx), 60, "agent up")
        assert agent.terminate() == 0
    assert sorted(p.name for p in state.iterdir() if p.name != "sinks") == ["agent.lock", "state.db"]
    shutil.rmtree(state)
