"""Atomic persistence of the agent state."""
from __future__ import annotations

import pytest

from forwarder.errors import StateError
from forwarder.state import AgentState, StateStore


def test_round_trip(tmp_path):
    store = StateStore(tmp_path / "s")
    store.ensure_dir()
    assert store.load() == AgentState()
    store.save(AgentState(sequence=7, document='{"DocumentIncarnation":1,"Events":[]}', api_version="2020-07-01", vm={"vm_id": "x"}))
    loaded = store.load()
    assert loaded.sequence == 7 and loaded.document.startswith("{") and loaded.vm == {"vm_id": "x"}
    assert not list((tmp_path / "s").glob(".*tmp"))


def test_damaged_state_is_set_aside_not_fatal(tmp_path):
    store = StateStore(tmp_path)
    (tmp_path / "state.json").write_bytes(b'{"sequence": 3, "docu')
    assert store.load() == AgentState()
    assert list(tmp_path.glob("state.json.damaged-*"))


def test_second_agent_on_same_state_dir_is_refused(tmp_path):
    a, b = StateStore(tmp_path), StateStore(tmp_path)
    a.lock()
    try:
        with pytest.raises(StateError, match="another sefwd agent"):
            b.lock()
    finally:
        a.unlock()
    b.lock()
    b.unlock()
