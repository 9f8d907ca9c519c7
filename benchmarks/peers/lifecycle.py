"""What every loopback HTTP peer shares: ``with`` support and the bound port."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typing.Self is 3.11+; annotations are never evaluated at run time
    from typing_extensions import Self


class ServerPeer:
    """Base of the HTTP test peers: subclasses set ``_server`` in ``start()`` and clear it in ``stop()``."""

    _server: Any = None

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "peer not started"
        return int(self._server.server_address[1])
