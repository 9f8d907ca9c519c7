"""Fleet folding as the shipped consumers write it: the Logic App's workflow and the KQL query.

The Logic App is not just grepped: its own expressions (the ``Record``, ``Outcome`` and ``Rank``
composes, the ``Is_terminal_record`` / ``Is_first_report`` / ``Is_stronger`` conditions, the
table URIs, bodies and ``If-Match`` header) are evaluated by a small interpreter of the Workflow
Definition Language functions they use, and run against a table that behaves like Azure Table
storage (insert fails with 409 on an existing row, an update with a stale ETag fails with 412).
Terminal records come from sefwd's own record factory. The KQL query cannot be run without Log
Analytics; its text is checked for the same rule.
"""
from __future__ import annotations

import base64
import itertools
import json
import re
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import orjson
import pytest

from forwarder.imds.differ import diff
from forwarder.imds.document import parse_document
from forwarder.imds.identity import VmIdentity
from forwarder.imds.outcome import CANCELED, COMPLETED, FOLD_ORDER, UNKNOWN, EvidenceContext, fold
from forwarder.records import RecordFactory

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / "deploy" / "consumers" / "logic-app" / "workflow.json"
OUTCOMES_KQL = ROOT / "deploy" / "dashboards" / "queries" / "08-event-outcomes.kql"
EVENT_ID = "A1F0E5A7-0001-4C5D-9E8F-000000000001"
NOT_BEFORE = datetime(2026, 11, 24, 12, 0, tzinfo=timezone.utc)

# -- a Workflow Definition Language interpreter (the functions the workflow uses) ----------------

_TOKEN = re.compile(r"\s*(?:(?P<str>'(?:[^']|'')*')|(?P<num>-?\d+)|(?P<name>[A-Za-z_$][\w$]*)|(?P<op>\?\[|[(),\[\]]))")


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        assert match, f"cannot read expression at {text[pos:]!r}"
        kind = match.lastgroup
        assert kind is not None
        out.append((kind, match.group(kind)))
        pos = match.end()
    return out


