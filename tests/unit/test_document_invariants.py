"""Property: any JSON document, and any sequence of them, passes parse → diff → records → bytes →
heartbeat raising nothing but DocumentError, and a refused document leaves the baseline as it was.

Examples per run (CI): 1,200 arbitrary JSON values (some nested up to 600 levels), 1,200 near-valid
documents mutated field by field, and 300 sequences of 2 to 6 documents (~1,200 more documents):
about 3,600 documents, 40-55 s on this 2-core machine under load.

The sequences go through the agent's own poll cycle: the real ``Poller`` with the real IMDS client
(against a minimal HTTP server on 127.0.0.1 serving each body) and a real SQLite store, so "a
refused document changes no state" is checked on the poller's baseline, the record factory's
sequence and what the store holds, not on a model of them.
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forwarder.imds.differ import diff
from forwarder.imds.document import Document, parse_document
from forwarder.errors import DocumentError
from forwarder.imds.identity import VmIdentity
from forwarder.imds.client import ImdsClient, RequestBudget
from forwarder.agent.poller import Poller
from forwarder.records import RecordFactory
from forwarder.store.database import Store
from tests.adversarial.hostile import HostileServer, Reply, Request
from tests.conftest import examples

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=timezone.utc)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["", " ", "\r\n", "\x00", "Started", "Scheduled", "Reboot", "Freeze", "Preempt", "Terminate",
                     "0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00", "Mon, 19 Sep 2016 18:29:47 GMT",
                     "Mon, 19 Sep 99999 18:29:47 GMT", "2016-09-19T18:29:47Z", "2016-09-19T18:29:47", "NaN"]),
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=20)


@st.composite
def deep(draw: st.DrawFn) -> Any:
    """A value nested deeper than any bound (orjson itself refuses beyond 1024 levels)."""
    depth = draw(st.integers(min_value=1, max_value=600))
    value: Any = draw(scalars)
    for _ in range(depth):
        value = [value] if draw(st.booleans()) else {"k": value}
    return value


FIELDS = ["EventId", "EventType", "ResourceType", "Resources", "EventStatus", "NotBefore", "Description",
          "EventSource", "DurationInSeconds"]
GOOD = {"EventId": st.sampled_from(["E1", "E2", "E3", "A1B2C3D4-0000-4000-8000-000000000001"]),
        "EventType": st.sampled_from(["Freeze", "Reboot", "Redeploy", "Preempt", "Terminate", "Hibernate"]),
        "ResourceType": st.just("VirtualMachine"),
        "Resources": st.lists(st.sampled_from(["myVM", "myVM2", "other"]), max_size=3),
        "EventStatus": st.sampled_from(["Scheduled", "Started"]),
        "NotBefore": st.sampled_from(["", "Mon, 23 Nov 2026 12:15:00 GMT", "2026-11-23T11:00:00Z"]),
        "Description": st.text(max_size=20), "EventSource": st.sampled_from(["Platform", "User"]),
        "DurationInSeconds": st.sampled_from([-1, 0, 5, 900])}


@st.composite
def event(draw: st.DrawFn) -> dict[str, Any]:
    ev = {name: draw(strategy) for name, strategy in GOOD.items() if draw(st.booleans()) or name == "EventId"}
    for name in draw(st.lists(st.sampled_from(FIELDS + ["Future", "Nested"]), max_size=2)):
        ev[name] = draw(st.one_of(json_values, deep()))  # one field turned hostile
    return ev


@st.composite
def near_valid(draw: st.DrawFn) -> Any:
    doc: dict[str, Any] = {"DocumentIncarnation": draw(st.one_of(st.integers(0, 20), scalars)),
                           "Events": draw(st.lists(event(), max_size=4))}
    mutation = draw(st.integers(0, 5))
    if mutation == 0:
        doc["Events"] = draw(st.one_of(scalars, json_values))
    elif mutation == 1:
        del doc["Events"]
    elif mutation == 2:
        doc[draw(st.text(max_size=6))] = draw(st.one_of(json_values, deep()))
    return doc


def encode(value: Any) -> bytes:
    """Like a server would: stdlib json writes any integer width (orjson stops at 64 bits)."""
    try:
        return json.dumps(value).encode()
    except RecursionError:
        return b"[" * 2000 + b"]" * 2000  # deeper than any parser takes: refused as not JSON


def downstream(body: bytes, previous: Document | None, factory: RecordFactory) -> Document | None:
    """The agent's path for one body; returns the new baseline (the old one if refused)."""
    try:
        document = parse_document(body)
    except DocumentError:
        return previous  # refused: the baseline is unchanged
    changes = diff(previous, document, NOW)
    for record in factory.for_changes(changes, document):
        assert orjson.loads(record.body)["type"].startswith("scheduledevent.")
    heartbeat = factory.lifecycle("heartbeat", {"DocumentIncarnation": document.incarnation,
                                                "CurrentEvents": len(document.events)})
    orjson.loads(heartbeat.body)
    return document


