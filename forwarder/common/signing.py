"""Standard Webhooks v1 signatures: secrets, signing outgoing requests, verifying incoming ones.

One secret format (``whsec_<base64>``) serves the webhook sink (signs) and the approval
callback (verifies). The signed content is ``f"{id}.{timestamp}.{raw_body}"`` with
HMAC-SHA256; ``webhook-signature`` may carry several space-separated ``v1,<base64>`` entries so
a receiver can rotate keys.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

from forwarder.errors import ConfigError, ForwarderError

SECRET_PREFIX = "whsec_"
MIN_KEY_BYTES = 16
DEFAULT_TOLERANCE = 300.0
HEADER_ID = "webhook-id"
HEADER_TIMESTAMP = "webhook-timestamp"
HEADER_SIGNATURE = "webhook-signature"

# Unix seconds as plain digits: a sign, fraction or exponent is not something a signer sends.
_TIMESTAMP = re.compile(r"^[0-9]{1,12}$")
_B64 = re.compile(r"^[A-Za-z0-9+/]*={0,2}$")


class SignatureError(ForwarderError):
    """A signature, its headers or a secret is invalid; ``reason`` is a snake_case code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _b64decode(text: str, *, pad: bool = False) -> bytes | None:
    """Strict standard base64 (``pad`` adds missing padding); None when it is not base64."""
    text = text.strip()
    if not _B64.match(text):
        return None
    if pad:
        text += "=" * (-len(text) % 4)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def parse_secret(secret: str) -> bytes:
    """The key bytes of a ``whsec_<base64>`` secret; raises SignatureError("bad_secret")."""
    # Messages never include the secret: they end up in logs and config-check output.
    if not isinstance(secret, str):
        raise SignatureError("bad_secret", f"secret must be a string starting with {SECRET_PREFIX!r}")
    secret = secret.strip()
    if not secret.startswith(SECRET_PREFIX):
        raise SignatureError(
            "bad_secret",
            f"secret must start with {SECRET_PREFIX!r} followed by base64 "
            f"(for example {SECRET_PREFIX!r} + the output of: openssl rand -base64 32)",
        )
    # Secrets are pasted by hand and the reference package accepts them unpadded; signatures are not.
    key = _b64decode(secret[len(SECRET_PREFIX):], pad=True)
    if key is None:
        raise SignatureError("bad_secret", f"secret after {SECRET_PREFIX!r} is not valid base64")
    if len(key) < MIN_KEY_BYTES:
        raise SignatureError(
            "bad_secret",
            f"secret is too short: {len(key)} bytes, need at least {MIN_KEY_BYTES} (24 to 64 advised)",
        )
    return key


def generate_secret() -> str:
    """A new random secret: ``whsec_`` + base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode("ascii")


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``v1,<base64>`` signature of one message."""
    content = f"{msg_id}.{int(timestamp)}.".encode() + bytes(body)
    digest = hmac.new(key, content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def sign_headers(key: bytes, msg_id: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """The three Standard Webhooks headers for ``body``, timestamped ``now`` (default: the clock)."""
    timestamp = int(time.time() if now is None else now)
    return {
        HEADER_ID: msg_id,
        HEADER_TIMESTAMP: str(timestamp),
        HEADER_SIGNATURE: sign(key, msg_id, timestamp, body),
    }


def _lower_headers(headers: Mapping[str, str]) -> dict[str, list[str]]:
    """Header values by lower-case name, keeping repeats (http.client messages can repeat)."""
    found: dict[str, list[str]] = {}
    items: Any = headers.items()
    for name, value in items:
        found.setdefault(str(name).lower(), []).append(str(value))
    return found


def _single(found: dict[str, list[str]], name: str) -> str | None:
    values = {v.strip() for v in found.get(name, [])}
    if len(values) > 1:
        raise SignatureError("missing_headers", f"conflicting {name} headers")
    return values.pop() if values else None


def verify(
    key: bytes | Sequence[bytes],
    headers: Mapping[str, str],
    body: bytes,
    *,
    now: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> str:
    """Check a signed message and return its id; raises SignatureError with a reason."""
    keys = [key] if isinstance(key, (bytes, bytearray)) else list(key)
    if not keys or any(not isinstance(k, (bytes, bytearray)) or not k for k in keys):
        raise SignatureError("bad_secret", "no usable verification key")
    found = _lower_headers(headers)
    msg_id = _single(found, HEADER_ID)
    timestamp_text = _single(found, HEADER_TIMESTAMP)
    signature_text = " ".join(found.get(HEADER_SIGNATURE, [])).strip()
    if not msg_id or not timestamp_text or not signature_text:
        missing = [
            name for name, value in (
                (HEADER_ID, msg_id), (HEADER_TIMESTAMP, timestamp_text), (HEADER_SIGNATURE, signature_text),
            ) if not value
        ]
        raise SignatureError("missing_headers", f"missing header(s): {', '.join(missing)}")
    if not _TIMESTAMP.match(timestamp_text):
        raise SignatureError("bad_timestamp", "webhook-timestamp must be unix seconds")
    timestamp = int(timestamp_text)
    current = time.time() if now is None else now
    if current - timestamp > tolerance:
        raise SignatureError("stale_timestamp", f"webhook-timestamp is {current - timestamp:.0f}s old")
    if timestamp - current > tolerance:
        raise SignatureError("future_timestamp", f"webhook-timestamp is {timestamp - current:.0f}s ahead")

    expected = [base64.b64decode(sign(bytes(k), msg_id, timestamp, body)[3:]) for k in keys]
    matched = False
    # Every entry is compared against every key without stopping early, so the time taken
    # does not tell which entry or key matched.
    for entry in signature_text.split():
        version, _, encoded = entry.partition(",")
        if version != "v1":
            continue  # other schemes (v1a asymmetric) are not ours to check
        candidate = _b64decode(encoded)
        if candidate is None or len(candidate) != hashlib.sha256().digest_size:
            continue
        for digest in expected:
            matched |= hmac.compare_digest(digest, candidate)
    if not matched:
        raise SignatureError("bad_signature", "no matching v1 signature")
    return msg_id


def load_secret(
    options: Mapping[str, Any], *, env: Mapping[str, str] = os.environ, prefix: str = "secret"
) -> bytes | None:
    """The key named by ``<prefix>_env`` or ``<prefix>_file``, or None; raises ConfigError."""
    env_key, file_key = f"{prefix}_env", f"{prefix}_file"
    has_env, has_file = options.get(env_key) is not None, options.get(file_key) is not None
    if has_env and has_file:
        raise ConfigError([f"options {env_key!r} and {file_key!r} are exclusive: set only one"])
    if has_env:
        name = options[env_key]
        if not isinstance(name, str) or not name.strip():
            raise ConfigError([f"option {env_key!r} must name an environment variable, got {name!r}"])
        if name not in env:
            raise ConfigError([f"option {env_key!r}: environment variable {name!r} is not set"])
        where, text = f"environment variable {name!r}", env[name]
    elif has_file:
        path = options[file_key]
        if not isinstance(path, str) or not path.strip():
            raise ConfigError([f"option {file_key!r} must be a file path, got {path!r}"])
        path = os.path.expanduser(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise ConfigError([f"option {file_key!r}: cannot read {path}: {reason}"]) from None
        where = f"file {path}"
    else:
        return None
    try:
        return parse_secret(text.strip())
    except SignatureError as exc:
        raise ConfigError([f"secret from {where}: {exc}"]) from None