class Run:
    """One workflow run: the outputs of the actions that ran, and the functions' environment."""

    def __init__(self, trigger_body: dict[str, Any], parameters: dict[str, Any]) -> None:
        self.outputs: dict[str, Any] = {}
        self.bodies: dict[str, Any] = {}
        self.trigger_body = trigger_body
        self.parameters = parameters
        self.functions: dict[str, Callable[..., Any]] = {
            "if": lambda c, a, b: a if c else b,
            "equals": lambda a, b: a == b,
            "greater": lambda a, b: a > b,
            "coalesce": lambda *xs: next((x for x in xs if x is not None), None),
            "int": int,
            "string": lambda x: x if isinstance(x, str) else json.dumps(x, separators=(",", ":")),
            "json": json.loads,
            "base64ToString": lambda s: base64.b64decode(s).decode(),
            "triggerBody": lambda: self.trigger_body,
            "outputs": lambda name: self.outputs[name],
            "body": lambda name: self.bodies.get(name),
            "parameters": lambda name: self.parameters[name],
            "encodeUriComponent": lambda s: quote(str(s), safe=""),
            "encodeURIComponent": lambda s: quote(str(s), safe=""),
            "utcNow": lambda fmt=None: "Tue, 24 Nov 2026 12:00:00 GMT",
            "createArray": lambda *xs: list(xs),
            "join": lambda xs, sep: sep.join(str(x) for x in xs),
            "replace": lambda text, old, new: str(text).replace(old, new),
            "concat": lambda *parts: "".join(str(p) for p in parts),
        }

    def expression(self, text: str) -> Any:
        tokens = _tokens(text)
        value, rest = self._parse(tokens)
        assert not rest, f"trailing tokens in {text!r}: {rest}"
        return value

    def _parse(self, tokens: list[tuple[str, str]]) -> tuple[Any, list[tuple[str, str]]]:
        (kind, text), rest = tokens[0], tokens[1:]
        if kind == "str":
            value: Any = text[1:-1].replace("''", "'")
        elif kind == "num":
            value = int(text)
        elif kind == "name" and text in ("true", "false", "null") and (not rest or rest[0][1] != "("):
            value = {"true": True, "false": False, "null": None}[text]
        elif kind == "name":
            assert rest and rest[0][1] == "(", f"{text} is not called"
            rest = rest[1:]
            args: list[Any] = []
            while rest[0][1] != ")":
                arg, rest = self._parse(rest)
                args.append(arg)
                if rest[0][1] == ",":
                    rest = rest[1:]
            rest = rest[1:]
            assert text in self.functions, f"function {text}() is not interpreted here"
            value = self.functions[text](*args)
        else:
            raise AssertionError(f"unexpected {text!r}")
        while rest and rest[0][1] in ("?[", "["):
            safe = rest[0][1] == "?["
            key, rest = self._parse(rest[1:])
            assert rest[0][1] == "]"
            rest = rest[1:]
            if value is None and safe:
                continue
            value = value.get(key) if safe and isinstance(value, dict) else value[key]
        return value, rest

    def value(self, raw: Any) -> Any:
        """A workflow value: "@expr" is evaluated (any type), "@{expr}" interpolated into a string."""
        if isinstance(raw, dict):
            return {k: self.value(v) for k, v in raw.items()}
        if isinstance(raw, list):
            return [self.value(v) for v in raw]
        if not isinstance(raw, str):
            return raw
        if raw.startswith("@") and not raw.startswith("@{") and not raw.startswith("@@"):
            return self.expression(raw[1:])

        def interpolate(match: re.Match[str]) -> str:
            got = self.expression(match.group(1))
            return got if isinstance(got, str) else json.dumps(got)

        return re.sub(r"@\{((?:[^{}']|'(?:[^']|'')*')*)\}", interpolate, raw)

    def condition(self, raw: Any) -> bool:
        """An If action's expression: and / or / not of equals / greater ..."""
        if isinstance(raw, str):
            return bool(self.value(raw))
        ((op, operands),) = raw.items()
        if op == "and":
            return all(self.condition(o) for o in operands)
        if op == "or":
            return any(self.condition(o) for o in operands)
        if op == "not":
            return not self.condition(operands)
        return bool(self.functions[op](*(self.value(o) for o in operands)))


