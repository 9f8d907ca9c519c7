"""The one flat row shape of the ``loganalytics`` sink: columns of ``SefwdEvents_CL`` and ``to_row``.

The sink uploads these rows, and ``deploy/azure/loganalytics/generate.py`` writes the table and
the DCR stream declaration from ``COLUMNS``, so the code and the Azure side cannot drift apart
(``tests/unit/test_la_schema.py`` checks that the committed template still matches).

Every CloudEvents record becomes one row: the envelope, the Scheduled Events fields, the
approval audit fields and the VM identity get typed columns; whatever else ``data`` carries
(heartbeat counters, ``EventIds`` of an approval, unknown IMDS fields under ``Extra``, ...) goes
into the ``Data`` dynamic column, so nothing is lost and new record fields need no new column.

Log Analytics silently truncates a field value above 64 KB. Rather than let it cut a JSON value
in half, every string and dynamic value is capped here at ``MAX_VALUE_BYTES`` (32 KiB, UTF-8):
a string keeps its head plus a ``…[truncated N bytes]`` marker; a dynamic value too large becomes
``{"Truncated": true, "OriginalBytes": N, "Json": "<head of its JSON text>"}``. Real Scheduled
Events fields are far below this; the cap only guards against a pathological document.
"""
from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import orjson

TABLE = "SefwdEvents_CL"
STREAM = "Custom-SefwdEvents"
OUTPUT_STREAM = f"Custom-{TABLE}"

# Table column types accepted by Log Analytics custom tables (the DCR spells dateTime "datetime").
TYPES = ("string", "int", "long", "real", "boolean", "dateTime", "dynamic")
MAX_NAME_LENGTH = 45
MAX_VALUE_BYTES = 32 * 1024

COLUMNS: tuple[tuple[str, str], ...] = (
    ("TimeGenerated", "dateTime"),      # the record's `time`: when the agent observed the change
    # CloudEvents envelope
    ("RecordId", "string"),
    ("RecordType", "string"),
    ("Source", "string"),
    ("Subject", "string"),
    ("Sequence", "long"),               # per-VM counter: order rows of one VM by it
    ("EventKey", "string"),             # fleet-wide de-duplication key
    # Scheduled Events fields (IMDS names)
    ("EventId", "string"),
    ("EventType", "string"),
    ("EventStatus", "string"),
    ("EventSource", "string"),
    ("ResourceType", "string"),
    ("Resources", "dynamic"),
    ("NotBefore", "dateTime"),
    ("NotBeforeRaw", "string"),
    ("Description", "string"),
    ("DurationInSeconds", "int"),
    # what the agent derived
    ("Change", "string"),
    ("PreviousStatus", "string"),
    ("ChangedFields", "dynamic"),
    ("RemovalReason", "string"),
    ("Initial", "boolean"),
    ("DocumentIncarnation", "long"),    # an opaque (non-integer) incarnation stays in Data
    ("AffectsThisVm", "boolean"),
    ("ApiVersion", "string"),
    # the VM that saw it
    ("VmId", "string"),
    ("VmName", "string"),
    ("ComputerName", "string"),
    ("ResourceId", "string"),
    ("SubscriptionId", "string"),
    ("ResourceGroupName", "string"),
    ("Location", "string"),
    ("Zone", "string"),
    ("VmScaleSetName", "string"),
    # approval audit records (Reason also carries forwarder.stopped's reason)
    ("Outcome", "string"),
    ("Actor", "string"),
    ("Approver", "string"),
    ("Rule", "string"),
    ("Reason", "string"),
    ("Detail", "string"),
    ("Client", "string"),
    # everything else in `data`
    ("Data", "dynamic"),
)

COLUMN_TYPES: dict[str, str] = dict(COLUMNS)

_ENVELOPE = {"RecordId": "id", "RecordType": "type", "Source": "source", "Subject": "subject", "EventKey": "eventkey"}
_VM = {
    "VmId": "VmId", "VmName": "Name", "ComputerName": "ComputerName", "ResourceId": "ResourceId",
    "SubscriptionId": "SubscriptionId", "ResourceGroupName": "ResourceGroupName", "Location": "Location",
    "Zone": "Zone", "VmScaleSetName": "VmScaleSetName",
}
# Columns filled from `data` under the same name.
_DATA = tuple(
    name for name, _ in COLUMNS
    if name not in _ENVELOPE and name not in _VM and name not in ("TimeGenerated", "Sequence", "Data")
)


def dcr_type(column_type: str) -> str:
    """The DCR streamDeclarations spelling of a table column type."""
    return "datetime" if column_type == "dateTime" else column_type


def _cap_string(text: str) -> str:
    raw = text.encode()
    if len(raw) <= MAX_VALUE_BYTES:
        return text
    head = raw[: MAX_VALUE_BYTES - 64].decode("utf-8", "ignore")
    return f"{head}…[truncated {len(raw) - len(head.encode())} bytes]"


def _cap_dynamic(value: Any) -> Any:
    text = orjson.dumps(value, default=str)
    if len(text) <= MAX_VALUE_BYTES:
        return value
    head = text[: MAX_VALUE_BYTES - 256].decode("utf-8", "ignore")
    return {"Truncated": True, "OriginalBytes": len(text), "Json": head}


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _coerce(column_type: str, value: Any) -> Any:
    """``value`` in the column's type, or None when it does not fit (the caller keeps the raw)."""
    if value is None:
        return None
    if column_type == "string":
        return _cap_string(value if isinstance(value, str) else orjson.dumps(value, default=str).decode())
    if column_type in ("int", "long"):
        return _as_int(value)
    if column_type == "boolean":
        return value if isinstance(value, bool) else None
    if column_type == "dateTime":
        return value if isinstance(value, str) and value else None
    if column_type == "dynamic":
        return _cap_dynamic(value)
    return value


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def to_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten one CloudEvents record (a dict) into a row with exactly the ``COLUMNS`` keys."""
    data = record.get("data")
    data = dict(data) if isinstance(data, Mapping) else ({} if data is None else {"Value": data})
    vm = data.pop("Vm", None)
    vm = dict(vm) if isinstance(vm, Mapping) else {}
    row: dict[str, Any] = {"TimeGenerated": record.get("time") or _now()}
    for column, key in _ENVELOPE.items():
        row[column] = _coerce("string", record.get(key))
    row["Sequence"] = _as_int(record.get("sequence"))
    leftover: dict[str, Any] = {}
    for column in _DATA:
        value = data.pop(column, None)
        row[column] = _coerce(COLUMN_TYPES[column], value)
        if row[column] is None and value is not None:
            leftover[column] = value  # e.g. an opaque DocumentIncarnation: keep it, typed columns stay typed
    for column, key in _VM.items():
        row[column] = _coerce("string", vm.pop(key, None))
    if vm:
        leftover["Vm"] = vm
    leftover.update((k, v) for k, v in data.items() if v is not None and v != {} and v != [])
    row["Data"] = _coerce("dynamic", leftover) if leftover else None
    return {name: row[name] for name, _ in COLUMNS}
