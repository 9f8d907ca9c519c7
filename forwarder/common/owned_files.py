"""Open a file in a directory another user may write (the agent's state dir, seen from ``sudo sefwd``).

The state dir belongs to the service user. A one-shot command run as root (``sefwd once``,
``approve``, ``status``, ``deadletter``) must not let that user point it elsewhere: a symlink or a
hard link planted in the dir, a FIFO that blocks an open, a file of a third user. ``open_owned``
never follows a link in the last component (``O_NOFOLLOW``), never blocks on a FIFO or a device,
accepts only a regular file with one link owned by the directory's owner or by the caller, and
creates a missing file exclusively (``O_EXCL``), handing it to the directory's owner when the caller
is root, so root leaves no root-owned file in the service user's directory.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sqlite3

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UnsafeFileError(OSError):
    """The name in the directory is not a file the caller may trust (a link, a FIFO, someone else's)."""


def _euid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1


def check_owned(fd: int, directory: os.stat_result, path: Path) -> os.stat_result:
    """The fd's stat when it is a regular file with one link owned by the directory's owner or by us."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(errno.EPERM, "not a regular file; left alone", str(path))
    if st.st_nlink != 1:
        raise UnsafeFileError(errno.EPERM, f"has {st.st_nlink} hard links (one may be planted); left alone", str(path))
    if hasattr(os, "geteuid") and st.st_uid not in (directory.st_uid, _euid()):
        raise UnsafeFileError(errno.EPERM, f"owned by uid {st.st_uid}, neither the directory's owner "
                              f"(uid {directory.st_uid}) nor this user; left alone", str(path))
    return st


def open_owned(directory: Path, name: str, *, write: bool, create: bool = False, mode: int = 0o640) -> tuple[int, bool]:
    """``(fd, created)`` for ``directory/name``, or an OSError (``UnsafeFileError`` for a planted name).

    ``write`` opens read-write, else read-only; ``create`` creates a missing file (exclusively, with
    ``mode``). The caller closes the fd. The file is never truncated here: a caller that wants to
    rewrite it truncates only what it ``created`` or what its own user owns.
    """
    path = Path(directory) / name
    dfd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    try:
        dir_st = os.fstat(dfd)
        access = os.O_RDWR if write else os.O_RDONLY
        flags = access | _NOFOLLOW | _NONBLOCK | _CLOEXEC
        created = False
        try:
            fd = os.open(name, flags, dir_fd=dfd)
        except FileNotFoundError:
            if not create:
                raise
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, mode, dir_fd=dfd)  # a racing link: EEXIST
            created = True
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
                raise UnsafeFileError(errno.ELOOP, "is a symbolic link; not followed", str(path)) from None
            raise
        try:
            check_owned(fd, dir_st, path)
            if created and _euid() == 0 and dir_st.st_uid != 0:
                os.fchown(fd, dir_st.st_uid, dir_st.st_gid)  # root's new file belongs to the dir's owner
        except BaseException:
            os.close(fd)
            raise
        return fd, created
    finally:
        os.close(dfd)


def owned_by_me(fd: int) -> bool:
    """Whether this process's user owns the open file (so it may truncate it)."""
    return not hasattr(os, "geteuid") or os.fstat(fd).st_uid == _euid()


def checked_sqlite(path: Path, timeout: float) -> sqlite3.Connection:
    """A SQLite connection (autocommit, any thread) to ``path`` checked as ``open_owned`` checks files.

    The file is opened (created when missing) here first; SQLite then opens it by name without the
    right to create (a link swapped in meanwhile creates nothing anywhere), and a connection SQLite
    resolved to another file (that link) is closed before it read or wrote a page, with an
    ``UnsafeFileError``.
    """
    import sqlite3

    try:
        fd, created = open_owned(path.parent, path.name, write=True, create=True)
        mode = "rw"
    except PermissionError:  # a reader of a dir it may not write (`sefwd status` by a group member)
        fd, created = open_owned(path.parent, path.name, write=False)
        mode = "ro"
    try:
        if created:
            os.fchmod(fd, 0o640)  # records and approvals are nobody else's business
        expected = os.path.join(os.path.realpath(path.parent), path.name)
        conn = sqlite3.connect(f"{Path(expected).as_uri()}?mode={mode}", uri=True, timeout=timeout,
                               isolation_level=None, check_same_thread=False)
        # SQLite resolves links before it opens (with O_NOFOLLOW): the name it resolved is the file it has.
        opened = [row[2] for row in conn.execute("PRAGMA database_list") if row[1] == "main"]
        if opened != [expected]:
            conn.close()
            raise UnsafeFileError(errno.EPERM, f"was replaced while being opened (by a link to {opened}); "
                                  "left alone", str(path))
        return conn
    finally:
        os.close(fd)
