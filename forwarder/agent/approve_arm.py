"""``sefwd approve --via arm``: acknowledge events through Azure Resource Manager, from any machine.

Needs Azure credentials (azure-identity's DefaultAzureCredential: environment, workload identity,
managed identity, Azure CLI login …) with ``Microsoft.Maintenance/scheduledevents/acknowledge/action``
on the resource (built-in role "Scheduled Events Contributor"), and the ``[arm]`` extra. Prints the
same lines (``approved ID`` / ``refused ID: why``) and uses the same exit codes as the on-VM route.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import orjson

from forwarder.errors import UsageError

ENDPOINT_ENV = "SEFWD_ARM_ENDPOINT"
SCOPE_ENV = "SEFWD_ARM_SCOPE"
DEFAULT_RETRIES = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the ARM route (on `sefwd approve`)."""
    parser.add_argument("--via", choices=("imds", "arm"), default="imds",
                        help="imds: POST StartRequests on this VM (default); arm: acknowledge through Azure "
                             "Resource Manager from any machine with Azure credentials (needs --resource-id)")
    parser.add_argument("--resource-id", metavar="ID",
                        help="with --via arm: the VM, scale-set instance, scale set or availability set "
                             "(/subscriptions/…/providers/Microsoft.Compute/…)")
    parser.add_argument("--arm-endpoint", metavar="URL",
                        help=f"with --via arm: the Resource Manager endpoint (default ${ENDPOINT_ENV}, else "
                             "https://management.azure.com; e.g. https://management.usgovcloudapi.net)")
    parser.add_argument("--arm-scope", metavar="SCOPE",
                        help=f"with --via arm: the token scope (default ${SCOPE_ENV}, else "
                             "https://management.azure.com/.default)")
    parser.add_argument("--arm-retries", type=int, default=DEFAULT_RETRIES, metavar="N",
                        help=f"with --via arm: retries of a throttled (429, honouring Retry-After) or failing "
                             f"request (default {DEFAULT_RETRIES})")


def check_arguments(args: argparse.Namespace) -> None:
    """ARM-only options without --via arm, or --via arm without what it needs: every problem at once."""
    problems = []
    if args.via != "arm":
        given = [name for name in ("resource_id", "arm_endpoint", "arm_scope") if getattr(args, name)]
        if given:
            problems.append(f"{', '.join('--' + n.replace('_', '-') for n in given)} apply with --via arm only")
        if problems:
            raise UsageError(problems)
        return
    if not args.resource_id:
        problems.append("--via arm needs --resource-id (the VM, scale-set instance, scale set or availability set)")
    else:
        from forwarder.approval.arm import ArmTarget

        try:
            ArmTarget.from_resource_id(args.resource_id)
        except ValueError as exc:
            problems.append(f"--resource-id: {exc}")
    if args.scope is not None:
        problems.append("--scope applies to the on-VM route only (ARM checks the caller's role instead)")
    if args.arm_retries < 0:
        problems.append("--arm-retries must be 0 or more")
    endpoint = args.arm_endpoint or os.environ.get(ENDPOINT_ENV, "")
    if endpoint and not endpoint.lower().startswith("https://"):
        problems.append(f"the ARM endpoint must be https:// (bearer tokens never go over plain HTTP), got {endpoint!r}")
    for module, extra in (("azure.mgmt.core", "arm"), ("azure.identity", "arm")):
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            problems.append(f"--via arm needs {module}: pip install 'scheduled-events-forwarder[{extra}]'")
    if problems:
        raise UsageError(problems)


def cmd_approve_arm(args: argparse.Namespace) -> int:
    """Acknowledge each EventId on the resource; 0 when all were approved, 1 otherwise."""
    from forwarder.approval.arm import DEFAULT_ENDPOINT, DEFAULT_SCOPE, ArmApprover, ArmTarget, default_credential

    check_arguments(args)
    target = ArmTarget.from_resource_id(args.resource_id)
    endpoint = args.arm_endpoint or os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT
    scope = args.arm_scope or os.environ.get(SCOPE_ENV) or DEFAULT_SCOPE
    credential = default_credential()
    try:
        with ArmApprover(credential, endpoint=endpoint, scope=scope, retry_total=args.arm_retries) as approver:
            attempt = approver.acknowledge(target, args.event_ids)
    finally:
        close = getattr(credential, "close", None)
        if close is not None:
            close()
    if args.json:
        answer = attempt.answer()
        answer["resource_id"] = target.resource_id
        sys.stdout.buffer.write(orjson.dumps(answer) + b"\n")
    else:
        for event_id in attempt.approved:
            print(f"approved {event_id}")
        for event_id, why in {**attempt.refused, **attempt.failed}.items():
            print(f"refused {event_id}: {why}")
    return 0 if attempt.outcome == "approved" else 1


__all__ = ["add_arguments", "check_arguments", "cmd_approve_arm"]
