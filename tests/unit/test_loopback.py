"""One loopback rule for every server: addresses, never string prefixes."""
from __future__ import annotations

import pytest

from forwarder.common.loopback import is_loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost"])
def test_loopback(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.4", "169.254.169.254",
                                  "localhost.example.com", "127.example.invalid", "::1.example.invalid", ""])
def test_not_loopback(host: str) -> None:
    # The emulator used to accept "localhost.example.com" by its prefix and skip --allow-remote.
    assert not is_loopback(host)