class Table:
    """Azure Table storage as the workflow uses it: entities with ETags, 409 and 412."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, Any]] = {}
        self.version = 0

    def request(self, method: str, uri: str, headers: dict[str, Any], body: Any) -> tuple[int, dict[str, Any], Any]:
        match = re.fullmatch(r"https://acct\.table\.core\.windows\.net/outcomes(?:\(PartitionKey='([^']*)',RowKey='([^']*)'\))?",
                             uri)
        assert match, uri
        if method == "POST":
            assert match.group(1) is None
            key = f"{body['PartitionKey']}|{body['RowKey']}"
            if key in self.rows:
                return 409, {}, {"odata.error": {"code": "EntityAlreadyExists"}}
            return self._store(key, body, 204)
        key = f"{unquote(match.group(1))}|{unquote(match.group(2))}"  # (the service decodes the URI)
        row = self.rows.get(key)
        if method == "GET":
            return (404, {}, None) if row is None else (200, {"ETag": row["etag"]}, row["entity"])
        assert method == "PUT"
        if row is None or headers.get("If-Match") not in ("*", row["etag"]):
            return 412, {}, {"odata.error": {"code": "UpdateConditionNotSatisfied"}}
        return self._store(key, body, 204)

    def _store(self, key: str, entity: dict[str, Any], status: int) -> tuple[int, dict[str, Any], Any]:
        self.version += 1
        etag = f'W/"datetime\'{self.version}\'"'
        self.rows[key] = {"etag": etag, "entity": dict(entity)}
        return status, {"ETag": etag}, None


def _workflow() -> dict[str, Any]:
    return json.loads(WORKFLOW.read_text(encoding="utf-8"))


PARAMETERS = {"storageAccountName": "acct", "tableName": "outcomes", "teamsGroupId": "g", "teamsChannelId": "c",
              "$connections": {"teams": {"connectionId": "teams"}}}


class LogicApp:
    """Runs the workflow's terminal-record branch step by step, the way Logic Apps orders it."""

    def __init__(self, table: Table) -> None:
        definition = _workflow()["definition"]
        self.actions = definition["actions"]
        self.terminal = self.actions["Is_terminal_record"]
        self.table = table
        self.posts: list[str] = []

    def start(self, record: dict[str, Any]) -> Run:
        message = {"ContentData": base64.b64encode(orjson.dumps(record)).decode()}
        run = Run(message, PARAMETERS)
        run.outputs["Record"] = run.value(self.actions["Record"]["inputs"])
        return run

    def read(self, run: Run) -> bool:
        """Up to the GET of the folded row; False if this is no terminal record."""
        if not run.condition(self.terminal["expression"]):
            return False
        branch = self.terminal["actions"]
        for name in ("Outcome", "Rank"):
            run.outputs[name] = run.value(branch[name]["inputs"])
        self._http(run, "Read_fleet_outcome", branch["Read_fleet_outcome"])
        return True

    def write(self, run: Run) -> str:
        """The rest of the run after the read; returns what happened."""
        branch = self.terminal["actions"]
        first = branch["Is_first_report"]
        if run.condition(first["expression"]):
            if self._http(run, "Insert_outcome", first["actions"]["Insert_outcome"]) >= 400:
                return "failed"  # (409: a concurrent run inserted first; resubmit)
            self._post(run, first["actions"]["Post_outcome"])
            return "inserted"
        stronger = first["else"]["actions"]["Is_stronger"]
        if not run.condition(stronger["expression"]):
            return "kept"
        if self._http(run, "Upgrade_outcome", stronger["actions"]["Upgrade_outcome"]) >= 400:
            return "failed"  # (412: the row changed since the read; resubmit)
        self._post(run, stronger["actions"]["Post_stronger_outcome"])
        return "upgraded"

    def deliver(self, record: dict[str, Any]) -> str:
        run = self.start(record)
        return self.write(run) if self.read(run) else "other"

    def _http(self, run: Run, name: str, action: dict[str, Any]) -> int:
        inputs = run.value(action["inputs"])
        status, headers, body = self.table.request(inputs["method"], inputs["uri"], inputs.get("headers", {}),
                                                   inputs.get("body"))
        run.outputs[name] = {"statusCode": status, "headers": headers, "body": body}
        run.bodies[name] = body
        return status

    def _post(self, run: Run, action: dict[str, Any]) -> None:
        self.posts.append(run.value(action["inputs"]["body"]["messageBody"]))


# -- sefwd's own terminal records -------------------------------------------------------------------

def _terminal_record(vm: str, outcome: str, *, legacy: bool = False) -> dict[str, Any]:
    """The terminal record one VM's agent writes for EVENT_ID, concluding ``outcome``."""
    event = {"EventId": EVENT_ID, "EventStatus": "Started" if outcome == COMPLETED else "Scheduled",
             "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm-0", "vm-1", "vm-2"],
             "NotBefore": "" if outcome == COMPLETED else "Tue, 24 Nov 2026 12:00:00 GMT",
             "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}
    before = parse_document(orjson.dumps({"DocumentIncarnation": 2, "Events": [event]}))
    after = parse_document(orjson.dumps({"DocumentIncarnation": 3, "Events": []}))
    now = datetime(2026, 11, 24, 11, 0, tzinfo=timezone.utc) if outcome != UNKNOWN else datetime(2026, 11, 24, 12, 30,
                                                                                                    tzinfo=timezone.utc)
    changes = diff(before, after, now, EvidenceContext(now=now, vm_names=frozenset({vm})))
    factory = RecordFactory(VmIdentity(vm_id=f"id-{vm}", name=vm, resource_id=f"/vms/{vm}"), "2020-07-01")
    (record,) = [r.to_dict() for r in factory.for_changes(changes, after)]
    assert record["data"]["Outcome"] == outcome, record["data"]
    if legacy:  # an agent from before outcomes: no data.Outcome, the record type says it
        del record["data"]["Outcome"]
    return record


