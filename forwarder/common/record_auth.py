"""The per-VM record authenticator: the CloudEvents extension ``sefwdauth`` (docs/security-model.md).

``sefwdauth = "v1," + base64(HMAC-SHA256(k_vm, canonical(record without sefwdauth)))`` where
``k_vm`` is the VM's ``vm-key`` (forwarder.common.fleet_keys, derived for the record's
``source``) and ``canonical`` is the record as JSON with keys sorted at every level, no
whitespace (separators ``,`` and ``:``), non-ASCII characters unescaped, UTF-8 encoded: Python's
``json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``. A consumer
parses the record it received, removes ``sefwdauth``, re-serializes the same way and compares:
any change to any attribute or data field, or a record signed with another VM's key, fails.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

import orjson

ATTRIBUTE = "sefwdauth"
VERSION = "v1"


def canonical(record: Mapping[str, Any]) -> bytes:
    """The bytes the authenticator covers: every attribute but ``sefwdauth``, canonical JSON."""
    body = {k: v for k, v in record.items() if k != ATTRIBUTE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def authenticator(key: bytes, record: Mapping[str, Any]) -> str:
    """The ``sefwdauth`` value of ``record`` under ``key``."""
    digest = hmac.new(key, canonical(record), hashlib.sha256).digest()
    return f"{VERSION},{base64.b64encode(digest).decode('ascii')}"


def sign_record(key: bytes, envelope: dict[str, Any]) -> dict[str, Any]:
    """``envelope`` with its ``sefwdauth`` set; the values are read back as JSON first, so the
    consumer's parse gives exactly what was signed (orjson serializes a few types json cannot)."""
    plain = orjson.loads(orjson.dumps({k: v for k, v in envelope.items() if k != ATTRIBUTE}))
    envelope[ATTRIBUTE] = authenticator(key, plain)
    return envelope


def verify_record(key: bytes, record: Mapping[str, Any]) -> bool:
    """True when ``record`` carries a valid ``sefwdauth`` under ``key`` (constant-time compare)."""
    claimed = record.get(ATTRIBUTE)
    if not isinstance(claimed, str):
        return False
    try:
        expected = authenticator(key, record)
    except (TypeError, ValueError):  # a NaN or an unserializable value cannot have been signed
        return False
    return hmac.compare_digest(expected.encode(), claimed.encode("utf-8", "replace"))
