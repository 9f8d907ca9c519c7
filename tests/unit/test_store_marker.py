"""The store marker in ``agent.lock`` is a state-dir file anyone with the dir may have written:
its worst contents read as "no marker" (never an exception, never a wrong store), and the marker
is rewritten only when the sequence it holds moved."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from forwarder.store.marker import LOCK_FILE, MAX_MARKER, Marker, MarkerData, parse_marker, read_marker


@pytest.mark.parametrize("raw", [
    b"", b"12345\n", b"\xff\xfe\x00garbage", b"[1, 2]", b'"store"', b"null",
    b'{"pid": 7}',  # an old lock file: a pid only
    b'{"store": "", "sequence": 5}', b'{"store": 5, "sequence": 5}', b'{"store": "a"}',
    b'{"store": "a", "sequence": true}', b'{"store": "a", "sequence": 1.5}', b'{"store": "a", "sequence": "5"}',
    b'{"store": "a", "sequence": 1' + b"0" * 40 + b"}",  # beyond 64 bits
    b'{"store": "' + b"a" * MAX_MARKER + b'", "sequence": 5}',  # longer than a marker is read
])
def test_worst_marker_contents_read_as_no_marker(raw: bytes) -> None:
    assert parse_marker(raw) is None


def test_a_good_marker_and_a_missing_or_unreadable_file(tmp_path: Path) -> None:
    assert parse_marker(b'{"pid": 1, "store": "abc", "sequence": 42}') == MarkerData("abc", 42)
    assert read_marker(tmp_path) is None
    (tmp_path / LOCK_FILE).mkdir()
    assert read_marker(tmp_path) is None


def test_the_marker_is_rewritten_only_when_the_sequence_moved(tmp_path: Path) -> None:
    marker = Marker(tmp_path, "abc")
    path = tmp_path / LOCK_FILE
    try:
        marker.write(7)
        assert read_marker(tmp_path) == MarkerData("abc", 7)
        path.write_bytes(b"someone else's bytes")
        marker.write(7)  # unchanged: not written again
        assert path.read_bytes() == b"someone else's bytes"
        marker.write(8)
        assert read_marker(tmp_path) == MarkerData("abc", 8)
        assert os.stat(path).st_size == len(path.read_bytes())
    finally:
        marker.close()
