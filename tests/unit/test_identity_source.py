"""The record `source`: resourceId, else /vm/<vmId> (compute metadata without resourceId), else /host/<name>."""
from __future__ import annotations

import socket

from forwarder.imds.identity import VmIdentity


def test_compute_metadata_with_vm_id_but_no_resource_id_gives_vm_source():
    vm = VmIdentity.from_compute({"vmId": "02aab8a4-74ef-476e-8182-f6d2ba4166a6", "name": "web-0",
                                  "osProfile": {"computerName": "web-0"}})
    assert vm.source == "/vm/02aab8a4-74ef-476e-8182-f6d2ba4166a6"
    assert vm.key == vm.vm_id


def test_resource_id_wins():
    rid = "/subscriptions/s/resourceGroups/g/providers/Microsoft.Compute/virtualMachines/web-0"
    assert VmIdentity.from_compute({"vmId": "v", "resourceId": rid}).source == rid


def test_no_instance_metadata_at_all_falls_back_to_the_host_name():
    vm = VmIdentity.fallback()
    assert not vm.known
    assert vm.source == f"/host/{socket.gethostname()}"
