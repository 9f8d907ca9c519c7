"""One instance of the platform-events Function app, in its own process, fed from a file (tests only).

``python tests/platform_events_worker.py FEED``: each line of FEED is ``{"grid": [...]}`` (one Event Grid
POST to the webhook function), ``{"agents": [...]}`` (one Event Hubs batch of agents' records) or
``{"tick": true}`` (the timer). A delivery answered 5xx is delivered again, as Event Grid does, until
it is taken or 60 s passed. The app's settings come from the environment (STATE_BACKEND=table…).
Prints one JSON line per delivery answer.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

APP_DIR = Path(__file__).resolve().parents[1] / "deploy" / "consumers" / "platform-events"
sys.path.insert(0, str(APP_DIR))

import azure.functions as func  # noqa: E402


def load_app() -> Any:
    spec = importlib.util.spec_from_file_location("platform_events_function_app", APP_DIR / "function_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(feed: Path) -> int:
    handlers = {f.get_function_name(): f.get_user_function() for f in load_app().app.get_functions()}

    def deliver(events: list[dict[str, Any]]) -> int:
        answer = handlers["platform_events_webhook"](func.HttpRequest(
            "POST", "https://app.example/api/platform-events", headers={"aeg-event-type": "Notification"},
            body=json.dumps(events).encode()))
        print(json.dumps({"grid": [e["id"] for e in events], "status": answer.status_code}), flush=True)
        return int(answer.status_code)

    retry: list[list[dict[str, Any]]] = []
    for line in feed.read_text().splitlines():
        step = json.loads(line)
        if "grid" in step and deliver(step["grid"]) >= 500:
            retry.append(step["grid"])
        elif "agents" in step:
            handlers["platform_events_agents"]([func.EventHubEvent(body=json.dumps(r).encode()) for r in step["agents"]])
        elif step.get("tick"):
            handlers["platform_events_missed"](None)
    deadline = time.monotonic() + 60
    while retry and time.monotonic() < deadline:
        time.sleep(0.2)  # Event Grid's retry delay (its own schedule starts at 10 s)
        retry = [events for events in retry if deliver(events) >= 500]
    return 1 if retry else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
