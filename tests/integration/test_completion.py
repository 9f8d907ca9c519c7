"""`sefwd completion bash|zsh`: a script generated from the argparse parser, working in a real bash."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.agent import ROOT


def script(shell: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "forwarder", "completion", shell], capture_output=True, text=True,
                         timeout=60, env=env, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    return res.stdout


def complete_in_bash(path: str, *words: str) -> list[str]:
    """What bash's completion function offers for the last of ``words`` (as after a TAB)."""
    line = " ".join(("sefwd", *words))
    program = f"""
source {path}
complete -p sefwd
func=$(complete -p sefwd | sed -E 's/.* -F ([^ ]+) .*/\\1/')
COMP_WORDS=(sefwd {" ".join(repr(w) for w in words)})
COMP_CWORD={len(words)}
COMP_LINE={line!r}
COMP_POINT={len(line)}
"$func" sefwd {words[-1]!r} {(["sefwd", *words][-2])!r}
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    res = subprocess.run(["bash", "--norc", "--noprofile", "-c", program], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("complete ") and lines[0].endswith(" sefwd")
    return [line.strip() for line in lines[1:] if line.strip()]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_completes_commands_subcommands_and_options(tmp_path):
    path = tmp_path / "sefwd.bash"
    path.write_text(script("bash"))
    assert complete_in_bash(str(path), "dea") == ["deadletter"]
    assert complete_in_bash(str(path), "deadletter", "") == ["list", "replay"]
    assert "--scenario" in complete_in_bash(str(path), "demo", "--sc")
    assert "completion" in complete_in_bash(str(path), "")


def test_zsh_script_is_a_compdef_for_sefwd(tmp_path):
    text = script("zsh")
    assert text.startswith("#compdef sefwd")
    for command in ("demo", "run", "once", "emulator", "approve", "status", "deadletter", "config", "completion"):
        assert command in text
    zsh = shutil.which("zsh")
    if zsh is not None:  # CI machines may lack zsh: then the syntax check is all we skip
        path = tmp_path / "_sefwd"
        path.write_text(text)
        res = subprocess.run([zsh, "-n", str(path)], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
