"""The remote approver with its state on Azure Table Storage (Azurite on this machine): records decided
per second by one instance, and by 1, 2 and 4 instances sharing one table.

The stream: every event names two VMs, each reports it (the leader's record is approvable: a signed,
user-initiated reboot), and every record arrives twice (a redelivery), so a decision is a mix of the
three paths: approve (a replay claim, a de-duplication claim, the callback, two settles), replay (a
refused insert and a read) and skip (no table call). Records are split between instances by EventId, as
the Event Hubs trigger's partitions split the stream (the eventhubs sink's partition key is the EventId).
Each instance is ``benchmarks/approver_worker.py`` (the real ``pipeline.RemoteApprover``, its settings
from the environment) approving through a loopback callback receiver; its own time counts from its first
record to its last (imports and start-up excluded), and the fleet's rate is all records over the slowest
instance's time. Beside it, one instance on the SQLite replay cache (STATE_BACKEND=sqlite) for scale.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.approver_worker import APP_DIR
from benchmarks.common import Sizes, goal, result, run_standalone, scratch_dir
from benchmarks.peers.approval_receiver import ApprovalReceiver
from benchmarks.peers.azurite_peer import AzuritePeer
from forwarder.common.fleet_keys import RECORD_PURPOSE, derive_key
from forwarder.common.record_auth import sign_record
from forwarder.common.signing import generate_secret, parse_secret

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "approver_worker.py"
INSTANCES = (1, 2, 4)
RID = "/subscriptions/8d10da13-8125-4ba9-a717-bf7490507b3d/resourceGroups/bench/providers/Microsoft.Compute/virtualMachines/"


@dataclass(frozen=True)
class _Plan:
    events: int  # each: 2 VMs x 1 record x 2 deliveries = 4 records


PLANS = {"full": _Plan(200), "quick": _Plan(80), "smoke": _Plan(6)}


def _stream(events: int, master: bytes) -> list[dict[str, Any]]:
    now = datetime.now(timezone.utc).isoformat()
    records = []
    for n in range(events):
        event_id = str(uuid.UUID(int=0xB0A70000_0000_4000_8000_000000000000 + n)).upper()
        pair = [f"bench-vm-{2 * n:04d}", f"bench-vm-{2 * n + 1:04d}"]
        for vm in pair:
            rec = {"specversion": "1.0", "id": str(uuid.uuid4()), "type": "scheduledevent.scheduled",
                   "source": RID + vm, "subject": event_id, "time": now,
                   "data": {"EventId": event_id, "EventType": "Reboot", "EventSource": "User", "EventStatus": "Scheduled",
                            "Resources": pair, "DurationInSeconds": -1, "Vm": {"Name": vm, "ResourceId": RID + vm}}}
            records.append(sign_record(derive_key(master, RECORD_PURPOSE, RID + vm), rec))
    return [r for r in records for _ in range(2)]


def _fleet(name: str, records: list[dict[str, Any]], instances: int, env: dict[str, str], tmp: Path) -> dict[str, Any]:
    """Split the stream by EventId over ``instances`` worker processes; their decisions and times."""
    feeds: list[list[dict[str, Any]]] = [[] for _ in range(instances)]
    for rec in records:
        feeds[zlib.crc32(rec["subject"].encode()) % instances].append(rec)
    procs = []
    for n, feed in enumerate(feeds):
        path = tmp / f"feed-{name}-{n}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in feed))
        local = {"SEEN_RECORDS_PATH": str(tmp / f"seen-{name}-{n}.db")}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(path), str(tmp / f"out-{name}-{n}.jsonl")],
                                      env={**env, **local}, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    seconds = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"approver worker failed: {err.decode()[-2000:]}")
        seconds.append(json.loads(out.decode().strip().splitlines()[-1])["seconds"])
    decisions: dict[str, int] = {}
    for n in range(instances):
        for line in (tmp / f"out-{name}-{n}.jsonl").read_text().splitlines():
            decision = json.loads(line)["decision"]
            decisions[decision] = decisions.get(decision, 0) + 1
    return {"seconds": max(seconds), "decisions": decisions}


def run(sizes: Sizes) -> dict[str, Any]:
    plan = PLANS[sizes.name]
    master_secret = generate_secret()
    records = _stream(plan.events, parse_secret(master_secret))
    figures: dict[str, Any] = {"records": len(records), "events": plan.events, "records_per_s": {},
                               "scaling": {}, "decisions": {}}
    exact = True
    receiver = ApprovalReceiver()
    try:
        with scratch_dir("approver-state-") as tmp, AzuritePeer(log=tmp / "azurite.log") as azurite:
            base = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(APP_DIR))),
                    "SEFWD_MASTER_SECRET": master_secret,
                    "CALLBACK_URL_TEMPLATE": receiver.url_template,
                    "CALLBACK_ATTEMPTS": "1", "RECORD_MAX_AGE_SECONDS": "86400"}
            runs = [("sqlite_1", 1, {"STATE_BACKEND": "sqlite"})]
            runs += [(f"table_{k}", k, {"STATE_BACKEND": "table", "STATE_TABLE_CONNECTION": azurite.connection_string,
                                        "STATE_TABLE_NAME": f"bench{uuid.uuid4().hex[:12]}"}) for k in INSTANCES]
            for name, instances, env in runs:
                receiver.approved.clear()
                fleet = _fleet(name, records, instances, {**base, **env}, tmp)
                figures["records_per_s"][name] = round(len(records) / fleet["seconds"], 1)
                figures["decisions"][name] = fleet["decisions"]
                exact &= dict(receiver.approved) == {(r["data"]["Resources"][0], r["subject"]): 1 for r in records}
    finally:
        receiver.close()
    one = figures["records_per_s"]["table_1"]
    figures["scaling"] = {f"x{k}": round(figures["records_per_s"][f"table_{k}"] / one, 2) for k in INSTANCES}
    figures["nproc"] = os.cpu_count()
    figures["load_average"] = round(os.getloadavg()[0], 1)  # the machine is shared: the rates follow its load
    goals = [goal("every event approved exactly once, by every fleet size and backend", exact)]
    return result(figures, goals)


def main(argv: list[str] | None = None) -> int:
    def show(figures: dict[str, Any]) -> list[str]:
        return ([f"{figures['records']} records ({figures['events']} events, 2 VMs each, every record twice)"]
                + [f"  {name:<10} {rps:>8} records/s" for name, rps in figures["records_per_s"].items()]
                + [f"  scaling {figures['scaling']} (on {figures['nproc']} cores, Azurite included)"])
    return run_standalone("approver_state", "approver_state.json", run, prog="python -m benchmarks.approver_state",
                          description=__doc__ or "", quick_help="fewer events", show=show, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
