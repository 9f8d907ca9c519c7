"""C:\\ProgramData\\sefwd on Windows: the installer's decisions (deploy/windows/acl_plan.py), and
install.ps1 kept in step with them — same SIDs, same actions, the folder made or checked before
anything is written in it, and none of the patterns that widened access. There is no Windows
here: what only Windows can show is listed in deploy/windows/README.md.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WINDOWS = ROOT / "deploy" / "windows"
INSTALL = WINDOWS / "install.ps1"


def _load():
    spec = importlib.util.spec_from_file_location("sefwd_windows_acl_plan", WINDOWS / "acl_plan.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


acl = _load()
ADMIN_USER = "S-1-5-21-1-2-3-500"
ATTACKER = "S-1-5-21-1-2-3-1001"
USERS = "S-1-5-32-545"


def state(**kw):
    base = {"exists": True, "installer_sid": ADMIN_USER, "owner_sid": acl.ADMINISTRATORS, "protected": True,
            "aces": acl.FINAL_ACES}
    base.update(kw)
    return acl.DataDirState(**base)


@pytest.mark.parametrize("given, action", [
    (acl.DataDirState(exists=False, installer_sid=ADMIN_USER), "create"),
    (state(), "keep"),
    (state(owner_sid=acl.SYSTEM), "keep"),
    (state(owner_sid=acl.TRUSTED_INSTALLER), "keep"),
    (state(owner_sid=ADMIN_USER), "keep"),  # made by the administrator running the installer
    (state(owner_sid=ATTACKER), "refuse"),  # any user may create folders in C:\ProgramData
    (state(owner_sid=ATTACKER, protected=False, aces=frozenset()), "refuse"),
    (state(owner_sid=None), "refuse"),
    (state(is_reparse_point=True), "refuse"),  # a junction to somewhere else
    (state(untrusted_entries=(r"C:\ProgramData\sefwd\config.toml",)), "refuse"),  # planted during an old window
    (state(protected=False), "tighten"),  # still inherits C:\ProgramData's ACL (Users may read)
    (state(aces=acl.FINAL_ACES | {(USERS, "ReadAndExecute", acl.INHERIT)}), "tighten"),
    (state(aces=frozenset({(acl.SYSTEM, acl.FULL, acl.INHERIT)})), "tighten"),
    (state(loose_entries=True), "tighten"),  # e.g. secrets\ with its own ACEs
])
def test_the_decision_table(given, action):
    decided = acl.plan(given)
    assert decided.action == action and decided.action in acl.ACTIONS
    if action == "refuse":
        assert "remove" in decided.reason  # says what to do


def test_a_refusal_names_the_owner():
    assert ATTACKER in acl.plan(state(owner_sid=ATTACKER)).reason


def _principals_over_the_steps(old_script: bool) -> list[tuple[frozenset[str], frozenset[str]]]:
    """(folder, secrets\\) principals after each ACL step of a re-run on a folder that still inherits
    C:\\ProgramData's ACL and whose secrets\\ was already locked down by hand."""
    program_data = frozenset({acl.SYSTEM, acl.ADMINISTRATORS, USERS, "S-1-3-0"})
    final = frozenset({acl.SYSTEM, acl.ADMINISTRATORS})
    folder, secrets = program_data, frozenset({acl.SYSTEM})
    steps = [(folder, secrets)]
    if old_script:  # icacls DataDir /reset /T, then icacls DataDir /inheritance:r /grant:r ...
        steps.append((program_data, program_data))
        steps.append((final, final))
    else:  # Set-Acl DataDir (final, protected), then icacls DataDir\* /reset /T
        steps.append((final, secrets))
        steps.append((final, final))
    return steps


@pytest.mark.parametrize("old_script, widened", [(True, True), (False, False)])
def test_tightening_never_widens_even_between_two_steps(old_script, widened):
    steps = _principals_over_the_steps(old_script)
    got = any(acl.widens(a[i], b[i]) for a, b in zip(steps, steps[1:]) for i in (0, 1))
    assert got is widened


