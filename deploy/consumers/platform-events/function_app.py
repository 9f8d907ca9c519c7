"""Azure Function (Python v2 model): the platform's Scheduled Events (Event Grid) beside the agents' records.

Only the bindings live here; the logic is in platform_events.py, reconcile.py and reconcile_state.py,
testable without the Functions host (docs/platform-events.md).
"""
from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import azure.functions as func

from outputs import output_from_env
from reconcile import DEFAULT_MISSED_AFTER, Reconciler
from reconcile_state import state_from_env

app = func.FunctionApp()


@functools.lru_cache(maxsize=1)
def get_reconciler() -> Reconciler:
    """One per worker process. State: STATE_BACKEND (``sqlite``: RECONCILE_STATE_PATH, one instance;
    ``table``: Azure Table Storage, any number; see reconcile_state.state_from_env)."""
    settings = os.environ
    state = state_from_env(settings)
    missed_after = float(settings.get("MISSED_AFTER_SECONDS", DEFAULT_MISSED_AFTER))
    return Reconciler(state, output_from_env(settings), missed_after=missed_after, verify=verifier(settings),
                      recheck=state.lease)


def verifier(settings: Mapping[str, str]) -> Callable[[Mapping[str, Any]], bool] | None:
    """SEFWD_MASTER_SECRET (the fleet master(s), as the remote approver takes it): only records with a valid
    sefwdauth count, for the VM their source names. Unset: every record's own claim counts (logged once)."""
    import streamauth  # the remote approver's verifier (a link to ../remote-approver/streamauth.py)

    masters = tuple(streamauth.master_key(v) for v in settings.get("SEFWD_MASTER_SECRET", "").split())
    if not masters:
        logging.warning("SEFWD_MASTER_SECRET is not set: agents' records are not authenticated, and a forged "
                        "one could hide a VM that missed an event")
        return None
    return lambda record: streamauth.verify(record, masters)


@app.function_name("platform_events_webhook")
@app.route(route="platform-events", methods=["POST"], auth_level=func.AuthLevel.FUNCTION)
def platform_events_webhook(req: func.HttpRequest) -> func.HttpResponse:
    """The Event Grid subscription's webhook endpoint: the validation handshake, then ScheduledEventEmitted."""
    status, answer = get_reconciler().handle_delivery(req.get_body(), dict(req.headers))
    return func.HttpResponse(json.dumps(answer), status_code=status, mimetype="application/json")


@app.function_name("platform_events_grid")
@app.event_grid_trigger(arg_name="event")
def platform_events_grid(event: func.EventGridEvent) -> None:
    """The same events through an Event Grid trigger (the host does the handshake); a failure is retried."""
    grid = {"id": event.id, "eventType": event.event_type, "subject": event.subject, "topic": event.topic,
            "eventTime": event.event_time.isoformat() if event.event_time else None,
            "dataVersion": event.data_version, "data": event.get_json()}
    status, answer = get_reconciler().handle_delivery(json.dumps([grid]).encode(), {"aeg-event-type": "Notification"})
    if status >= 500:
        raise RuntimeError(f"platform event {event.id} not handled: {answer}")  # Event Grid delivers it again
    if status >= 400:
        logging.error("platform event %s refused: %s", event.id, answer)


@app.function_name("platform_events_agents")
@app.event_hub_message_trigger(arg_name="events", event_hub_name="%EVENTHUB_NAME%", connection="EVENTHUB_CONNECTION",
                               consumer_group="%RECONCILE_CONSUMER_GROUP%", cardinality="many")
def platform_events_agents(events: list[func.EventHubEvent]) -> None:
    """The agents' records (the hub they send to, its own consumer group): who reported which event."""
    records: list[dict[str, object]] = []
    for event in events:
        try:
            value = json.loads(event.get_body())
        except ValueError:
            continue
        records.extend(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, dict))
    get_reconciler().agent_records(records)


@app.function_name("platform_events_missed")
@app.timer_trigger(arg_name="timer", schedule="0 * * * * *")
def platform_events_missed(timer: func.TimerRequest) -> None:
    """Every minute: fleet.missed for the VMs that never reported an event in time."""
    get_reconciler().tick()
