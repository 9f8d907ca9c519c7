"""What install.ps1 does with C:\\ProgramData\\sefwd, as a pure function that runs anywhere.

Any user may create a folder in C:\\ProgramData and owns it, with whatever ACL and content (a
config.toml whose hook command the LocalSystem service would run). So the installer decides from
what it finds (``DataDirState``) and ``plan`` gives the same decision as install.ps1's
``Get-DataDirPlan``; ``tests/unit/test_windows_acl_plan.py`` checks the decision table here and
that the script carries the same SIDs, actions and order (and none of the patterns that once
widened access). What only Windows can show is listed in README.md next to this file.

Rules:
- Missing: create it with its final ACL in the one call that creates it, then verify (a folder
  someone created in between is then checked like any existing one).
- A junction or symbolic link, an owner outside SYSTEM, Administrators, TrustedInstaller and the
  installing administrator, or anything below it owned by someone else or a link: refuse, naming
  the owner; nothing is changed, no file of it is used.
- Trusted and exactly final (protected, SYSTEM and Administrators full control, inherited by
  everything below, nothing below with its own ACEs): keep.
- Trusted but looser or different: tighten, narrowing only: first the folder's own ACL becomes
  the final one (protected), then everything below is reset to inherit it. No principal outside
  SYSTEM and Administrators gains access at any step (the old script reset the folder to inherit
  C:\\ProgramData's ACL first, which let every user read secrets\\ until the second call).
"""
from __future__ import annotations

from dataclasses import dataclass

SYSTEM = "S-1-5-18"
ADMINISTRATORS = "S-1-5-32-544"
TRUSTED_INSTALLER = "S-1-5-80-956008885-3418522649-1831038044-1853292631-2271478464"
TRUSTED_OWNERS = frozenset({SYSTEM, ADMINISTRATORS, TRUSTED_INSTALLER})
# (SID, rights, inheritance) of every access rule of the final ACL, as .NET prints them.
FULL = "FullControl"
INHERIT = "ContainerInherit, ObjectInherit"
FINAL_ACES = frozenset({(SYSTEM, FULL, INHERIT), (ADMINISTRATORS, FULL, INHERIT)})
ACTIONS = ("create", "keep", "tighten", "refuse")


@dataclass(frozen=True)
class DataDirState:
    """What install.ps1's ``Get-DataDirState`` reads from C:\\ProgramData\\sefwd."""

    exists: bool
    installer_sid: str  # the elevated administrator running install.ps1
    is_reparse_point: bool = False
    owner_sid: str | None = None
    protected: bool = False  # inheritance from C:\ProgramData is cut
    aces: frozenset[tuple[str, str, str]] = frozenset()  # the folder's own access rules
    untrusted_entries: tuple[str, ...] = ()  # entries below owned by an untrusted SID, or links
    loose_entries: bool = False  # entries below with their own (non-inherited) ACEs or cut inheritance


@dataclass(frozen=True)
class Plan:
    action: str  # one of ACTIONS
    reason: str
    steps: tuple[str, ...] = ()


def trusted_owner(sid: str | None, installer_sid: str) -> bool:
    return sid is not None and (sid in TRUSTED_OWNERS or sid == installer_sid)


def plan(state: DataDirState) -> Plan:
    """The installer's decision for the data folder (see the module docstring)."""
    if not state.exists:
        return Plan("create", "absent", ("create the folder with the final ACL in one call",
                                         "verify owner and ACL (refuse if someone else's folder appeared)"))
    if state.is_reparse_point:
        return Plan("refuse", "is a junction or symbolic link: never followed; remove it and re-run")
    if not trusted_owner(state.owner_sid, state.installer_sid):
        return Plan("refuse", f"is owned by {state.owner_sid or 'nobody'}, not SYSTEM or Administrators: "
                    "someone else made it and its content (config.toml, hooks) cannot be trusted; "
                    "inspect it, remove it and re-run")
    if state.untrusted_entries:
        shown = ", ".join(state.untrusted_entries[:5])
        return Plan("refuse", f"holds entries owned by someone else or links ({shown}): inspect and remove them, then re-run")
    if state.protected and state.aces == FINAL_ACES and not state.loose_entries:
        return Plan("keep", "owned by a trusted owner with the final ACL")
    return Plan("tighten", "trusted owner, looser or different ACL",
                ("set the folder's ACL to the final one (protected): narrows",
                 "reset everything below to inherit it: narrows"))


def widens(before: frozenset[str], after: frozenset[str]) -> bool:
    """Whether a step gives a principal outside SYSTEM and Administrators access it did not have."""
    return bool((after - before) - {SYSTEM, ADMINISTRATORS})
