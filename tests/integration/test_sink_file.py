"""The file sink on a real filesystem: append, rotation, torn-line repair, fsync, logrotate, full disk."""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from forwarder.sinkapi import Ok, Record, Reject, Retry, SinkContext
from sinks.file import FileSink
from tests.conftest import ROOT

RESOURCE_ID = "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/WestNO_0"


def record(seq: int, pad: int = 0) -> Record:
    """A realistic scheduledevent record; ``pad`` lengthens Description to control sizes."""
    event_id = f"C7061BAC-AFDC-4513-B24B-{seq:012X}"
    return Record.from_dict({
        "specversion": "1.0",
        "id": f"6b7c1f0e-0000-5000-8000-{seq:012d}",
        "source": RESOURCE_ID,
        "type": "scheduledevent.scheduled",
        "subject": event_id,
        "time": "2026-11-22T06:41:01.123Z",
        "datacontenttype": "application/json",
        "sequence": str(seq).zfill(20),
        "eventkey": f"{event_id}:scheduled",
        "data": {
            "EventId": event_id, "EventType": "Reboot", "ResourceType": "VirtualMachine",
            "Resources": ["WestNO_0"], "EventStatus": "Scheduled",
            "NotBefore": "2022-04-11T22:26:58.000Z", "NotBeforeRaw": "Mon, 11 Apr 2022 22:26:58 GMT",
            "Description": "Virtual machine is going to be restarted as requested by authorized user." + "x" * pad,
            "EventSource": "User", "DurationInSeconds": -1, "Change": "scheduled", "Initial": False,
            "DocumentIncarnation": seq, "AffectsThisVm": True, "ApiVersion": "2020-07-01",
        },
    })


def ctx(tmp_path: Path) -> SinkContext:
    return SinkContext(name="file", state_dir=tmp_path / "state")


