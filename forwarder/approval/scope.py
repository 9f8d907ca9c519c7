"""Which events this VM may approve: approving starts the event for every VM in Resources."""
from __future__ import annotations

from forwarder.imds.document import Event
from forwarder.imds.identity import VmIdentity


def scope_refusal(event: Event, vm: VmIdentity, scope: str) -> str | None:
    """None when ``scope`` lets this VM approve ``event``, else why not (snake_case)."""
    if scope == "any":
        return None
    alone = vm.affected_by(event.resources) is True and len(event.resources) == 1
    if scope == "self":
        return None if alone else "not_only_this_vm"
    leader = vm.is_leader(event.resources) is True
    if scope == "leader":
        return None if leader else "not_the_leader"
    # self_or_leader: events of this VM alone, or shared events where this VM is the leader.
    return None if alone or leader else "neither_self_nor_leader"
