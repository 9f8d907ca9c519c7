"""Azurite (the Azure Storage emulator) for the tests of the fleet side's shared table state.

``from tests.azurite import PYTESTMARK, azurite, table_name`` in a test module: ``pytestmark = PYTESTMARK``
skips its tests when Azurite is not installed (and fails the suite then when SEFWD_REQUIRE_PEERS is set:
CI), ``azurite`` is a module-wide Azurite on a free loopback port, ``table_name()`` a fresh table per test.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from benchmarks.peers.azurite_peer import AzuritePeer

UNAVAILABLE = AzuritePeer.available()
if UNAVAILABLE is not None and os.environ.get("SEFWD_REQUIRE_PEERS"):  # CI: a missing peer is a failure
    raise RuntimeError(f"Azurite is required here (SEFWD_REQUIRE_PEERS) but {UNAVAILABLE}")
PYTESTMARK = [pytest.mark.timeout(240),
              pytest.mark.skipif(UNAVAILABLE is not None, reason=f"azurite unavailable: {UNAVAILABLE}")]


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuritePeer]:
    """Azurite's table service on a free loopback port; each test uses its own table."""
    with AzuritePeer(log=tmp_path_factory.mktemp("azurite") / "azurite.log") as peer:
        yield peer


def table_name() -> str:
    return "t" + uuid.uuid4().hex[:20]
