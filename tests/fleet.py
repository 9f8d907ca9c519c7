"""A test fleet for the stream's trust boundary: one master secret, per-VM keys, signed records."""
from __future__ import annotations

import functools
import sys
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from forwarder.common.fleet_keys import CALLBACK_PURPOSE, RECORD_PURPOSE, as_secret, derive_key
from forwarder.common.record_auth import sign_record
from forwarder.common.signing import parse_secret
from forwarder.emulator.model import VmProfile

APP_DIR = Path(__file__).resolve().parents[1] / "deploy" / "consumers" / "remote-approver"
if str(APP_DIR) not in sys.path:
    sys.path.insert(0, str(APP_DIR))

MASTER_SECRET = "whsec_" + "bWFzdGVyLXNlY3JldC1vZi10aGUtdGVzdC1mbGVldCEh"
MASTER = parse_secret(MASTER_SECRET)


def resource_id(vm: str) -> str:
    """The resourceId the emulator gives VM ``vm`` (scale-set names included)."""
    return VmProfile(vm).resource_id


def record_key(vm: str, master: bytes = MASTER) -> bytes:
    return derive_key(master, RECORD_PURPOSE, resource_id(vm))


def callback_secret(vm: str, master: bytes = MASTER) -> str:
    return as_secret(derive_key(master, CALLBACK_PURPOSE, resource_id(vm)))


def now_text() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def record(etype: str = "Freeze", source: str = "Platform", duration: Any = 5, status: str = "Scheduled",
           resources: list[str] | None = None, rtype: str = "scheduledevent.scheduled", seen_by: str = "WestNO_0",
           event_id: str = "EV-1", *, signer: str | None = None, claim: str | None = None,
           time: str | None = None) -> dict[str, Any]:
    """A record as VM ``seen_by``'s agent makes it, signed with ``signer``'s key (default: its own;
    "" leaves it unsigned); ``claim`` puts another VM in ``source``."""
    data = {"EventId": event_id, "EventType": etype, "EventSource": source, "EventStatus": status,
            "DurationInSeconds": duration, "Resources": resources if resources is not None else ["WestNO_1", "WestNO_0"],
            "Vm": {"Name": claim or seen_by, "ResourceId": resource_id(claim or seen_by)}}
    rec = {"specversion": "1.0", "id": str(uuid.uuid4()), "type": rtype, "source": resource_id(claim or seen_by),
           "time": time or now_text(), "eventkey": f"{event_id}:{rtype.rpartition('.')[2]}", "data": data}
    signer = seen_by if signer is None else signer
    return sign_record(record_key(signer), rec) if signer else rec


@functools.lru_cache(maxsize=1)
def function_handlers() -> dict[str, Any]:
    """The remote-approver Function's handlers by function name, as the Functions host indexes them.

    Once per process: azure-functions' ``FunctionApp.get_functions`` refuses a second indexing of
    the same app ("does not have a unique function name"), and test files share the process.
    """
    import function_app

    return {f.get_function_name(): f.get_user_function() for f in function_app.app.get_functions()}