# -- install.ps1 follows the table ------------------------------------------------------------------

def _code(text: str) -> str:
    """The script without comments and here-strings (the embedded config mentions paths freely)."""
    text = re.sub(r"@'\n.*?\n'@", "", text, flags=re.S)
    text = re.sub(r"<#.*?#>", "", text, flags=re.S)
    return "\n".join(line.split("#", 1)[0] if not line.lstrip().startswith("#") else "" for line in text.splitlines())


def dangerous_patterns(script: str) -> list[str]:
    """What once let every user read or plant files in C:\\ProgramData\\sefwd."""
    code = _code(script)
    found = []
    if re.search(r"icacls(\.exe)?\s+@\(\s*\$DataDir\s*,\s*'/reset'", code):
        found.append("icacls /reset on the folder itself (it then inherits C:\\ProgramData's ACL)")
    if re.search(r"New-Item[^\n]*-Path[^\n]*\$DataDir\b(?!\\)", code):
        found.append("New-Item creates the folder with C:\\ProgramData's ACL")
    if re.search(r"/inheritance:e|\*S-1-1-0|\*S-1-5-11|\*S-1-5-32-545|Everyone|Authenticated Users|BUILTIN\\Users", code):
        found.append("grants or re-enables access beyond SYSTEM and Administrators")
    main = _code(script[script.index("# -- main"):]) if "# -- main" in script else code
    first_use = min((m.start() for m in re.finditer(r"\$(SecretsDir|StateDir|LogDir|ConfigPath)\b", main)), default=-1)
    init = main.find("Initialize-DataDir")
    if init < 0 or (first_use >= 0 and first_use < init):
        found.append("something in the folder is created or read before Initialize-DataDir checked it")
    return found


def test_install_ps1_has_none_of_the_dangerous_patterns():
    assert dangerous_patterns(INSTALL.read_text()) == []


def test_the_patterns_catch_the_script_as_it_was():
    old = subprocess.run(["git", "show", "a35d237:deploy/windows/install.ps1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)
    if old.returncode != 0:
        pytest.skip("the history is not available here")
    found = dangerous_patterns(old.stdout)
    assert len(found) >= 3, found  # /reset first, New-Item of the folder, config written before the ACL


def test_install_ps1_carries_the_same_sids_and_actions():
    script = INSTALL.read_text()
    trusted = re.search(r"^\$TrustedOwners = @\(([^)]*)\)", script, re.M)
    final = re.search(r"^\$FinalSids = @\(([^)]*)\)", script, re.M)
    assert trusted and final
    assert set(re.findall(r"'([^']+)'", trusted.group(1))) == set(acl.TRUSTED_OWNERS)
    assert set(re.findall(r"'([^']+)'", final.group(1))) == {sid for sid, _, _ in acl.FINAL_ACES}
    assert f"$FinalInheritance = '{acl.INHERIT}'" in script and "'FullControl'" in script
    body = script[script.index("function Get-DataDirPlan"):script.index("function Initialize-DataDir")]
    assert [a for a in re.findall(r"Action = '(\w+)'", body)] == ["create", "refuse", "refuse", "refuse", "keep", "tighten"]
    init = script[script.index("function Initialize-DataDir"):]
    for action in acl.ACTIONS:
        assert f"'{action}' {{" in init, action
    # Created in one step with its ACL, on both PowerShell editions, and checked again right after.
    assert "[System.IO.Directory]::CreateDirectory($DataDir, (New-FinalDirectorySecurity))" in init
    assert "[System.IO.FileSystemAclExtensions]::Create(" in init
    assert "$after = Get-DataDirPlan (Get-DataDirState)" in init
    # Tightening: the folder's own ACL first, then what is below it.
    assert init.index("Set-Acl -LiteralPath $DataDir") < init.index("(Join-Path $DataDir '*'), '/reset'")
