"""Issue 21: the Logic App puts record fields into Teams HTML; each one is a claim of whichever
stream sender wrote the record, so each is HTML-escaped. The workflow's own messageBody
expressions are evaluated (tests/unit/test_deploy_fold.py's interpreter) with a hostile record."""
from __future__ import annotations

import re
from typing import Any

from tests.unit.test_deploy_fold import PARAMETERS, Run, _workflow

HOSTILE = '<img src=x onerror="alert(1)">&amp;\'</b>'
INTERPOLATION = re.compile(r"@\{((?:[^{}']|'(?:[^']|'')*')*)\}")
TAG = re.compile(r"<[^>]*>")


def _message_bodies(node: Any, path: str = "") -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "messageBody" and isinstance(value, str):
                found.append((path, value))
            else:
                found.extend(_message_bodies(value, f"{path}/{key}"))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.extend(_message_bodies(value, f"{path}/{index}"))
    return found


def _hostile_record() -> dict[str, Any]:
    vm = {"Name": HOSTILE, "ResourceGroupName": HOSTILE, "SubscriptionId": HOSTILE}
    data = {"EventId": HOSTILE, "EventType": HOSTILE, "EventSource": HOSTILE, "NotBefore": HOSTILE,
            "Resources": [HOSTILE, "attacker.host/#"], "DurationInSeconds": HOSTILE, "Description": HOSTILE,
            "Outcome": HOSTILE, "Evidence": {"Used": [HOSTILE]}, "Vm": vm}
    return {"type": "scheduledevent.scheduled", "id": "1", "eventkey": "k", "data": data}


def test_every_record_field_rendered_into_teams_html_is_escaped() -> None:
    bodies = _message_bodies(_workflow()["definition"])
    assert len(bodies) == 3  # scheduled, first outcome, stronger outcome
    for path, template in bodies:
        run = Run({}, PARAMETERS)
        run.outputs["Record"] = _hostile_record()
        run.outputs["Outcome"] = HOSTILE
        run.bodies["Read_fleet_outcome"] = {"Outcome": HOSTILE}  # a stored row holds a reported claim too
        rendered = run.value(template)
        # The only markup is the template's own: no tag, attribute or entity comes from a record.
        assert TAG.findall(rendered) == TAG.findall(INTERPOLATION.sub("", template)), path
        assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;&amp;amp;&#39;&lt;/b&gt;" in rendered, path
        assert "onerror=\"" not in rendered and "'" not in rendered, path


def test_no_interpolation_in_a_message_escapes_by_accident() -> None:
    """Every @{...} in a messageBody is wrapped in the one escaping chain, so a field added later
    without it is caught here rather than in a Teams channel."""
    chain = "replace(replace(replace(replace(replace(string(coalesce("
    for path, template in _message_bodies(_workflow()["definition"]):
        expressions = INTERPOLATION.findall(template)
        assert expressions, path
        for expression in expressions:
            assert expression.startswith(chain), (path, expression[:80])
            assert expression.endswith(", '')), '&', '&amp;'), '<', '&lt;'), '>', '&gt;'), '\"', '&quot;'), "
                                       "'''', '&#39;')"), (path, expression[-80:])