def test_the_records_are_what_the_workflow_reads() -> None:
    for outcome in (COMPLETED, UNKNOWN, CANCELED):
        record = _terminal_record("vm-0", outcome)
        assert record["eventkey"] == f"{EVENT_ID}:ended"
        assert record["data"]["EventId"] == EVENT_ID and record["data"]["Vm"]["Name"] == "vm-0"


def test_the_rank_and_outcome_expressions_as_written() -> None:
    app = LogicApp(Table())
    for outcome, rank in FOLD_ORDER.items():
        for legacy in (False, True):
            run = app.start(_terminal_record("vm-0", outcome, legacy=legacy))
            assert app.read(run)
            assert (run.outputs["Outcome"], run.outputs["Rank"]) == (outcome, rank), (outcome, legacy)
    assert FOLD_ORDER == {COMPLETED: 2, UNKNOWN: 1, CANCELED: 0}
    scheduled = _terminal_record("vm-0", COMPLETED) | {"type": "scheduledevent.scheduled"}
    assert app.deliver(scheduled) == "other"  # not a terminal record: no fold


def test_the_table_operations_are_conditional() -> None:
    """Insert creates (409 when it exists), the upgrade replaces only the version read (If-Match)."""
    branch = _workflow()["definition"]["actions"]["Is_terminal_record"]["actions"]
    first = branch["Is_first_report"]
    assert first["runAfter"] == {"Read_fleet_outcome": ["Succeeded", "Failed"]}  # a 404 is a failed action
    assert first["expression"] == {"and": [{"equals": ["@outputs('Read_fleet_outcome')?['statusCode']", 404]}]}
    insert = first["actions"]["Insert_outcome"]["inputs"]
    assert insert["method"] == "POST" and "If-Match" not in insert["headers"]
    upgrade = first["else"]["actions"]["Is_stronger"]["actions"]["Upgrade_outcome"]["inputs"]
    assert upgrade["method"] == "PUT"
    assert upgrade["headers"]["If-Match"] == "@{outputs('Read_fleet_outcome')?['headers']?['ETag']}"
    assert upgrade["uri"] == branch["Read_fleet_outcome"]["inputs"]["uri"]  # the row that was read
    for action in (first["actions"]["Insert_outcome"], first["else"]["actions"]["Is_stronger"]["actions"]["Upgrade_outcome"]):
        assert action["retryPolicy"] == {"type": "none"}  # a conflict is final; resubmitting folds again
    # The row is keyed by the fleet-wide eventkey: one row per EventId whatever the outcome.
    run = LogicApp(Table()).start(_terminal_record("vm-1", CANCELED))
    assert run.value(insert["body"]["RowKey"]) == f"{EVENT_ID}:ended"
    assert run.value(insert["body"]["PartitionKey"]) == EVENT_ID


