"""`sudo sefwd once|approve|status` in the service user's state dir: a name planted there by that
user (a symlink, a hard link, a FIFO) never makes root write, truncate or create anything elsewhere,
and files root creates there belong to the directory's owner.

The tests run as root (as the operator guide's `sudo` does); the state dir belongs to uid 65534
(nobody), standing for the service user. The victim is a root-owned copy of a shadow file.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forwarder.agent.cli import IMDS_TURN_LOCK
from forwarder.emulator import Emulator
from forwarder.store.database import DB_FILE
from tests.agent import ROOT, write_config

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root, as `sudo sefwd` has")]

SERVICE_UID = 65534
SHADOW = b"root:$6$saltsalt$hashhashhash:19000:0:99999:7:::\nsefwd:!:19000::::::\n"


def sefwd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "forwarder", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(ROOT))


@pytest.fixture
def setup(tmp_path: Path):
    """(state dir owned by the service user, root's victim file, a root-only dir nothing may appear in)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o750)
    os.chown(state, SERVICE_UID, SERVICE_UID)
    victim = tmp_path / "shadow"
    victim.write_bytes(SHADOW)
    os.chmod(victim, 0o640)
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir(mode=0o755)
    return state, victim, elsewhere


def plant_symlink(state: Path, name: str, target: Path) -> None:
    os.symlink(target, state / name)
    os.lchown(state / name, SERVICE_UID, SERVICE_UID)


@pytest.mark.parametrize("name", [IMDS_TURN_LOCK, DB_FILE, DB_FILE + "-wal", DB_FILE + "-shm"])  # SQLite's own too
@pytest.mark.parametrize("command", ["once", "approve"])
def test_a_symlink_planted_in_the_state_dir_never_makes_root_write_elsewhere(setup, tmp_path, name, command):
    state, victim, elsewhere = setup
    plant_symlink(state, name, victim)
    dangling = "state.db-planted" if name == DB_FILE else "turn-planted"
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        event_id = emu.schedule(type="Freeze", resources=["myVM"], duration=5, start_after=600)
        config = write_config(tmp_path / "c.toml", emu.url, state)
        args = ["once"] if command == "once" else ["approve", event_id]
        res = sefwd(*args, "--config", str(config))
        assert victim.read_bytes() == SHADOW, res.stderr  # neither truncated nor overwritten
        assert os.stat(victim).st_uid == 0 and (os.stat(victim).st_mode & 0o777) == 0o640
        # A dangling link: root must not create the file it names.
        (state / name).unlink(missing_ok=True)  # SQLite may have removed its planted -wal link (the link only)
        plant_symlink(state, name, elsewhere / dangling)
        sefwd(*args, "--config", str(config))
    assert not os.path.lexists(elsewhere / dangling)
    assert os.listdir(elsewhere) == []
    assert victim.read_bytes() == SHADOW


def test_a_hard_link_to_roots_file_is_left_alone(setup, tmp_path):
    state, victim, _ = setup
    os.link(victim, state / IMDS_TURN_LOCK)  # root can; fs.protected_hardlinks stops the service user
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        res = sefwd("once", "--config", str(write_config(tmp_path / "c.toml", emu.url, state)))
    assert res.returncode == 0, res.stderr
    assert victim.read_bytes() == SHADOW


def test_a_fifo_in_the_state_dir_does_not_hang_status_or_once(setup, tmp_path):
    state, _, _ = setup
    for name in ("agent.lock", IMDS_TURN_LOCK):
        os.mkfifo(state / name)
        os.chown(state / name, SERVICE_UID, SERVICE_UID)
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        config = write_config(tmp_path / "c.toml", emu.url, state)
        assert sefwd("status", "--config", str(config), timeout=60).returncode in (0, 1, 4)
        assert sefwd("once", "--config", str(config), timeout=60).returncode == 0


def test_files_root_creates_in_the_state_dir_belong_to_its_owner(setup, tmp_path):
    state, _, _ = setup
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        event_id = emu.schedule(type="Freeze", resources=["myVM"], duration=5, start_after=600)
        config = write_config(tmp_path / "c.toml", emu.url, state)
        res = sefwd("approve", event_id, "--config", str(config))
        assert res.returncode == 0, res.stderr
    made = sorted(p.name for p in state.iterdir())
    assert IMDS_TURN_LOCK in made and DB_FILE in made
    for name in made:
        st = os.lstat(state / name)
        assert st.st_uid == SERVICE_UID, f"{name} is owned by uid {st.st_uid}"


def test_a_turn_file_of_the_service_user_is_rewritten_in_place_not_truncated(setup, tmp_path):
    state, _, _ = setup
    lock = state / IMDS_TURN_LOCK
    lock.write_bytes(b"1.0" + b" " * 100 + b"kept")
    os.chown(lock, SERVICE_UID, SERVICE_UID)
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        res = sefwd("once", "--config", str(write_config(tmp_path / "c.toml", emu.url, state)))
    assert res.returncode == 0, res.stderr
    data = lock.read_bytes()
    assert len(data) == 107 and data.endswith(b"kept")
    assert float(data[:32]) > 1.0
