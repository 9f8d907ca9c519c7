"""``sefwd keys``: make the fleet master secret and derive one VM's keys from it (for deployment scripts).

The master is read from a file or an environment variable, never from the command line (``ps``
shows arguments to every local user); derived keys go to stdout only.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from forwarder.common.fleet_keys import CALLBACK_PURPOSE, RECORD_PURPOSE, as_secret, derive_key
from forwarder.common.signing import generate_secret, load_secret
from forwarder.errors import UsageError

PURPOSES = {"record": RECORD_PURPOSE, "callback": CALLBACK_PURPOSE}


def register(subparsers: Any) -> None:
    """Add ``keys derive`` and ``keys new-master`` to the ``sefwd`` subparsers."""
    p = subparsers.add_parser(
        "keys", help="make the fleet master secret; derive a VM's record key and callback secret from it",
        description="One master secret for the fleet (kept by the operator and the consumers); each VM gets "
                    "only its own keys,\nderived from the master and its resourceId (docs/security-model.md).",
        epilog="examples:\n"
               "  sefwd keys new-master > master.secret      # once, keep it in Key Vault\n"
               "  sefwd keys derive --master-file master.secret --resource-id \"$VM_ID\" --purpose record\n"
               "  SEFWD_MASTER=whsec_... sefwd keys derive --master-env SEFWD_MASTER --resource-id \"$VM_ID\" --json\n\n"
               "exit codes: 0 ok, 2 usage or unreadable master",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ksub = p.add_subparsers(dest="keys_command", metavar="ACTION")
    ksub.required = True
    raw = argparse.RawDescriptionHelpFormatter
    ksub.add_parser("new-master", help="print a new random master secret (whsec_ + 32 random bytes)",
                    description="Print a new fleet master secret. Keep it where the consumers read it "
                                "(Key Vault), never on a VM.",
                    epilog="examples:\n  sefwd keys new-master > master.secret\n\nexit codes: 0 ok",
                    formatter_class=raw)
    d = ksub.add_parser("derive", help="print one VM's derived key(s)",
                        description="Derive the record key or the callback secret of one VM from the master "
                                    "and the VM's resourceId.",
                        epilog="examples:\n"
                               "  sefwd keys derive --master-file master.secret --resource-id \"$ID\" > record.key\n"
                               "  sefwd keys derive --master-env SEFWD_MASTER --resource-id \"$ID\" --purpose callback\n\n"
                               "exit codes: 0 ok, 2 usage error or unreadable master",
                        formatter_class=raw)
    source = d.add_mutually_exclusive_group(required=True)
    source.add_argument("--master-file", metavar="FILE", help="file holding the master secret (whsec_...)")
    source.add_argument("--master-env", metavar="NAME", help="environment variable holding the master secret")
    d.add_argument("--resource-id", required=True, metavar="ID",
                   help="the VM's resourceId, as IMDS reports it (case does not matter)")
    d.add_argument("--purpose", choices=sorted(PURPOSES), default="record",
                   help="record: [agent] record_key_env/_file; callback: [approval.callback] secret (default record)")
    d.add_argument("--json", action="store_true", help='print {"resourceId", "record_key", "callback_secret"}')


def run(args: argparse.Namespace) -> int:
    if args.keys_command == "new-master":
        print(generate_secret())
        return 0
    options = {"master_env": args.master_env, "master_file": args.master_file}
    master = load_secret({k: v for k, v in options.items() if v is not None}, prefix="master")
    if master is None:  # argparse requires one of the two
        raise UsageError(["give --master-file or --master-env"])
    resource_id = args.resource_id.strip()
    if not resource_id.lower().startswith(("/subscriptions/", "/vm/")):
        raise UsageError([f"--resource-id must be a VM resourceId (/subscriptions/...), got {resource_id[:80]!r}"])
    if args.json:
        keys = {name: as_secret(derive_key(master, purpose, resource_id)) for name, purpose in PURPOSES.items()}
        sys.stdout.write(json.dumps({"resourceId": resource_id, "record_key": keys["record"],
                                     "callback_secret": keys["callback"]}) + "\n")
    else:
        print(as_secret(derive_key(master, PURPOSES[args.purpose], resource_id)))
    return 0
