"""Connection strings checked the way the Azure SDKs will read them, so ``config check`` refuses
what would otherwise fail only when the sink or exporter starts.

Messages name fields, never values: a connection string carries a key.
"""
from __future__ import annotations

import re
from urllib.parse import urlsplit

from forwarder.common.values import control_characters

# The exporter's own pattern (azure-monitor-opentelemetry-exporter ConnectionStringParser): lower case only.
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _fields(text: str, *, strict: bool) -> dict[str, str]:
    """``Name=value;...`` as {lowercase name: value}; ``strict`` refuses what the App Insights parser does."""
    if not text.strip():
        raise ValueError("the connection string is empty")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        raise ValueError("the connection string contains control characters (CR, LF, NUL...)")
    fields: dict[str, str] = {}
    for part in text.split(";"):
        if not part.strip() and not strict:
            continue
        name, sep, value = part.partition("=")
        # App Insights splits each part on every "=" and needs exactly two pieces.
        if not sep or (strict and "=" in value):
            raise ValueError("the connection string is malformed: each part must be Name=value, separated by ';'")
        key = name.strip().lower()
        if key in fields:
            raise ValueError(f"the connection string has {name.strip()} twice")
        fields[key] = value.strip()
    return fields


def _url(value: str, field: str, scheme: str = "https") -> list[str]:
    if control_characters(value):
        return [f"the connection string's {field} contains spaces or control characters"]
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return [f"the connection string's {field} is not a valid URL"]
    if parts.scheme != scheme or not parts.hostname:
        return [f"the connection string's {field} must be an {scheme}:// URL with a host"]
    if parts.username is not None or parts.query or parts.fragment:
        return [f"the connection string's {field} must not carry credentials, a query or a fragment"]
    return []


# The Entra ID audiences of Azure Monitor ingestion (public cloud, US Government, China): a token
# for any other audience would be a token for another service, so a connection string (which is not
# a secret) cannot pick one.
AZURE_MONITOR_AUDIENCES = ("https://monitor.azure.com/", "https://monitor.azure.us/", "https://monitor.azure.cn/")


def monitor_audience(value: str) -> str:
    """``value`` as one of ``AZURE_MONITOR_AUDIENCES`` (case and a missing final slash forgiven); ValueError else."""
    canonical = value.strip().lower().rstrip("/") + "/"
    if canonical not in AZURE_MONITOR_AUDIENCES:
        raise ValueError("the connection string's AADAudience must be one of Azure Monitor's audiences ("
                         + ", ".join(AZURE_MONITOR_AUDIENCES) + "): a token for another audience is never requested")
    return canonical


def appinsights_problems(text: str) -> list[str]:
    """Problems with an Application Insights / Azure Monitor connection string (empty = usable)."""
    try:
        fields = _fields(text, strict=True)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    key = fields.get("instrumentationkey", "")
    if not key:
        problems.append("the connection string has no InstrumentationKey (copy it from the Application Insights resource)")
    elif not _UUID.match(key):
        problems.append("the connection string's InstrumentationKey must be a lower-case UUID "
                        "(xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx), as the exporter requires")
    auth = fields.get("authorization")
    if auth is not None and auth.lower() != "ikey":
        problems.append("the connection string's Authorization must be ikey (the exporter refuses others)")
    for field in ("IngestionEndpoint", "LiveEndpoint"):
        if fields.get(field.lower()):
            problems += _url(fields[field.lower()], field)
    if fields.get("aadaudience"):
        try:
            monitor_audience(fields["aadaudience"])
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def eventhubs_problems(text: str) -> list[str]:
    """Problems with an Event Hubs connection string (Endpoint, key or SAS); EntityPath is the caller's."""
    try:
        fields = _fields(text, strict=False)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    endpoint = fields.get("endpoint", "")
    if not endpoint:
        problems.append("the connection string has no Endpoint=sb://<namespace>/")
    else:
        problems += _url(endpoint, "Endpoint", "sb")
    has_key = bool(fields.get("sharedaccesskeyname")) and bool(fields.get("sharedaccesskey"))
    has_sas = bool(fields.get("sharedaccesssignature"))
    if not has_key and not has_sas:
        problems.append("the connection string needs SharedAccessKeyName and SharedAccessKey, or SharedAccessSignature")
    elif has_key and has_sas:
        problems.append("the connection string has both a SharedAccessKey and a SharedAccessSignature: keep one")
    entity = fields.get("entitypath")
    if entity is not None and (not entity or control_characters(entity) or "/" in entity):
        problems.append("the connection string's EntityPath must be a plain Event hub name")
    return problems
