"""Whether a listen address keeps a server private to this machine (one rule for every server)."""
from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """True when ``host`` is a loopback address, or a name whose every address is loopback.

    Decided on addresses, never on text: ``localhost.example.com`` or ``127.example.net`` are
    whatever DNS says they are. A name that does not resolve is not loopback.
    """
    text = host.strip().strip("[]")
    try:
        return ipaddress.ip_address(text.split("%", 1)[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(text, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(str(a).split("%", 1)[0]).is_loopback for a in addresses)