def lines(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n")
    return data.splitlines()


def make(tmp_path: Path, **options) -> FileSink:
    options.setdefault("path", str(tmp_path / "out" / "events.jsonl"))
    return FileSink(options, ctx(tmp_path))


# -- append --------------------------------------------------------------------------------------
def test_appends_bodies_as_lines_across_restarts(tmp_path):
    path = tmp_path / "deep" / "dir" / "events.jsonl"
    sent = [record(i) for i in range(1, 6)]
    sink = FileSink({"path": str(path)}, ctx(tmp_path))
    assert sink.send(sent[:2]) == Ok()
    assert sink.send(sent[2:3]) == Ok()
    sink.close()
    sink = FileSink({"path": str(path)}, ctx(tmp_path))
    assert sink.send(sent[3:]) == Ok()
    sink.close()
    assert lines(path) == [r.body for r in sent]
    assert all(json.loads(line)["specversion"] == "1.0" for line in lines(path))


def test_new_file_is_0640_despite_umask(tmp_path):
    old = os.umask(0o077)
    try:
        sink = make(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(sink.path).st_mode) == 0o640
    sink.close()


def test_record_with_line_break_is_rejected_and_nothing_written(tmp_path):
    sink = make(tmp_path)
    bad = Record(id="bad", type="scheduledevent.scheduled", body=b'{"id":"bad",\n"type":"t"}')
    result = sink.send([record(1), bad])
    assert isinstance(result, Reject) and result.reason == "record_contains_newline" and result.detail == "bad"
    assert sink.path.read_bytes() == b""
    sink.close()


# -- rotation ------------------------------------------------------------------------------------
def test_rotation_keeps_backups_and_drops_the_oldest(tmp_path):
    sent = [record(i) for i in range(10, 24)]  # two-digit numbers: every line the same size
    size = len(sent[0].body) + 1
    assert {len(r.body) + 1 for r in sent} == {size}
    sink = make(tmp_path, max_size=size * 3, backups=2)
    for rec in sent:
        assert sink.send([rec]) == Ok()
    sink.close()
    path = sink.path
    names = sorted(p.name for p in path.parent.iterdir())
    assert names == ["events.jsonl", "events.jsonl.1", "events.jsonl.2"]
    for p in path.parent.iterdir():
        assert p.stat().st_size <= size * 3
    kept = lines(Path(f"{path}.2")) + lines(Path(f"{path}.1")) + lines(path)
    # 14 records in files of 3: the newest file has 2, the two backups 3 each, the rest rotated out.
    assert kept == [r.body for r in sent[-8:]]
    assert len(lines(path)) == 2


def test_batch_larger_than_max_size_gets_a_file_of_its_own(tmp_path):
    sink = make(tmp_path, max_size="1KiB", backups=3)
    small = [record(1)]
    big = [record(i, pad=300) for i in range(2, 8)]
    assert sink.send(small) == Ok()
    assert sink.send(big) == Ok()
    assert sink.send([record(8)]) == Ok()
    sink.close()
    assert lines(Path(f"{sink.path}.2")) == [small[0].body]
    assert lines(Path(f"{sink.path}.1")) == [r.body for r in big]  # never split
    assert lines(sink.path) == [record(8).body]


def test_zero_backups_just_starts_over(tmp_path):
    size = len(record(1).body) + 1
    sink = make(tmp_path, max_size=size * 2, backups=0)
    for i in range(1, 6):
        assert sink.send([record(i)]) == Ok()
    sink.close()
    assert [p.name for p in sink.path.parent.iterdir()] == ["events.jsonl"]
    assert lines(sink.path) == [record(5).body]


# -- torn-line repair ----------------------------------------------------------------------------
def test_torn_last_line_is_truncated_on_open(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    whole = record(1).body + b"\n" + record(2).body + b"\n"
    torn = record(3).body[:57]
    path.write_bytes(whole + torn)
    with caplog.at_level(logging.WARNING, logger="sinks.file"):
        sink = FileSink({"path": str(path)}, ctx(tmp_path))
    assert path.read_bytes() == whole
    assert any(f"{len(torn)} bytes" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert sink.send([record(3)]) == Ok()  # the re-sent record lands on a line of its own
    sink.close()
    assert lines(path) == [record(i).body for i in (1, 2, 3)]


def test_file_with_no_complete_line_is_emptied(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"specversion":"1.0","id":"6b7c')
    FileSink({"path": str(path)}, ctx(tmp_path)).close()
    assert path.read_bytes() == b""


def test_torn_line_longer_than_the_scan_chunk(tmp_path):
    path = tmp_path / "events.jsonl"
    whole = record(1).body + b"\n"
    path.write_bytes(whole + b"y" * 200_000)
    FileSink({"path": str(path)}, ctx(tmp_path)).close()
    assert path.read_bytes() == whole


def test_intact_file_is_left_alone(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    whole = record(1).body + b"\n"
    path.write_bytes(whole)
    with caplog.at_level(logging.WARNING, logger="sinks.file"):
        FileSink({"path": str(path)}, ctx(tmp_path)).close()
    assert path.read_bytes() == whole
    assert not [r for r in caplog.records if r.name == "sinks.file"]


# -- fsync ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("enabled", [True, False])
def test_fsync_option(tmp_path, monkeypatch, enabled):
    sink = make(tmp_path, fsync=enabled)
    synced: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd):
        synced.append(fd)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    for i in range(1, 4):
        assert sink.send([record(i)]) == Ok()
    monkeypatch.undo()
    file_syncs = [fd for fd in synced if fd == sink._fd]
    assert len(file_syncs) == (3 if enabled else 0)
    sink.close()
    assert lines(sink.path) == [record(i).body for i in range(1, 4)]


# -- external rotation ---------------------------------------------------------------------------
def test_reopens_after_logrotate_moves_the_file(tmp_path):
    sink = make(tmp_path)
    assert sink.send([record(1)]) == Ok()
    moved = Path(f"{sink.path}.rotated")
    os.rename(sink.path, moved)
    assert sink.send([record(2)]) == Ok()
    assert lines(moved) == [record(1).body]
    assert lines(sink.path) == [record(2).body]
    assert stat.S_IMODE(os.stat(sink.path).st_mode) == 0o640
    sink.close()


def test_reopens_when_logrotate_creates_the_new_file_itself(tmp_path):
    sink = make(tmp_path)
    assert sink.send([record(1)]) == Ok()
    moved = Path(f"{sink.path}.1.rotated")
    os.rename(sink.path, moved)
    sink.path.write_bytes(b"")  # logrotate's `create` directive: a fresh file under the old name
    assert sink.send([record(2)]) == Ok()
    assert lines(moved) == [record(1).body]
    assert lines(sink.path) == [record(2).body]
    sink.close()


def test_reopens_after_the_file_is_deleted(tmp_path):
    sink = make(tmp_path)
    assert sink.send([record(1)]) == Ok()
    sink.path.unlink()
    assert sink.send([record(2)]) == Ok()
    assert lines(sink.path) == [record(2).body]
    sink.close()


def test_copytruncate_leaves_no_hole(tmp_path):
    sink = make(tmp_path)
    assert sink.send([record(1), record(2)]) == Ok()
    os.truncate(sink.path, 0)
    assert sink.send([record(3)]) == Ok()
    assert sink.path.read_bytes() == record(3).body + b"\n"
    sink.close()


def test_directory_trouble_is_retried_then_recovers(tmp_path):
    sink = make(tmp_path)
    assert sink.send([record(1)]) == Ok()
    directory = sink.path.parent
    shutil.rmtree(directory)
    directory.write_bytes(b"not a directory")
    result = sink.send([record(2)])
    assert isinstance(result, Retry)
    directory.unlink()
    assert sink.send([record(2)]) == Ok()
    assert lines(sink.path) == [record(2).body]
    sink.close()


# -- full disk -----------------------------------------------------------------------------------
def test_full_device_is_retried_as_disk_full(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    sink = FileSink({"path": "/dev/full", "fsync": True, "max_size": 10}, ctx(tmp_path))
    assert sink.send([record(1)]) == Retry(reason="disk_full")
    assert sink.send([record(2)]) == Retry(reason="disk_full")
    sink.close()


def test_file_size_limit_rolls_back_the_partial_batch(tmp_path):
    """RLIMIT_FSIZE makes the kernel write part of a batch, then fail with EFBIG."""
    path = tmp_path / "events.jsonl"
    size = len(record(1).body) + 1
    limit = size * 3 + size // 2
    script = textwrap.dedent(
        f"""
        import json, resource, signal, sys
        from pathlib import Path
        from forwarder.sinkapi import SinkContext
        from sinks.file import FileSink
        from tests.integration.test_sink_file import record
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us instead of EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        sink = FileSink({{"path": {str(path)!r}}}, SinkContext(name="file", state_dir=Path(".")))
        results = [sink.send([record(1), record(2)]), sink.send([record(3), record(4)]), sink.send([record(3)])]
        sink.close()
        print(json.dumps([repr(r) for r in results]))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    first, second, third = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first == "Ok()"
    assert second == "Retry(reason='file_too_large', delay=None)"
    assert third == "Ok()"
    assert lines(path) == [record(i).body for i in (1, 2, 3)]


# -- check ---------------------------------------------------------------------------------------
def test_check_accepts_good_options(tmp_path):
    good = {"path": str(tmp_path / "a" / "b.jsonl"), "max_size": "10MiB", "backups": 0, "fsync": True}
    assert FileSink.check(good) == []
    assert FileSink.check({"path": "events.jsonl"}) == []
    assert not (tmp_path / "a").exists()  # check() changes nothing


def test_check_reports_every_problem(tmp_path):
    problems = FileSink.check({"max_size": "lots", "backups": -1, "fsync": "yes", "colour": 1})
    joined = "\n".join(problems)
    assert len(problems) == 5, problems
    for word in ("'path' is required", "'max_size'", "'backups'", "'fsync'", "unknown option 'colour'"):
        assert word in joined


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"path": ""}, "'path'"),
        ({"path": 7}, "'path'"),
        ({"path": "x", "max_size": 0}, "greater than zero"),
        ({"path": "x", "backups": True}, "'backups'"),
        ({"path": "x", "backups": "5"}, "'backups'"),
        ({"path": "x", "backups": 1001}, "'backups'"),
    ],
)
def test_check_single_problems(options, fragment):
    problems = FileSink.check(options)
    assert len(problems) == 1 and fragment in problems[0], problems


def test_check_refuses_a_directory_path(tmp_path):
    problems = FileSink.check({"path": str(tmp_path)})
    assert problems and "directory" in problems[0]


def test_constructor_refuses_bad_options_and_unusable_paths(tmp_path):
    with pytest.raises(ValueError, match="backups"):
        FileSink({"path": str(tmp_path / "x"), "backups": -3}, ctx(tmp_path))
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")
    with pytest.raises(OSError):
        FileSink({"path": str(blocker / "events.jsonl")}, ctx(tmp_path))


def test_protocol_surface(tmp_path):
    sink = make(tmp_path)
    assert sink.max_batch == 1000
    assert set(FileSink.OPTIONS) == {"path", "max_size", "backups", "fsync"}
    assert sink.send([]) == Ok()
    sink.close()
    sink.close()  # idempotent