def new_factory() -> RecordFactory:
    return RecordFactory(VmIdentity(vm_id="v", name="myVM"), "2020-07-01", clock=lambda: NOW)


@pytest.mark.slow  # a large property run
@settings(max_examples=examples(1200), **SETTINGS)
@given(st.one_of(json_values, deep()))
def test_any_json_value_is_a_document_or_a_document_error(value: Any) -> None:
    downstream(encode(value), None, new_factory())


@pytest.mark.slow  # a large property run
@settings(max_examples=examples(1200), **SETTINGS)
@given(near_valid())
def test_near_valid_documents_mutated_field_by_field(value: Any) -> None:
    downstream(encode(value), None, new_factory())


class Served:
    """What the HTTP server answers: the current body for Scheduled Events, a VM for compute."""

    def __init__(self) -> None:
        self.body = b"{}"

    def __call__(self, req: Request) -> Reply:
        if "/metadata/instance" in req.target:
            return Reply.json({"vmId": "v", "name": "myVM"})
        return Reply(body=self.body, headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def imds() -> Iterator[tuple[Served, ImdsClient]]:
    served = Served()
    with HostileServer(served) as server:
        # No request budget: the property sends thousands of polls, far faster than IMDS allows.
        client = ImdsClient(server.url, "2020-07-01", budget=RequestBudget(limit=10**9))
        try:
            yield served, client
        finally:
            client.close()


def stored(store: Store) -> list[bytes]:
    return [bytes(row[0]) for row in store.query("SELECT body FROM records ORDER BY id")]


@pytest.mark.slow  # a large property run
@settings(max_examples=examples(300), **SETTINGS)
@given(st.lists(near_valid(), min_size=2, max_size=6))
def test_sequences_never_raise_and_a_refused_document_keeps_the_baseline(imds: tuple[Served, ImdsClient],
                                                                         values: list[Any]) -> None:
    served, client = imds
    with tempfile.TemporaryDirectory(prefix="sefwd-inv-") as tmp:
        store = Store.open(Path(tmp), fsync=False)
        try:
            state = store.load_state()
            factory = RecordFactory(VmIdentity(vm_id="v", name="myVM"), "2020-07-01", sequence=state.sequence,
                                    clock=lambda: NOW)
            poller = Poller(client, state, factory, store, poll_interval=1.0, heartbeat=0, compute_refresh=0,
                            wallclock=lambda: NOW, boot_id=lambda: "boot-1")
            for value in values:
                served.body = body = encode(value)
                try:
                    parse_document(body)
                    refused = False
                except DocumentError:
                    refused = True
                before_current, before_state = poller.current, dataclasses.replace(poller.state)
                before_sequence, before_records = factory.sequence, stored(store)
                before_stats = dataclasses.replace(poller.stats)
                poller.poll_once()  # raises nothing, whatever the body
                assert poller.stats.imds_errors == 0 and poller.stats.cycle_errors == 0
                if refused:
                    assert poller.stats.bad_documents == before_stats.bad_documents + 1
                    assert poller.current is before_current
                    assert poller.state == before_state
                    assert factory.sequence == before_sequence
                    assert store.load_state() == before_state  # nothing of it reached the store either
                    assert stored(store) == before_records
                elif before_state.document is not None and before_state.document.encode() == body:
                    assert poller.stats.unchanged == before_stats.unchanged + 1
                    assert factory.sequence == before_sequence and stored(store) == before_records
                else:
                    # Accepted: the baseline, the sequence and the records moved together, in the store too.
                    assert poller.stats.bad_documents == before_stats.bad_documents
                    assert poller.current is not None and poller.current is not before_current
                    assert poller.state.document == body.decode() and store.load_state() == poller.state
                    new = stored(store)[len(before_records):]
                    assert factory.sequence == before_sequence + len(new) == poller.state.sequence
                    for record in new:
                        assert orjson.loads(record)["type"].startswith("scheduledevent.")
                # The heartbeat carries the current incarnation (any width the document had) and serializes.
                assert poller.emit_lifecycle("heartbeat", **poller.heartbeat_data())
                beat = orjson.loads(stored(store)[-1])
                assert beat["type"] == "forwarder.heartbeat"
                assert beat["data"]["DocumentIncarnation"] == (poller.current.incarnation if poller.current else None)
        finally:
            store.close()
