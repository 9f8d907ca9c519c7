"""A dead webhook receiver is reported in one short line a minute, with a count, not on every retry."""
from __future__ import annotations

import logging

from forwarder.common.logs import RateLimitedLog
from forwarder.sinkapi import Record, Retry, SinkContext
from sinks.webhook import WebhookSink
from tests.agent import closed_port



def test_repeated_connection_errors_are_one_short_line(tmp_path, caplog):
    port = closed_port()
    sink = WebhookSink({"url": f"http://127.0.0.1:{port}/hook?code=secret"},
                       SinkContext(name="x", state_dir=tmp_path))
    record = Record.from_dict({"specversion": "1.0", "id": "r1", "type": "t", "source": "/s", "data": {}})
    try:
        with caplog.at_level(logging.WARNING, logger="sinks.webhook"):
            results = [sink.send([record]) for _ in range(6)]
    finally:
        sink.close()
    assert all(isinstance(r, Retry) and r.reason == "connection_error" for r in results)
    lines = [r.getMessage() for r in caplog.records if "cannot reach" in r.getMessage()]
    assert lines == [f"sink 'x': cannot reach 127.0.0.1:{port} (connection refused); records kept, will retry"]
    assert "secret" not in caplog.text


def test_rate_limited_log_says_how_many_more_in_how_long(caplog):
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("t"), 60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t"):
        for t in range(0, 63, 5):  # 0, 5, ..., 60: the first logged, 12 held back, 60 logged with the count
            now[0] = float(t)
            limited.log(logging.WARNING, "k", "sink %r: cannot reach %s", "x", "h:1")
    assert [r.getMessage() for r in caplog.records] == [
        "sink 'x': cannot reach h:1",
        "sink 'x': cannot reach h:1 (and 11 more like it in the 60 s since the last report)",
    ]
