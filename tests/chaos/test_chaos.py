"""Oracle test: uniquely identified events, a flapping webhook, and the agent SIGKILLed 20+ times.

Afterwards every record the agent produced must be in both sinks with identical payloads; the
per-VM sequence numbers must have no gap (nothing committed was lost); every event the agent saw
must end with a completed/canceled record. Duplicates are expected (at-least-once) and reported.
"""
from __future__ import annotations

import random
import threading
from collections import Counter

import orjson
import pytest

from forwarder.emulator import Emulator
from tests.agent import AgentProcess, read_jsonl, wait_until
from benchmarks.peers.webhook_receiver import Reply, WebhookReceiver

EVENTS = 110
KILLS = 22
SEED = 20261122


class FlappingPolicy:
    """503, 429 + Retry-After, a hang past the client timeout, or 200 — at random."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.lock = threading.Lock()
        self.accepted: dict[str, list[bytes]] = {}
        self.answers: Counter[str] = Counter()

    def __call__(self, request) -> Reply:
        with self.lock:
            roll = self.rng.random()
            if roll < 0.15:
                self.answers["503"] += 1
                return Reply(503)
            if roll < 0.25:
                self.answers["429"] += 1
                return Reply(429, headers={"Retry-After": "0"})
            if roll < 0.30:
                self.answers["hang"] += 1
                return Reply(200, delay=1.5)  # the sink's timeout is 1s: not accepted
            self.answers["200"] += 1
            record = orjson.loads(request.body)
            self.accepted.setdefault(record["id"], []).append(request.body)
            return Reply(200)


def generate_events(emu: Emulator, rng: random.Random, done: threading.Event) -> list[str]:
    ids = []
    for n in range(EVENTS):
        event_id = f"CHAOS-{n:04d}-{rng.randrange(16**8):08X}"
        ids.append(event_id)
        kind = rng.choice(["Freeze", "Reboot", "Redeploy"])
        emu.schedule(id=event_id, type=kind, resources=["myVM"], duration=rng.choice([-1, 5]),
                     start_after=rng.uniform(1.0, 3.0), complete_after=rng.uniform(1.0, 2.5))
        if rng.random() < 0.25:
            threading.Timer(rng.uniform(0.2, 0.8), lambda i=event_id: _cancel(emu, i)).start()
        done.wait(rng.uniform(0.25, 0.6))
    done.set()
    return ids


def _polls(emu: Emulator) -> int:
    return sum(v["GET"] for v in emu.stats()["requests"].values())


def _cancel(emu: Emulator, event_id: str) -> None:
    try:
        emu.cancel(event_id)
    except Exception:  # already started: a cancel is then simply not possible
        pass


@pytest.mark.slow
def test_chaos_sigkill_and_flapping_webhook(tmp_path):
    rng = random.Random(SEED)
    policy = FlappingPolicy(random.Random(SEED + 1))
    out = tmp_path / "out.jsonl"
    with Emulator(vms=["myVM"], rate_limit=None) as emu, WebhookReceiver(policy) as rx:
        config = tmp_path / "c.toml"
        config.write_text(
            f'[imds]\nendpoint = "{emu.url}"\npoll_interval = "500ms"\n'
            f'[state]\ndir = "{tmp_path / "state"}"\n'
            f'[agent]\nheartbeat = "0"\ndrain_timeout = "1s"\n'
            f'[delivery]\nretry_initial = "50ms"\nretry_max = "400ms"\n'
            f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{out}"\n'
            f'[[sinks]]\ntype = "webhook"\nname = "hook"\nurl = "{rx.url}"\ntimeout = "1s"\n'
        )
        agent = AgentProcess(config, tmp_path / "agent-0.log")
        wait_until(lambda: read_jsonl(out), 60, "first agent up")
        generated = threading.Event()
        ids: list[str] = []
        gen = threading.Thread(target=lambda: ids.extend(generate_events(emu, rng, generated)))
        gen.start()
        kills = 0
        stop_killing = threading.Event()
        polls_at_start = 0
        while kills < KILLS:
            # Each agent is killed at a random moment of its work, not of its start-up (on a loaded machine a
            # start can take seconds: killed before its first poll, it would have seen nothing).
            wait_until(lambda: _polls(emu) > polls_at_start, 120, f"agent {kills} polling")
            stop_killing.wait(rng.uniform(0.3, 2.5))  # a random moment, not a synchronization
            agent.kill()
            kills += 1
            polls_at_start = _polls(emu)
            agent = AgentProcess(config, tmp_path / f"agent-{kills}.log")
        gen.join(300)
        assert generated.is_set()
        # Let the last agent see every event end and deliver everything.
        wait_until(lambda: not emu.stats()["events"], 120, "all emulator events over")
        polls = _polls(emu)
        wait_until(lambda: _polls(emu) >= polls + 5, 60, "final polls")

        def caught_up() -> bool:
            ids_in_file = {r["id"] for r in read_jsonl(out)}
            return ids_in_file and ids_in_file <= set(policy.accepted)

        wait_until(caught_up, 180, "webhook caught up with the file sink")
        assert agent.terminate(timeout=60) == 0
    file_records = read_jsonl(out)
    file_by_id: dict[str, list[bytes]] = {}
    for r in file_records:
        file_by_id.setdefault(r["id"], []).append(orjson.dumps(r))
    hook_by_id = {i: [orjson.dumps(orjson.loads(b)) for b in bodies] for i, bodies in policy.accepted.items()}
    produced = set(file_by_id) | set(hook_by_id)
    # forwarder.stopped of the last run is written while the webhook may already be shut out.
    missing_file = produced - set(file_by_id)
    missing_hook = {i for i in produced - set(hook_by_id) if orjson.loads(file_by_id[i][0])["type"] != "forwarder.stopped"}
    assert not missing_file and not missing_hook, (missing_file, missing_hook)
    for rid in produced:
        copies = set(file_by_id.get(rid, [])) | set(hook_by_id.get(rid, []))
        assert len(copies) == 1, f"record {rid} arrived with different payloads"
    records = {rid: orjson.loads(next(iter(file_by_id.get(rid) or hook_by_id[rid]))) for rid in produced}
    by_seq: dict[int, str] = {}
    for rid, r in records.items():
        seq = int(r["sequence"])
        assert by_seq.setdefault(seq, rid) == rid, f"sequence {seq} used by two records"
    seqs = sorted(by_seq)
    # A new store starts its counter at a wall-clock floor (never reused), then counts up by one.
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a gap in the sequence means a lost record"
    transitions = [r for r in records.values() if r["type"].startswith("scheduledevent.")]
    seen_events = {r["subject"] for r in transitions}
    for event_id in seen_events:
        kinds = [r["data"]["Change"] for r in sorted(transitions, key=lambda r: int(r["sequence"])) if r["subject"] == event_id]
        assert kinds[-1] in ("completed", "canceled", "ended"), (event_id, kinds)  # ended: outcome unknown
    assert seen_events <= set(ids)
    assert len(transitions) >= 200, f"only {len(transitions)} transitions observed"
    assert kills >= 20
    dup_file = sum(len(v) - 1 for v in file_by_id.values())
    dup_hook = sum(len(v) - 1 for v in hook_by_id.values())
    print(
        f"\nchaos: {len(ids)} events, {len(transitions)} transitions observed, {len(records)} records, "
        f"{kills} SIGKILLs, missing 0, duplicates file={dup_file} webhook={dup_hook}, "
        f"webhook answers {dict(policy.answers)}"
    )
