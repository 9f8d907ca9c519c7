"""What can fail at start, checked before the agent says "started": every listening port, TLS file and
file the agent keeps rewriting (the probe's state file, the extension heartbeat), at once.

A busy port used to surface after the ``forwarder.started`` record, as an "invalid configuration". The
agent now tries each configured address first (bind, then close at once) and stops with every
problem named for what it is: a port in use is not a config error (exit 1, ``StartError``).
"""
from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from forwarder.common.http_server import address_family
from forwarder.common.listen import host_port_text
from forwarder.errors import StartError

if TYPE_CHECKING:
    from forwarder.agent.config import Config


def listen_problem(exc: OSError, port: int) -> str:
    """What a failed bind means, for a person."""
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} is in use (another process listens there; `ss -ltnp 'sport = :{port}'` shows "
                "which): stop it or choose another port")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE): {exc.strerror}"
                if port < 1024 else f"permission denied: {exc.strerror}")
    if exc.errno == errno.EADDRNOTAVAIL:
        return "this host has no such address"
    return exc.strerror or str(exc) or type(exc).__name__


def listeners(config: Config) -> list[tuple[str, str, int]]:
    """(what, host, port) of every address the agent will listen on; port 0 (any free port) never fails."""
    found = []
    if config.probe.listen is not None:
        found.append(("probe.listen", *config.probe.listen))
    if config.telemetry.listen is not None:
        found.append(("telemetry.listen", *config.telemetry.listen))
    callback = config.approval.callback
    if callback is not None:
        found.append(("approval.callback", callback.host, callback.port))
    return [(what, host, port) for what, host, port in found if port]


def try_listen(host: str, port: int) -> OSError | None:
    """Bind ``(host, port)`` as the servers do (SO_REUSEADDR) and let go at once; the error, if any."""
    host = host.strip("[]")
    try:
        sock = socket.socket(address_family(host), socket.SOCK_STREAM)
    except OSError as exc:
        return exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1)  # a port bound but not listening elsewhere still binds: listen is what collides
    except OSError as exc:
        return exc
    finally:
        sock.close()
    return None


def replace_problem(path: Path, *, makes_dirs: bool) -> str | None:
    """Why the agent could not replace ``path`` (temp file beside it, then rename), or None; writes nothing.

    ``makes_dirs``: the writer creates missing directories (the state file), so the nearest existing
    one must be writable; otherwise (the heartbeat) the file's own directory must exist.
    """
    if os.path.isdir(path):
        return "it is a directory"
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        if os.path.exists(directory):
            return f"{directory} is not a directory"
        if not makes_dirs:
            return f"directory {directory} does not exist"
        while not os.path.exists(directory):
            directory = os.path.dirname(directory)
        if not os.path.isdir(directory):
            return f"{directory} is not a directory"
    # Rename needs write and search permission on the directory, not on the file (a read-only
    # file system says no here too, even to root).
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"directory {directory} is not writable"
    return None


def rewritten_files(config: Config) -> list[tuple[str, Path, bool]]:
    """(what, path, makes_dirs) of every file the agent keeps replacing while it runs."""
    found = []
    if config.probe.enabled:
        from forwarder.agent.maintenance import default_state_file

        found.append(("probe.state_file", config.probe.state_file or default_state_file(config.state.dir), True))
    if config.agent.heartbeat_file is not None:
        found.append(("agent.heartbeat_file", config.agent.heartbeat_file, False))
    return found


def check_start(config: Config) -> None:
    """Raise StartError naming every address the agent cannot listen on, TLS file it cannot load and
    file it could not keep writing."""
    problems = []
    for what, host, port in listeners(config):
        exc = try_listen(host, port)
        if exc is not None:
            problems.append(f"{what} {host_port_text(host, port)}: cannot listen: {listen_problem(exc, port)}")
    callback = config.approval.callback
    if callback is not None and callback.tls_cert is not None and callback.tls_key is not None:
        from forwarder.common.listen import tls_server_context

        try:
            tls_server_context(callback.tls_cert, callback.tls_key)
        except OSError as exc:  # ssl.SSLError included; never the files' content
            problems.append(f"approval.callback tls_cert {callback.tls_cert} / tls_key {callback.tls_key}: "
                            f"cannot load: {exc.strerror or type(exc).__name__}")
    for what, path, makes_dirs in rewritten_files(config):
        why = replace_problem(path, makes_dirs=makes_dirs)
        if why is not None:
            problems.append(f"{what} {path}: cannot write: {why}")
    if problems:
        raise StartError(problems)
