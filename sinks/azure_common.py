"""Shared by the Azure sinks: credentials, secrets and per-item outcomes; imported only when such a sink is configured."""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from forwarder.logutil import RateLimitedLog
from forwarder.sinkapi import Ok, Record, Reject, Result, Retry

CREDENTIAL_KINDS = ("managed_identity",)
DETAIL_CHARS = 300
MAX_ANSWER_BYTES = 256 * 1024  # enough of an answer to explain it; the rest is dropped with the connection
TOKEN_MARGIN = 300.0  # refresh a token this long before it expires


def check_credential_options(options: Mapping[str, Any], *, prefix: str = "") -> list[str]:
    """Problems with ``credential`` / ``client_id``."""
    problems = []
    kind = options.get("credential")
    if kind is not None and kind not in CREDENTIAL_KINDS:
        problems.append(f"{prefix}credential must be one of {', '.join(CREDENTIAL_KINDS)}, got {kind!r}")
    client_id = options.get("client_id")
    if client_id is not None and (not isinstance(client_id, str) or not client_id.strip()):
        problems.append(f"{prefix}client_id must be a non-empty string (the managed identity's client id)")
    if client_id is not None and kind is None:
        problems.append(f"{prefix}client_id needs credential = \"managed_identity\"")
    return problems


def managed_identity_credential(options: Mapping[str, Any]) -> Any:
    """A ManagedIdentityCredential (system-assigned, or user-assigned by ``client_id``).

    On a VM it asks IMDS for tokens; ``AZURE_POD_IDENTITY_AUTHORITY_HOST`` points it at the
    emulator in tests.
    """
    from azure.identity import ManagedIdentityCredential

    client_id = options.get("client_id")
    return ManagedIdentityCredential(client_id=client_id) if client_id else ManagedIdentityCredential()


def read_secret_text(options: Mapping[str, Any], name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The value named by ``<name>_env`` (an env var) or ``<name>_file`` (a file); never inline."""
    env = os.environ if env is None else env
    var, path = options.get(f"{name}_env"), options.get(f"{name}_file")
    if var and path:
        raise ValueError(f"set only one of {name}_env and {name}_file")
    if var:
        value = env.get(str(var))
        if not value:
            raise ValueError(f"environment variable {var} (from {name}_env) is not set")
        return value.strip()
    if path:
        try:
            return Path(str(path)).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read {name}_file {path}: {exc.strerror}") from None
    return None


class ItemLedger:
    """What became of each record of a batch the dispatcher is still retrying.

    Services that answer per item (Application Insights 206) or per request of a split batch (Event
    Grid) accept some records and refuse others before the batch as a whole is done. The ledger
    remembers both, so a retry sends only what is still pending, and a record refused for good is
    rejected alone (the dispatcher re-sends a rejected batch record by record) and dead-lettered
    with the service's reason. Bounded: a batch the dispatcher gave up on cannot grow it forever.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._accepted: OrderedDict[str, None] = OrderedDict()
        self._refused: OrderedDict[str, tuple[str, str]] = OrderedDict()

    def pending(self, batch: Sequence[Record]) -> list[Record]:
        """The records neither accepted nor refused yet."""
        return [r for r in batch if r.id not in self._accepted and r.id not in self._refused]

    def accept(self, record: Record) -> None:
        self._remember(self._accepted, record.id, None)

    def refuse(self, record: Record, reason: str, detail: str) -> None:
        self._remember(self._refused, record.id, (reason, detail))

    def outcome(self, batch: Sequence[Record]) -> Result:
        """Once nothing is pending: Ok, the Reject of a lone refused record, or a Reject to go record by record."""
        refused = [r for r in batch if r.id in self._refused]
        if refused and len(batch) == 1:
            reason, detail = self._refused.pop(batch[0].id)
            return Reject(reason=reason, detail=detail)
        if refused:
            return Reject(reason="items_refused", detail=f"{len(refused)} of {len(batch)} refused")
        for record in batch:
            self._accepted.pop(record.id, None)
        return Ok()

    def _remember(self, store: OrderedDict[str, Any], key: str, value: Any) -> None:
        store[key] = value
        while len(store) > self._limit:
            store.popitem(last=False)


@dataclass(frozen=True)
class Answer:
    """A service's answer: status, JSON body (or its text, or None when empty) and headers."""

    status: int
    body: Any
    headers: Mapping[str, str]

    def message(self) -> str:
        """The service's own words, shortened to one line."""
        body = self.body
        if isinstance(body, dict):
            error = body.get("error")
            errors = body.get("errors")
            if isinstance(error, dict):
                text = f"{error.get('code') or ''}: {error.get('message') or ''}".strip(": ")
            elif isinstance(errors, list) and errors and isinstance(errors[0], dict):
                text = str(errors[0].get("message") or "")
            else:
                text = str(error or body.get("message") or body)
        else:
            text = str(body or "")
        return " ".join(text.split())[:DETAIL_CHARS]


def post_once(session: Any, url: str, body: bytes, headers: Mapping[str, str], *, timeout: float,
              verify: str | bool, errors: RateLimitedLog, name: str) -> Answer | Retry:
    """One POST with ``requests``, redirects not followed; the answer, or the Retry its failure means."""
    import requests

    try:
        response = session.post(url, data=body, headers=headers, timeout=timeout,
                                allow_redirects=False, stream=True, verify=verify)
    except requests.exceptions.SSLError as exc:
        errors.log(logging.ERROR, "tls", "sink %r: TLS error talking to %s: %s (records kept, will retry; "
                   "check the certificate or set ca_file)", name, url, exc)
        return Retry(reason="tls_error")
    except requests.exceptions.Timeout:
        errors.log(logging.WARNING, "timeout", "sink %r: %s did not answer within %gs", name, url, timeout)
        return Retry(reason="timeout")
    except requests.exceptions.RequestException as exc:
        errors.log(logging.WARNING, "connection", "sink %r: cannot reach %s: %s", name, url, exc)
        return Retry(reason="connection_error")
    try:
        raw = response.raw.read(MAX_ANSWER_BYTES, decode_content=True) or b""
    except Exception:  # the status arrived; an unreadable answer must not hide it
        raw = b""
    finally:
        response.close()
    try:
        parsed: Any = orjson.loads(raw) if raw.strip() else None
    except orjson.JSONDecodeError:
        parsed = raw.decode("utf-8", "replace")
    return Answer(response.status_code, parsed, response.headers)


def bearer_token(credential: Any, scope: str, cached: tuple[str, float] | None) -> tuple[str, float]:
    """A token for ``scope``, the cached one while it has more than five minutes left."""
    if cached is not None and cached[1] - TOKEN_MARGIN > time.time():
        return cached
    token = credential.get_token(scope)
    return token.token, float(token.expires_on)
