"""`sefwd approve --via arm` (a real subprocess, azure-identity's DefaultAzureCredential and
azure-mgmt-core's pipeline) against the emulator's Azure Resource Manager side."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from forwarder.emulator import Emulator
from tests.agent import ROOT
from tests.arm import ArmCerts, arm_certs, arm_emulator, arm_env, event_status, resource_id

pytestmark = pytest.mark.timeout(120)

VMS = ["vm-0", {"name": "ss_3", "vm_scale_set_name": "ss"}, {"name": "vm-1", "availability_set": "as-1"},
       {"name": "vm-2", "availability_set": "as-1"}]


@pytest.fixture
def certs(tmp_path: Path) -> ArmCerts:
    return arm_certs(tmp_path / "tls")


@pytest.fixture
def emu(certs: ArmCerts):
    with arm_emulator(certs, vms=VMS) as emulator:
        yield emulator


def approve(emu: Emulator, certs: ArmCerts, home: Path, *args: str, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    full = arm_env(emu, certs, home)
    full.update(env or {})
    full["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "forwarder", "approve", "--via", "arm", *args],
                          capture_output=True, text=True, timeout=90, env=full, cwd=str(ROOT))


def test_a_vm_event_is_approved_and_imds_shows_it_started_as_after_start_requests(emu, certs, tmp_path):
    event = emu.schedule(resources=["vm-0"], type="Reboot")
    out = approve(emu, certs, tmp_path, event, "--resource-id", resource_id(emu, "vm-0"))
    assert (out.returncode, out.stdout) == (0, f"approved {event}\n"), out.stderr
    assert event_status(emu, event) == "Started"
    (request,) = emu.stats()["start_requests"]
    assert request["via"] == "arm" and request["vm"] == "vm-0" and request["accepted"]
    (arm,) = emu.stats()["arm_requests"]
    assert arm["status"] == 200 and arm["path"].endswith(f"/virtualMachines/vm-0/providers/Microsoft.Maintenance/"
                                                         f"scheduledevents/{event}/acknowledge")
    assert emu.stats()["token_requests"] >= 1  # the token came from the emulator's managed identity


def test_a_scale_set_instance_is_approved_on_its_scale_set(emu, certs, tmp_path):
    event = emu.schedule(resources=["ss_3"], type="Freeze", duration=5)
    rid = resource_id(emu, "ss_3")
    assert rid.endswith("/virtualMachineScaleSets/ss/virtualMachines/3")
    out = approve(emu, certs, tmp_path, event, "--resource-id", rid, "--json")
    assert out.returncode == 0, out.stderr
    answer = orjson.loads(out.stdout)
    assert answer["status"] == "approved" and answer["approved"] == [event] and answer["via"] == "arm"
    assert answer["resource_id"].endswith("/virtualMachineScaleSets/ss")
    assert event_status(emu, event) == "Started"
    assert "/virtualMachineScaleSets/ss/providers/" in emu.stats()["arm_requests"][0]["path"]


def test_an_availability_set_event_is_approved_on_the_set(emu, certs, tmp_path):
    event = emu.schedule(resources=["vm-1", "vm-2"], type="Reboot")
    rid = resource_id(emu, "vm-1").replace("/virtualMachines/vm-1", "/availabilitySets/as-1")
    out = approve(emu, certs, tmp_path, event, "--resource-id", rid)
    assert (out.returncode, out.stdout) == (0, f"approved {event}\n"), out.stderr
    assert event_status(emu, event) == "Started"


def test_a_token_for_another_audience_is_refused_with_401_and_nothing_starts(emu, certs, tmp_path):
    event = emu.schedule(resources=["vm-0"])
    out = approve(emu, certs, tmp_path, event, "--resource-id", resource_id(emu, "vm-0"),
                  "--arm-scope", "https://storage.azure.com/.default")
    assert out.returncode == 1
    assert out.stdout.startswith(f"refused {event}: not_authenticated: HTTP 401 InvalidAuthenticationTokenAudience")
    assert event_status(emu, event) == "Scheduled" and emu.stats()["start_requests"] == []


def test_an_unknown_event_is_refused_and_a_known_one_beside_it_approved(emu, certs, tmp_path):
    event = emu.schedule(resources=["vm-0"])
    other = emu.schedule(resources=["vm-1"])  # exists, but not an event of vm-0: unknown there too
    out = approve(emu, certs, tmp_path, "00000000-0000-0000-0000-000000000000", other, event,
                  "--resource-id", resource_id(emu, "vm-0"))
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert lines[0] == f"approved {event}"
    assert lines[1].startswith("refused 00000000-0000-0000-0000-000000000000: unknown_event: HTTP 404 NotFound")
    assert lines[2].startswith(f"refused {other}: unknown_event: HTTP 404 NotFound")
    assert event_status(emu, other) == "Scheduled"


def test_a_throttled_answer_is_retried_after_retry_after_then_succeeds(emu, certs, tmp_path):
    event = emu.schedule(resources=["vm-0"])
    emu.inject_fault("status", status=429, retry_after="0.2", count=2, path="arm")
    out = approve(emu, certs, tmp_path, event, "--resource-id", resource_id(emu, "vm-0"))
    assert (out.returncode, out.stdout) == (0, f"approved {event}\n"), out.stderr
    assert [r["status"] for r in emu.stats()["arm_requests"]] == [429, 429, 200]


def test_throttling_beyond_the_retries_fails_with_exit_code_1(emu, certs, tmp_path):
    event = emu.schedule(resources=["vm-0"])
    emu.inject_fault("status", status=429, retry_after="0.1", count=10, path="arm")
    out = approve(emu, certs, tmp_path, event, "--resource-id", resource_id(emu, "vm-0"), "--arm-retries", "2",
                  "--json")
    assert out.returncode == 1
    answer = orjson.loads(out.stdout)
    assert answer["status"] == "failed" and answer["reason"] == "throttled"
    assert "HTTP 429 TooManyRequests" in answer["refused"][event]
    assert [r["status"] for r in emu.stats()["arm_requests"]] == [429, 429, 429]  # 1 + 2 retries
    assert event_status(emu, event) == "Scheduled"


@pytest.mark.parametrize(("args", "problem"), [
    (["--resource-id", "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Storage/storageAccounts/x"],
     "not a Compute resource ID"),
    (["--resource-id", "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/disks/d"],
     "resource type 'disks' has no scheduled events"),
    ([], "--via arm needs --resource-id"),
    (["--resource-id", "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/v",
      "--arm-endpoint", "http://127.0.0.1:1"], "must be https://"),
])
def test_usage_errors_exit_2_before_any_request(emu, certs, tmp_path, args, problem):
    out = approve(emu, certs, tmp_path, "EV", *args)
    assert out.returncode == 2 and problem in out.stderr and out.stdout == ""
    assert "arm_requests" not in emu.stats() or emu.stats()["arm_requests"] == []


def test_an_identity_without_the_role_on_the_resource_is_refused_with_403(emu, certs, tmp_path):
    event = emu.schedule(resources=["vm-0"])
    emu.arm_grants = {emu.default_vm: (resource_id(emu, "ss_3").rpartition("/virtualMachines/")[0],)}  # the scale set only
    out = approve(emu, certs, tmp_path, event, "--resource-id", resource_id(emu, "vm-0"))
    assert out.returncode == 1
    assert out.stdout.startswith(f"refused {event}: not_authorized: HTTP 403 AuthorizationFailed")
    assert event_status(emu, event) == "Scheduled"
