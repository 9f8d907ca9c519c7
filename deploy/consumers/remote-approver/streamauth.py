"""The reference verifier of sefwd's per-VM record authenticator (``sefwdauth``), standalone.

A second, independent implementation of the scheme the agent signs with (forwarder.common.fleet_keys
and forwarder.common.record_auth; spec: docs/security-model.md), so a consumer needs only the
standard library; tests/integration/test_stream_trust.py checks that the two agree.

    k_vm      = HMAC-SHA256(master, "sefwd/v1/vm-key\\n" + lower(source))      # per-VM record key
    k_cb      = HMAC-SHA256(master, "sefwd/v1/callback-key\\n" + lower(source)) # per-VM callback secret
    sefwdauth = "v1," + base64(HMAC-SHA256(k_vm, canonical JSON of the record without sefwdauth))

canonical JSON: keys sorted at every level, separators "," and ":", non-ASCII unescaped, UTF-8.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from typing import Any

ATTRIBUTE = "sefwdauth"


def master_key(secret: str) -> bytes:
    """The key bytes of a ``whsec_<base64>`` master secret (padding optional); ValueError if unusable."""
    text = secret.strip()
    if not text.startswith("whsec_"):
        raise ValueError("must start with whsec_")
    body = text[len("whsec_"):]
    key = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    if len(key) < 16:
        raise ValueError(f"is too short ({len(key)} key bytes, need 16 or more)")
    return key


def derive(master: bytes, purpose: str, identity: str) -> bytes:
    """The per-VM key for ``purpose`` ("vm-key" or "callback-key") of the VM whose resourceId is ``identity``."""
    message = f"sefwd/v1/{purpose}\n{identity.strip().lower()}".encode()
    return hmac.new(master, message, hashlib.sha256).digest()


def callback_secret(master: bytes, identity: str) -> str:
    """The ``whsec_`` secret the VM ``identity``'s approval callback verifies."""
    return "whsec_" + base64.b64encode(derive(master, "callback-key", identity)).decode("ascii")


def _canonical(record: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in record.items() if k != ATTRIBUTE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def verify(record: Mapping[str, Any], masters: Iterable[bytes]) -> bool:
    """True when ``record``'s ``sefwdauth`` was made with the key of the VM its ``source`` names,
    under any of ``masters`` (two during a rotation). Every other record is untrusted."""
    source, claimed = record.get("source"), record.get(ATTRIBUTE)
    if not isinstance(source, str) or not source.strip() or not isinstance(claimed, str):
        return False
    try:
        content = _canonical(record)
    except (TypeError, ValueError):
        return False
    matched = False
    for master in masters:
        digest = hmac.new(derive(master, "vm-key", source), content, hashlib.sha256).digest()
        expected = "v1," + base64.b64encode(digest).decode("ascii")
        matched |= hmac.compare_digest(expected.encode(), claimed.encode("utf-8", "replace"))
    return matched
