"""Runs an extension handler through the real Azure Linux guest agent's code (WALinuxAgent).

Not a simulation (that is tests/peers/guest_agent.py): this imports ``azurelinuxagent`` from a
checkout of github.com/Azure/WALinuxAgent (the directory holding the ``azurelinuxagent`` package,
named by ``SEFWD_WALINUXAGENT_SRC``; it needs the ``distro`` package) and calls its own functions:

* ``timeout``: ``CGroupConfigurator.start_extension_command`` — how waagent starts every handler
  command (``shell=True``, ``preexec_fn=os.setsid``) and, past the limit, ``os.killpg`` of the
  command's process group with SIGKILL (``extensionprocessutil.handle_process_completion``).
* ``failed-install-removed``: ``ExtHandlerInstance.install`` of an unzipped package, then
  ``ExtHandlersHandler.handle_uninstall`` — what waagent does when the extension is removed from a VM
  whose install failed.

Run as ``python -m tests.peers.walinuxagent SCENARIO JSON-ARGS`` with ``azurelinuxagent`` importable;
prints one JSON object. It runs in a process of its own: waagent's modules keep global state.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import zipfile
from typing import Any

# azurelinuxagent is imported from a checkout at run time (no stubs, not installed): mypy cannot see it.
# mypy: disable-error-code="import-not-found"


def _configure(lib: str, log: str) -> None:
    from azurelinuxagent.common import conf

    conf.__conf__.values["Lib.Dir"] = lib
    conf.__conf__.values["Extension.LogDir"] = log
    conf.__conf__.values["CGroups.Enabled"] = False  # no cgroup v1/v2 setup here: waagent's fallback path


def timeout(args: dict[str, Any]) -> dict[str, Any]:
    """One command under waagent's start_extension_command with its kill at ``timeout`` seconds."""
    _configure(args["lib"], args["log"])
    from azurelinuxagent.common.exception import ExtensionError
    from azurelinuxagent.ga.cgroupconfigurator import CGroupConfigurator

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            output = CGroupConfigurator.get_instance().start_extension_command(
                extension_name="Contoso.Sefwd", command=args["command"], cmd_name=args["name"], timeout=args["timeout"],
                shell=True, cwd=args["cwd"], env={**os.environ, **args.get("env", {})}, stdout=out, stderr=err,
                error_code=1009)
            return {"code": 0, "message": output}
        except ExtensionError as exc:
            return {"code": exc.code, "message": str(exc)}


class _Protocol:
    """The one thing launch_command asks the wire protocol for."""

    @staticmethod
    def get_endpoint() -> str:
        return "127.0.0.1"


def failed_install_removed(args: dict[str, Any]) -> dict[str, Any]:
    """Install the package with waagent's ExtHandlerInstance, then remove the extension as waagent does."""
    _configure(args["lib"], args["log"])
    from azurelinuxagent.common.exception import ExtensionError
    from azurelinuxagent.common.protocol.restapi import Extension
    from azurelinuxagent.ga.exthandlers import ExtHandlerInstance, ExtHandlersHandler, ExtHandlerState

    handler = Extension(name=args["name"])
    handler.version = args["version"]
    handler.state = "enabled"
    ext = ExtHandlerInstance(handler, _Protocol())
    # waagent's __setup_new_handler, with the download replaced by unzipping the package
    ext.set_handler_state(ExtHandlerState.NotInstalled)
    with zipfile.ZipFile(args["package"]) as zf:
        zf.extractall(ext.get_base_dir())
    ext.initialize()
    ext.update_settings(None)
    result: dict[str, Any] = {"base_dir": ext.get_base_dir()}
    try:
        ext.install()
        result["install"] = 0
    except ExtensionError as exc:
        result["install"] = exc.code
    result["state_at_removal"] = ext.get_handler_state()
    ExtHandlersHandler.handle_uninstall(None, ext, None)  # its self is unused
    result["base_dir_left"] = os.path.exists(ext.get_base_dir())
    return result


SCENARIOS = {"timeout": timeout, "failed-install-removed": failed_install_removed}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))))
