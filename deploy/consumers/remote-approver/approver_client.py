"""Send a signed approval (Standard Webhooks) to a VM's sefwd callback: ``POST /approvals``."""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

import requests
from standardwebhooks.webhooks import Webhook

log = logging.getLogger(__name__)

MAX_TEXT = 200  # the callback's limit for "approver" and "reason"


def _final(status: int) -> bool:
    """200, and every refusal another attempt cannot change (401 signature, 409 replay, 413 size,
    422 unknown / out of scope / started, a 3xx we do not follow); only 429 and 5xx are retried."""
    return status < 500 and status != 429


def _sign(signer: Webhook, body: str) -> dict[str, str]:
    """Fresh Standard Webhooks headers for one attempt."""
    msg_id = "msg_" + uuid.uuid4().hex
    # Whole seconds: the header and the signed content must carry the same timestamp.
    now = datetime.fromtimestamp(int(time.time()), tz=timezone.utc)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signer.sign(msg_id, now, body),
    }


def _text(value: str, limit: int = MAX_TEXT) -> str:
    printable = "".join(ch if ch.isprintable() else " " for ch in value)
    return printable if len(printable) <= limit else printable[: limit - 1] + "…"


def _answer(response: requests.Response) -> dict[str, Any]:
    try:
        parsed = response.json()
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        return parsed
    return {"status": "error", "reason": "unexpected_answer", "detail": response.text[:200]}


def approve(
    callback_url: str,
    secret: str,
    event_ids: Sequence[str],
    approver: str,
    reason: str,
    *,
    resource_id: str,
    timeout: float = 10,
    session: requests.Session | None = None,
    verify: bool | str = True,
    attempts: int = 3,
    backoff: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """POST StartRequests for ``event_ids``; never raises for network or HTTP problems.

    Returns the callback's JSON answer plus ``http_status`` (None when unreachable), ``ok`` (200 and
    approved / already approved), ``final`` (False only when every attempt failed transiently:
    a later copy of the record may try again) and ``attempts``. ``verify`` is requests' TLS
    setting: True, or the path of a CA bundle for a private CA. ``resource_id`` names the VM the
    approval is for (signed with the body): that VM's callback refuses an approval naming another.
    """
    if not event_ids:
        raise ValueError("approve needs at least one EventId")
    if not resource_id.strip():
        raise ValueError("approve needs the resourceId of the VM the approval is for")
    signer = Webhook(secret)  # raises for an empty or non-base64 secret: a config error, not a retry
    # The callback refuses (400) free text over 200 characters or with control characters.
    payload = {"StartRequests": [{"EventId": event_id} for event_id in event_ids],
               "approver": _text(approver), "reason": _text(reason), "ResourceId": resource_id}
    # Serialized once: the signature covers these exact bytes, so every attempt sends them unchanged.
    body = json.dumps(payload, separators=(",", ":"))
    http = session or requests.Session()
    result: dict[str, Any] = {"status": "error", "reason": "unreachable"}
    status: int | None = None
    try:
        for attempt in range(1, max(1, attempts) + 1):
            # A new webhook-id on every attempt: the callback keeps the ids it has accepted (across
            # restarts) and refuses a second request with a known id as a replay (409). If an attempt
            # reached the VM but its answer was lost, resending the same id would be refused; a new
            # id is a new, valid request that the VM answers "already_approved" — approving is
            # idempotent on the VM, signatures are not.
            headers = _sign(signer, body)
            headers["Content-Type"] = "application/json"
            try:
                # No redirects: the signature does not cover the URL, so never re-send it elsewhere.
                response = http.post(callback_url, data=body.encode(), headers=headers, timeout=timeout,
                                     verify=verify, allow_redirects=False)
            except requests.RequestException as exc:
                status = None
                result = {"status": "error", "reason": "unreachable", "detail": f"{type(exc).__name__}: {exc}"}
                log.warning("approval of %s via %s: attempt %d failed: %s", list(event_ids), callback_url, attempt, exc)
            else:
                status = response.status_code
                result = _answer(response)
                if _final(status):
                    break
                log.warning("approval of %s via %s: attempt %d answered %d %s", list(event_ids), callback_url,
                            attempt, status, result.get("reason"))
                retry_after = response.headers.get("Retry-After", "")
                if status == 429 and retry_after.isdigit() and attempt < attempts:
                    sleep(min(float(retry_after), 30.0))
                    continue
            if attempt < attempts:
                sleep(backoff * 2 ** (attempt - 1))
    finally:
        if session is None:
            http.close()
    ok = status == 200 and result.get("status") == "approved"
    final = status is not None and _final(status)
    result.update(http_status=status, ok=ok, final=final, attempts=attempt)
    if ok:
        log.info("approval of %s via %s: %s", list(event_ids), callback_url, result.get("reason"))
    elif final:
        log.error("approval of %s via %s refused (%s): %s %s", list(event_ids), callback_url, status,
                  result.get("reason"), result.get("refused") or result.get("detail") or "")
    else:
        log.error("approval of %s via %s failed after %d attempts: %s", list(event_ids), callback_url, attempt,
                  result.get("detail") or result.get("reason"))
    return result