@pytest.mark.parametrize("outcomes", sorted(set(itertools.permutations([CANCELED, UNKNOWN, COMPLETED, CANCELED]))))
def test_any_order_of_reports_folds_to_the_strongest(outcomes: tuple[str, ...]) -> None:
    table = Table()
    app = LogicApp(table)
    results = [app.deliver(_terminal_record(f"vm-{i}", outcome)) for i, outcome in enumerate(outcomes)]
    (row,) = table.rows.values()
    assert row["entity"]["Outcome"] == fold(outcomes) and row["entity"]["Rank"] == FOLD_ORDER[fold(outcomes)]
    assert "failed" not in results
    # Teams hears the first outcome, then only a stronger one: each message is stronger than the last.
    told = [re.search(r"ended: (\w+)</b>", p).group(1) for p in app.posts]  # type: ignore[union-attr]
    assert told[0] == outcomes[0] and told[-1] == fold(outcomes)
    assert all(FOLD_ORDER[a] < FOLD_ORDER[b] for a, b in zip(told, told[1:]))
    # A redelivery of any report (Event Hubs is at least once) changes nothing and tells no one.
    posts = len(app.posts)
    assert app.deliver(_terminal_record("vm-0", outcomes[0])) == "kept"
    assert len(app.posts) == posts


def test_concurrent_runs_conflict_instead_of_losing_the_stronger_outcome() -> None:
    table = Table()
    app = LogicApp(table)
    # Two first reports read "no row" at the same time: one insert wins, the other gets 409.
    weak, strong = app.start(_terminal_record("vm-0", CANCELED)), app.start(_terminal_record("vm-1", COMPLETED))
    assert app.read(weak) and app.read(strong)
    assert app.write(weak) == "inserted" and app.write(strong) == "failed"
    assert app.deliver(_terminal_record("vm-1", COMPLETED)) == "upgraded"  # resubmitted: folds again
    # Two upgrades read the same version: the second one's If-Match is stale (412).
    table2 = Table()
    app2 = LogicApp(table2)
    assert app2.deliver(_terminal_record("vm-0", CANCELED)) == "inserted"
    unknown, completed = app2.start(_terminal_record("vm-1", UNKNOWN)), app2.start(_terminal_record("vm-2", COMPLETED))
    assert app2.read(completed) and app2.read(unknown)
    assert app2.write(completed) == "upgraded" and app2.write(unknown) == "failed"
    (row,) = table2.rows.values()
    assert row["entity"]["Outcome"] == COMPLETED  # the weaker concurrent report did not overwrite it
    assert app2.deliver(_terminal_record("vm-1", UNKNOWN)) == "kept"  # resubmitted: weaker, no change


# -- KQL ------------------------------------------------------------------------------------------

def _code(text: str) -> str:
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def test_the_kql_query_folds_with_the_same_rule() -> None:
    code = " ".join(_code(OUTCOMES_KQL.read_text(encoding="utf-8")).split())
    # Every terminal record type, at-least-once duplicates collapsed first.
    for kind in ("completed", "canceled", "ended"):
        assert f'"scheduledevent.{kind}"' in code
    dedupe = code.index("summarize arg_max(TimeGenerated, *) by RecordId")
    # A VM's conclusion: data.Outcome, or for older agents the record type (ended -> unknown).
    assert re.search(r'VmOutcome = iff\(isnotempty\(Outcome\), Outcome, case\(RecordType == "scheduledevent.completed", '
                     r'"completed", RecordType == "scheduledevent.canceled", "canceled", "unknown"\)\)', code)
    # The rank is the fold order.
    (case,) = re.findall(r"Rank = case\(([^)]*)\)", code)
    pairs = re.findall(r'VmOutcome == "(\w+)", (\d+)', case)
    default = int(case.rsplit(",", 1)[1])
    ranks = {outcome: int(rank) for outcome, rank in pairs}
    assert {o: ranks.get(o, default) for o in FOLD_ORDER} == FOLD_ORDER
    # One row per EventId, the outcome of the highest rank (arg_max on Rank), after the dedupe.
    fold_at = code.index("summarize arg_max(Rank, VmOutcome")
    assert fold_at > dedupe
    assert re.search(r"summarize arg_max\(Rank, VmOutcome, [^)]*\),.*? by EventId\b", code[fold_at:])
    assert "Outcome = VmOutcome" in code[fold_at:]
