"""Azure Function (Python v2 model): sefwd records in (Event Hubs or signed webhook), approvals out.

Only the bindings live here; the logic is in decide.py, approver_client.py and pipeline.py so it
can be tested without the Functions host.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import azure.functions as func

import arm_route
from pipeline import RemoteApprover, Settings, handle_records_request, handle_webhook, records_from_event_bodies

app = func.FunctionApp()


@functools.lru_cache(maxsize=1)
def get_approver() -> RemoteApprover:
    """One approver per worker process, so de-duplication spans invocations.

    APPROVAL_ROUTE selects how an approval reaches the VM: ``callback`` (default, the signed callback
    on each VM) or ``arm`` (Azure Resource Manager with this app's managed identity: arm_route.py).
    Both decide the same way (pipeline.RemoteApprover): authenticated records only, each once.
    """
    if arm_route.route(os.environ) == "arm":
        return arm_route.from_env(os.environ)
    return RemoteApprover(Settings.from_env(os.environ))


@app.function_name("sefwd_eventhub")
@app.event_hub_message_trigger(
    arg_name="events",
    event_hub_name="%EVENTHUB_NAME%",
    connection="EVENTHUB_CONNECTION",  # app setting; or EVENTHUB_CONNECTION__fullyQualifiedNamespace (managed identity)
    consumer_group="%EVENTHUB_CONSUMER_GROUP%",
    cardinality="many",
)
def sefwd_eventhub(events: list[func.EventHubEvent]) -> None:
    """Each event body is one sefwd record (CloudEvents JSON, structured mode)."""
    records = records_from_event_bodies(event.get_body() for event in events)
    get_approver().handle_many(records)


@app.function_name("sefwd_purge")
@app.timer_trigger(arg_name="timer", schedule="0 17 * * * *")
def sefwd_purge(timer: func.TimerRequest) -> None:
    """Hourly: with STATE_BACKEND=table, delete the rows past their retention (Table Storage has no expiry)."""
    deleted = get_approver().purge()
    if deleted:
        logging.info("purged %d state table rows past their retention", deleted)


def _answer(handler: Callable[[RemoteApprover, bytes, dict[str, str]], tuple[int, dict[str, Any]]],
            req: func.HttpRequest) -> func.HttpResponse:
    try:
        approver = get_approver()
    except ValueError as exc:
        logging.error("%s", exc)
        return func.HttpResponse(json.dumps({"error": "misconfigured"}), status_code=500, mimetype="application/json")
    status, answer = handler(approver, req.get_body(), dict(req.headers))
    return func.HttpResponse(json.dumps(answer), status_code=status, mimetype="application/json")


@app.function_name("sefwd_webhook")
@app.route(route="sefwd", methods=["POST"], auth_level=func.AuthLevel.FUNCTION)
def sefwd_webhook(req: func.HttpRequest) -> func.HttpResponse:
    """The sefwd webhook sink posts here (Standard Webhooks signed, SEFWD_WEBHOOK_SECRET)."""
    return _answer(handle_webhook, req)


@app.function_name("sefwd_approve")
@app.route(route="approve", methods=["POST"], auth_level=func.AuthLevel.FUNCTION)
def sefwd_approve(req: func.HttpRequest) -> func.HttpResponse:
    """The Logic App's approval branch posts each record here (function key) and renders the answer.

    The caller is not trusted for the records: they are decided exactly like the Event Hubs
    trigger's (get_approver().handle_many: a valid sefwdauth, the replay cache, the VM named in the
    event and its leader), and approved through this app's route (APPROVAL_ROUTE=arm: ARM with this
    app's identity). The answer: {"received", "outcomes": [{"decision", "reason", "vm", "target", ...}]}.
    """
    return _answer(handle_records_request, req)
