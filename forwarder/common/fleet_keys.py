"""Per-VM keys derived from one fleet master secret (docs/security-model.md).

The operator keeps ONE master secret; every VM gets only keys derived from it for its own
identity (its resourceId, lower-cased), so a VM can authenticate its own records and verify
approvals meant for it, and can forge nothing for another VM. A consumer that holds the master
derives the key of any VM from the identity a record claims and checks it.

    key = HMAC-SHA256(master, "sefwd/v1/<purpose>\\n" + identity.lower())

Purposes: ``vm-key`` (the record authenticator, ``sefwdauth``) and ``callback-key`` (the secret
the VM's approval callback verifies). Keys are written as ``whsec_<base64>`` secrets, the one
secret format of forwarder.common.signing, so existing ``secret_env``/``secret_file`` options load them.
"""
from __future__ import annotations

import base64
import hashlib
import hmac

from forwarder.common.signing import SECRET_PREFIX

RECORD_PURPOSE = "vm-key"
CALLBACK_PURPOSE = "callback-key"
PURPOSES = (RECORD_PURPOSE, CALLBACK_PURPOSE)
LABEL = "sefwd/v1/{purpose}\n"


def normal_identity(identity: str) -> str:
    """The identity as keys are derived for it: trimmed and lower-cased (Azure resource ids are
    case-insensitive; IMDS and ARM do not always agree on the case of resource groups)."""
    return identity.strip().lower()


def derive_key(master: bytes, purpose: str, identity: str) -> bytes:
    """The 32-byte key of ``identity`` (a VM's resourceId) for ``purpose``."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown key purpose {purpose!r} (one of {', '.join(PURPOSES)})")
    name = normal_identity(identity)
    if not name:
        raise ValueError("a VM identity (resourceId) is required to derive its key")
    if not master:
        raise ValueError("the master secret is empty")
    message = (LABEL.format(purpose=purpose) + name).encode("utf-8")
    return hmac.new(bytes(master), message, hashlib.sha256).digest()


def as_secret(key: bytes) -> str:
    """``whsec_<base64>``: how a derived key is handed to a VM (env var, file, protectedSettings)."""
    return SECRET_PREFIX + base64.b64encode(key).decode("ascii")
