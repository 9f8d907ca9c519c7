"""The journal on a real filesystem: group commit, cursors, damage recovery, full disk."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import orjson
import pytest

from forwarder.journal import MAGIC, Journal


def bodies(n, start=0):
    return [orjson.dumps({"id": f"r{i}", "type": "t", "n": i}) for i in range(start, start + n)]


def drain(reader, batch=50):
    out = []
    while True:
        got = reader.read(batch)
        if not got:
            return out
        out += got


def ids(entries):
    return [orjson.loads(e.body)["n"] for e in entries]


def test_append_read_commit_reopen(tmp_path):
    j = Journal(tmp_path, segment_size=512)
    assert j.append(bodies(30)) == 0
    for start in range(30, 60, 10):
        assert j.append(bodies(10, start)) == start
    assert len(j.segments()) > 2
    r = j.reader("s")
    assert ids(drain(r, 7)) == list(range(60))
    r.commit(40)
    r.flush()
    j.close()
    j = Journal(tmp_path, segment_size=512)
    assert j.next_index == 60
    assert ids(drain(j.reader("s"))) == list(range(40, 60))


def test_each_sink_has_its_own_cursor_and_segments_are_collected(tmp_path):
    j = Journal(tmp_path, segment_size=1024)
    for start in range(0, 100, 10):
        j.append(bodies(10, start))
    fast, slow = j.reader("fast"), j.reader("slow")
    fast.commit(len(drain(fast)))
    j.collect()
    assert j.oldest_index == 0  # slow still needs everything
    slow.commit(50)
    j.collect()
    assert 0 < j.oldest_index <= 50
    slow.rewind()
    assert ids(drain(slow))[0] == 50


def test_newest_segment_survives_full_drain_so_indexes_never_go_back(tmp_path):
    j = Journal(tmp_path, segment_size=512)
    j.append(bodies(40))
    r = j.reader("s")
    r.commit(len(drain(r)))
    r.flush()
    j.collect()
    j.close()
    j = Journal(tmp_path, segment_size=512)
    assert j.next_index == 40
    j.append(bodies(1, 40))
    assert ids(drain(j.reader("s"))) == [40]


def _segment_files(path):
    return sorted(path.glob("seg-*.log"))


def test_torn_tail_is_truncated(tmp_path):
    j = Journal(tmp_path)
    j.append(bodies(10))
    j.close()
    seg = _segment_files(tmp_path)[-1]
    size = seg.stat().st_size
    with open(seg, "ab") as fh:
        fh.write(b"\x40\x00\x00\x00garbage-half-frame")
    j = Journal(tmp_path)
    assert j.stats.torn_bytes_truncated == len(b"\x40\x00\x00\x00garbage-half-frame")
    assert seg.stat().st_size == size and j.next_index == 10
    j.append(bodies(1, 10))
    assert ids(drain(j.reader("s"))) == list(range(11))


def test_flipped_bytes_skip_exactly_the_damaged_record(tmp_path):
    j = Journal(tmp_path)
    j.append(bodies(20))
    j.close()
    seg = _segment_files(tmp_path)[-1]
    data = bytearray(seg.read_bytes())
    frame = len(MAGIC) + (len(data) - len(MAGIC)) // 20 * 5 + 30  # inside record 5's payload
    data[frame] ^= 0xFF
    seg.write_bytes(bytes(data))
    j = Journal(tmp_path)
    got = ids(drain(j.reader("s")))
    assert 5 not in got and len(got) == 19
    assert j.stats.corrupt_skipped == {"s": 1}


def test_truncated_middle_segment_and_zero_length_segment(tmp_path):
    j = Journal(tmp_path, segment_size=300)
    j.append(bodies(10))
    j.append(bodies(10, 10))
    j.append(bodies(10, 20))
    j.close()
    segs = _segment_files(tmp_path)
    assert len(segs) >= 3
    middle = segs[1]
    middle.write_bytes(middle.read_bytes()[: middle.stat().st_size // 2])
    (tmp_path / "seg-99999999999999999999.log").write_bytes(b"")
    j = Journal(tmp_path, segment_size=300)
    got = ids(drain(j.reader("s")))
    assert got[:10] == list(range(10)) and got[-10:] == list(range(20, 30))
    assert j.stats.corrupt_skipped["s"] == 30 - len(got) > 0
    assert not (tmp_path / "seg-99999999999999999999.log").exists()


@pytest.mark.parametrize("damage", ["delete", b"{not json", b'{"next": 999999}', b'{"next": "x"}'])
def test_missing_or_damaged_cursor_restarts_from_oldest(tmp_path, damage):
    j = Journal(tmp_path)
    j.append(bodies(10))
    r = j.reader("s")
    r.commit(len(drain(r)))
    r.flush()
    j.close()
    cursor = tmp_path / "cursors" / "s.cursor"
    if damage == "delete":
        cursor.unlink()
    else:
        cursor.write_bytes(damage)
    j = Journal(tmp_path)
    assert ids(drain(j.reader("s"))) == list(range(10))  # duplicates, never loss
    assert j.stats.cursor_resets["s"] == 1


def test_size_cap_drops_oldest_and_counts_per_sink(tmp_path):
    j = Journal(tmp_path, segment_size=1000, max_size=3000)
    r = j.reader("slow")
    for i in range(20):
        j.append(bodies(5, i * 5))
    assert j.size_bytes() <= 3000 + 1000
    dropped = j.stats.dropped_full["slow"]
    got = ids(drain(r))
    assert dropped > 0 and len(got) + dropped == 100
    assert got[-1] == 99


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path
    from forwarder.journal import Journal, JournalError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    j = Journal(Path(sys.argv[1]), segment_size=1 << 30)
    j.append([b'{"id":"a","type":"t"}'] * 10)
    size = sum(p.stat().st_size for p in Path(sys.argv[1]).glob("seg-*.log"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 100, size + 100))
    try:
        j.append([b'{"id":"b","type":"t","pad":"' + b"x" * 400 + b'"}'] * 5)
    except JournalError as exc:
        print("refused:", exc)
    else:
        print("accepted")
    print("next", j.next_index)
    """
)


def test_full_disk_refuses_loudly_and_leaves_no_torn_batch(tmp_path):
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "refused:" in out.stdout and "file too large" in out.stdout, out.stdout + out.stderr
    assert "next 10" in out.stdout
    j = Journal(tmp_path)
    assert j.next_index == 10 and j.stats.torn_bytes_truncated == 0
    j.append(bodies(1))  # space is back: appends work again
    assert j.next_index == 11
