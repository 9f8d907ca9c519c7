"""Shared by the Azure sinks: credentials, secrets and per-item outcomes; imported only when such a sink is configured."""
from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from forwarder.common.logs import RateLimitedLog
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


def check_https_endpoint(options: Mapping[str, Any], required: str, *, path: bool = True) -> list[str]:
    """Problems with option ``endpoint``: an https URL without credentials, query or fragment (nor a path if not ``path``).

    Keys and bearer tokens travel in headers, so plain http is never accepted (azure-core refuses it too).
    ``required`` says what to copy where when the option is missing.
    """
    endpoint = options.get("endpoint")
    if endpoint is None:
        return [f"option 'endpoint' is required ({required})"]
    if not isinstance(endpoint, str) or not endpoint.strip():
        return [f"option 'endpoint' must be a non-empty string, got {endpoint!r}"]
    try:
        parts = urlsplit(endpoint.strip())
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        return [f"option 'endpoint' is not a valid URL: {exc}"]
    if parts.scheme != "https":
        return [f"option 'endpoint' must start with https://, got scheme {parts.scheme!r}"]
    if not parts.hostname:
        return ["option 'endpoint' has no host"]
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        return ["option 'endpoint' must not carry credentials, a query or a fragment (the sink adds what it needs)"]
    if not path and parts.path.strip("/"):
        return [f"option 'endpoint' must not have a path, got {parts.path!r} (the sink adds it)"]
    return []


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


def identity_extra_problems(options: Mapping[str, Any], extra: str) -> list[str]:
    """A problem when ``credential = "managed_identity"`` is set but azure-identity is not installed."""
    if options.get("credential") != "managed_identity":
        return []
    try:
        missing = importlib.util.find_spec("azure.identity") is None
    except (ImportError, ValueError):  # a parent package missing, or blocked in sys.modules
        missing = True
    if not missing:
        return []
    return [f'credential = "managed_identity" needs azure-identity; install it with: '
            f"pip install 'scheduled-events-forwarder[{extra}]'"]


class ServiceClient:
    """What a sink posting to an Azure service holds: a session, whom TLS trusts, maybe a managed identity."""

    def __init__(self, name: str, options: Mapping[str, Any], *, scope: str, timeout: float,
                 logger: logging.Logger) -> None:
        import requests

        from forwarder import __version__

        self.name = name
        self.scope = scope
        self.timeout = timeout
        # Certificates are always checked; ca_file only changes whom we trust. Passed on every
        # request because requests lets REQUESTS_CA_BUNDLE override a Session's own verify.
        self.verify: str | bool = os.path.expanduser(str(options["ca_file"])) if options.get("ca_file") else True
        self.credential = managed_identity_credential(options) if options.get("credential") else None
        self.errors = RateLimitedLog(logger)
        self._token: tuple[str, float] | None = None
        self._session = requests.Session()
        self._session.headers["User-Agent"] = f"scheduled-events-forwarder/{__version__}"

    def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Answer | Retry:
        """POST once, with a bearer token when there is a managed identity; the answer or a Retry."""
        if self.credential is not None:
            try:
                if self._token is None or self._token[1] - TOKEN_MARGIN <= time.time():
                    token = self.credential.get_token(self.scope)
                    self._token = (token.token, float(token.expires_on))
            except Exception as exc:  # no identity, IMDS unreachable...
                self.errors.log(logging.ERROR, "credential", "sink %r: cannot get a token for %s: %s; will retry",
                                self.name, self.scope, " ".join(str(exc).split())[:DETAIL_CHARS])
                return Retry(reason="credential_unavailable")
            headers = {**headers, "Authorization": f"Bearer {self._token[0]}"}
        return post_once(self._session, url, body, headers, timeout=self.timeout, verify=self.verify,
                         errors=self.errors, name=self.name)

    def close(self) -> None:
        """Close the keep-alive connections and the credential."""
        for closable in (self._session, self.credential):
            try:
                if closable is not None:
                    closable.close()
            except Exception as exc:  # closing must not mask the agent's own shutdown
                logging.getLogger(__name__).debug("sink %r: close failed: %s", self.name, exc)
