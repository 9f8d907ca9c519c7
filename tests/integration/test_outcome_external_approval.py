"""The agent knows about approvals it did not make (issue 23): an event approved through Azure
Resource Manager or by another VM, then seen Started long before NotBefore, carries
``data.EarlyStart`` and ends ``completed`` with ``approved_elsewhere`` evidence, also across a
restart; never a false cancel. The poller runs against the emulator, the ARM acknowledgement goes
through the real azure-mgmt-core pipeline."""
from __future__ import annotations

from pathlib import Path

import pytest

from forwarder.approval.arm import ArmApprover, ArmTarget
from forwarder.emulator import Emulator
from tests.arm import arm_certs, arm_emulator, resource_id
from tests.integration.test_outcome_poller import TERMINAL, of, poll_until, poller_for, terminal

pytestmark = pytest.mark.timeout(60)
STARTED = ("scheduledevent.started",)


def test_an_arm_approval_is_recorded_as_approved_elsewhere_through_a_restart(tmp_path: Path, monkeypatch) -> None:
    certs = arm_certs(tmp_path / "tls")
    state = tmp_path / "state"
    with arm_emulator(certs, vms=["vm-0"]) as emu:
        monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", emu.url)
        from azure.identity import ManagedIdentityCredential

        event = emu.schedule(type="Reboot", not_before="+15m", resources=["vm-0"])
        with poller_for(emu, state) as poller:
            poll_until(poller, lambda: of(state, event, ("scheduledevent.scheduled",)), "scheduled record")
            with ManagedIdentityCredential() as credential, ArmApprover(
                    credential, endpoint=emu.arm_url, connection_verify=str(certs.ca)) as arm:
                assert arm.acknowledge(ArmTarget.from_resource_id(resource_id(emu, "vm-0")), [event]).approved == [event]
            (started,) = poll_until(poller, lambda: of(state, event, STARTED), "started record")
        early = started["data"]["EarlyStart"]
        assert early["ApprovedBy"] == "elsewhere" and 800 < early["SecondsBeforeNotBefore"] <= 900
        emu.complete(event)
        with poller_for(emu, state) as poller:  # restarted: the evidence was saved with the document
            assert event.lower() in poller.evidence.approved_elsewhere
            poll_until(poller, lambda: of(state, event, TERMINAL), "terminal record")
    data = terminal(state, event)
    assert data["Outcome"] == "completed"
    assert data["Evidence"]["Used"] == ["seen_started", "approved_elsewhere"]
    assert data["Evidence"]["ApprovedAt"] is None and data["Evidence"]["ApprovedElsewhereAt"] is not None


def test_another_vms_approval_is_approved_elsewhere_and_ours_is_ours(tmp_path: Path) -> None:
    with Emulator(vms=["vm-0", "vm-1"], rate_limit=None) as emu:
        theirs = emu.schedule(type="Reboot", not_before="+15m", resources=["vm-0", "vm-1"])
        ours = emu.schedule(type="Reboot", not_before="+15m", resources=["vm-0"])
        with poller_for(emu, tmp_path) as poller:
            poll_until(poller, lambda: of(tmp_path, ours, ("scheduledevent.scheduled",)), "scheduled records")
            emu.approve(theirs, "vm-1")
            poll_until(poller, lambda: of(tmp_path, theirs, STARTED), "started record")
            poller.evidence.approval_accepted([ours], poller._wall())  # as the agent's approver reports it
            emu.approve(ours, "vm-0")
            poll_until(poller, lambda: of(tmp_path, ours, STARTED), "started record")
            emu.complete(theirs)
            emu.complete(ours)
            poll_until(poller, lambda: of(tmp_path, ours, TERMINAL) and of(tmp_path, theirs, TERMINAL), "terminal")
    assert of(tmp_path, theirs, STARTED)[0]["data"]["EarlyStart"]["ApprovedBy"] == "elsewhere"
    assert of(tmp_path, ours, STARTED)[0]["data"]["EarlyStart"]["ApprovedBy"] == "this_vm"
    # The two completions are two documents: a poll that sees both at once also names the unseen
    # one (incarnation_jump, issue 20's rule); who approved is what this test is about.
    assert terminal(tmp_path, theirs)["Evidence"]["Used"][:2] == ["seen_started", "approved_elsewhere"]
    assert terminal(tmp_path, ours)["Evidence"]["Used"][:2] == ["seen_started", "approval_accepted"]
    assert "approved_elsewhere" not in terminal(tmp_path, ours)["Evidence"]["Used"]


def test_a_start_at_not_before_is_no_early_start(tmp_path: Path) -> None:
    with Emulator(rate_limit=None) as emu:
        event = emu.schedule(type="Freeze", start_after="1s", complete_after="30s")
        with poller_for(emu, tmp_path, poll_interval=0.2) as poller:
            (started,) = poll_until(poller, lambda: of(tmp_path, event, STARTED), "started record")
    assert "EarlyStart" not in started["data"]


def test_approved_elsewhere_and_gone_between_two_polls_is_never_canceled(tmp_path: Path) -> None:
    """The Started state lived between two polls: the agent cannot tell who approved, but it must
    not call the event canceled (an unseen state says something happened)."""
    with Emulator(vms=["vm-0", "vm-1"], rate_limit=None) as emu:
        event = emu.schedule(type="Reboot", not_before="+15m", resources=["vm-0", "vm-1"])
        with poller_for(emu, tmp_path) as poller:
            poll_until(poller, lambda: of(tmp_path, event, ("scheduledevent.scheduled",)), "scheduled record")
            emu.approve(event, "vm-1")
            emu.complete(event)
            poll_until(poller, lambda: of(tmp_path, event, TERMINAL), "terminal record")
    data = terminal(tmp_path, event)
    assert data["Outcome"] != "canceled" and data["Evidence"]["UnseenStates"] == 1
    assert of(tmp_path, event, STARTED) == []
