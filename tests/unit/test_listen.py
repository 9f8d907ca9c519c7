"""The one listen-address parser of the callback, the telemetry endpoint and the emulator.

(The callback's accepted forms moved here from test_approval_config.py.)
"""
from __future__ import annotations

from typing import Any

import pytest

from forwarder.common.listen import host_port_text, parse_listen


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:8787", ("127.0.0.1", 8787)),
    ("0.0.0.0:0", ("0.0.0.0", 0)),
    ("0.0.0.0:443", ("0.0.0.0", 443)),
    (" 10.0.0.4:80 ", ("10.0.0.4", 80)),
    ("10.0.0.4:65535", ("10.0.0.4", 65535)),
    ("[::1]:8787", ("::1", 8787)),
    ("[::]:1", ("::", 1)),
    ("[fe80::1]:80", ("fe80::1", 80)),
    ("localhost:8787", ("localhost", 8787)),
    ("vm-0.internal.cloudapp.net:65535", ("vm-0.internal.cloudapp.net", 65535)),
    ("host_1.example.:80", ("host_1.example.", 80)),
])
def test_accepted_forms(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize("value, fragment", [
    ("127.0.0.1:65536", "0-65535"),
    ("127.0.0.1:99999", "0-65535"),
    ("127.0.0.1:-1", "port must be a number"),
    ("127.0.0.1:x", "port must be a number"),
    ("127.0.0.1:", "port must be a number"),
    ("127.0.0.1:８０", "port must be a number"),  # non-ASCII digits are not a port
    ("127.0.0.1:8 0", "port must be a number"),
    ("127.0.0.1", "missing the port"),
    ("localhost", "missing the port"),
    (":9464", "host must be explicit"),
    ("::1:8787", "in brackets"),
    ("[127.0.0.1]:80", "not an IPv6 address"),
    ("[::1]8787", "[ipv6]:port"),
    ("[::1", "[ipv6]:port"),
    ("bad host:80", "not an IP address or host name"),
    ("-leading.example:80", "not an IP address or host name"),
    ("h\r\nx:80", "not an IP address or host name"),
    ("", "host:port"),
    ("   ", "host:port"),
    (8787, "host:port"),  # a bare port only where the caller names the host it means
    (True, "host:port"),
    (None, "host:port"),
    (["127.0.0.1:80"], "host:port"),
])
def test_refused_with_a_reason(value: Any, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_listen(value)
    assert fragment in str(info.value)
    assert not any(c in str(info.value) for c in "\r\n")


@pytest.mark.parametrize("value, expected", [
    (9464, ("127.0.0.1", 9464)),
    ("9464", ("127.0.0.1", 9464)),
    (" 0 ", ("127.0.0.1", 0)),
    ("0.0.0.0:9464", ("0.0.0.0", 9464)),
    ("[::1]:9464", ("::1", 9464)),
])
def test_bare_port_listens_on_the_named_host(value: Any, expected: tuple[str, int]) -> None:
    assert parse_listen(value, bare_port_host="127.0.0.1") == expected


def test_bare_port_on_an_ipv6_host() -> None:
    assert parse_listen("80", bare_port_host="::1") == ("::1", 80)


@pytest.mark.parametrize("value", [True, 70000, "70000", ":80"])
def test_bare_port_rules_still_apply(value: Any) -> None:
    with pytest.raises(ValueError):
        parse_listen(value, bare_port_host="127.0.0.1")


@pytest.mark.parametrize("host, port, text", [
    ("127.0.0.1", 80, "127.0.0.1:80"), ("::1", 80, "[::1]:80"), ("[::1]", 80, "[::1]:80"), ("localhost", 0, "localhost:0"),
])
def test_host_port_text(host: str, port: int, text: str) -> None:
    assert host_port_text(host, port) == text
    assert parse_listen(text) == (host.strip("[]"), port)
