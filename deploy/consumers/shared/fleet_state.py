"""State that every instance of a fleet-side consumer shares: claims (acted on at most once, with an
owner and a lease) and folds (the strongest value reported per key), in one Azure Storage table.

Reusable by any consumer in deploy/consumers (standard library + ``azure-data-tables``; the remote
approver uses it for its replay claims, de-duplication keys and outcome folds). The API::

    state = TableState.open(connection_string=..., table="sefwdstate")           # Azurite, account keys
    state = TableState.open(endpoint="https://acct.table.core.windows.net",        # the app's managed identity
                            credential=DefaultAzureCredential(), table="sefwdstate")
    claims = state.claims("seen", lease=600.0, retention=7800.0)  # a namespace of claims
    claims.claim(key)    # True: this instance now owns ``key`` (pending); False: settled, or pending
                         #   under a live lease (another owner's, or ours: a copy already in flight). A
                         #   pending claim whose lease ran out (whoever's), or a settled one older than
                         #   ``retention``, is taken over (conditional on its ETag).
    claims.settle(key)   # acted on for good (kept ``retention`` seconds)
    claims.release(key)  # forget it (a transient failure: the next copy tries again); only if still ours
    claims.status(key)   # "pending", "settled" or None (never claimed, released, or settled too long ago)
    folds = state.folds("outcome")
    folds.fold(key, value, rank)  # -> (strongest value, changed?): keeps the value of highest rank
    state.purge()        # delete the rows whose Expires passed (a timer calls it; conditional on each ETag)
    state.close()

Keys are any strings (resource IDs with "/" included): the row key is a SHA-256 of ``namespace\\nkey``,
the partition its first two hex digits (256 partitions spread the load), and the original key is kept
in the ``Key`` column. Every write is conditional: an insert fails on an existing row (409), an update
or delete carries the ETag it read (412 when another instance got there first), so any number of
instances decide each key once. ``Claims`` and ``Folds`` are Protocols: the remote approver's SQLite
cache and in-memory de-duplicator satisfy them for one instance, and a test can use either.

Rows: PartitionKey, RowKey, Namespace, Key, State ("pending"|"settled"), Owner, At (epoch seconds of the
claim or settle), LeaseUntil (epoch seconds), Expires (epoch seconds: when the row means nothing any more,
``retention`` after a settle or a fold, ``retention`` after the lease of a pending claim), and for folds
Value, Rank. Table Storage has no expiry of its own (storage lifecycle policies cover blobs only), so
``TableState.purge`` deletes the rows whose ``Expires`` passed, each conditional on the ETag it was listed
with (a row claimed again meanwhile stays); the consumers call it from a timer. Rows written before
``Expires`` existed are purged once their ``At`` is ``LEGACY_AGE`` old.
"""
from __future__ import annotations

import hashlib
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

PENDING = "pending"
SETTLED = "settled"
DEFAULT_TABLE = "sefwdstate"
LEGACY_AGE = 30 * 86400.0  # a row without Expires (an older version wrote it) is purged this long after its At


class Claims(Protocol):
    """Keys acted on at most once by all instances together."""

    def claim(self, key: str) -> bool:
        """Take ``key`` for this instance: True when it was free, expired, or its owner's lease ran out."""
        ...

    def settle(self, key: str) -> None:
        """``key`` was acted on for good."""
        ...

    def release(self, key: str) -> None:
        """Give ``key`` back after a transient failure, so the next copy of the record tries again."""
        ...


class Folds(Protocol):
    """The strongest value reported per key, across instances."""

    def fold(self, key: str, value: str, rank: int) -> tuple[str, bool]:
        """(the strongest value for ``key`` now, whether this call changed it)."""
        ...


def instance_owner() -> str:
    """Who holds a claim: host, pid and a random part (a restarted process is a new owner)."""
    return f"{socket.gethostname()}|{os.getpid()}|{uuid.uuid4().hex[:8]}"


def _address(namespace: str, key: str) -> tuple[str, str]:
    digest = hashlib.sha256(f"{namespace}\n{key}".encode()).hexdigest()
    return digest[:2], digest


class TableClaims:
    """``Claims`` in an Azure Storage table (see the module docstring)."""

    def __init__(self, table: Any, namespace: str, *, lease: float, retention: float, owner: str,
                 clock: Callable[[], float] = time.time) -> None:
        self._table = table
        self.namespace = namespace
        self.lease = lease
        self.retention = retention
        self.owner = owner
        self._clock = clock

    def claim(self, key: str) -> bool:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError
        from azure.data.tables import UpdateMode

        partition, row = _address(self.namespace, key)
        for _ in range(3):  # a row released between our insert and our read: insert again
            now = self._clock()
            entity = {"PartitionKey": partition, "RowKey": row, "Namespace": self.namespace, "Key": key[:1000],
                      "State": PENDING, "Owner": self.owner, "At": now, "LeaseUntil": now + self.lease,
                      "Expires": now + self.lease + self.retention}
            try:
                self._table.create_entity(entity)
                return True
            except ResourceExistsError:
                pass
            try:
                current = self._table.get_entity(partition, row)
            except ResourceNotFoundError:
                continue
            state = current.get("State")
            if state == SETTLED and now - float(current.get("At") or 0) < self.retention:
                return False
            if state == PENDING and float(current.get("LeaseUntil") or 0) > now:
                return False  # being acted on (by us too: a second copy in flight waits for the first)
            # Our own pending claim past its lease is ours to take again (a release that failed).
            # Settled long ago, or pending under an owner whose lease ran out (killed mid-claim): take it over,
            # only if nobody changed the row since we read it.
            try:
                self._table.update_entity(entity, mode=UpdateMode.REPLACE, etag=current.metadata["etag"],
                                          match_condition=MatchConditions.IfNotModified)
                return True
            except (ResourceModifiedError, ResourceNotFoundError):
                return False
        return False

    def status(self, key: str) -> str | None:
        """PENDING or SETTLED while the claim holds (a settled one for ``retention``), else None."""
        from azure.core.exceptions import ResourceNotFoundError

        try:
            current = self._table.get_entity(*_address(self.namespace, key))
        except ResourceNotFoundError:
            return None
        state = current.get("State")
        if state == SETTLED and self._clock() - float(current.get("At") or 0) >= self.retention:
            return None
        return str(state) if state in (PENDING, SETTLED) else None

    def settle(self, key: str) -> None:
        from azure.data.tables import UpdateMode

        partition, row = _address(self.namespace, key)
        now = self._clock()
        self._table.upsert_entity({"PartitionKey": partition, "RowKey": row, "Namespace": self.namespace,
                                   "Key": key[:1000], "State": SETTLED, "Owner": "", "At": now,
                                   "LeaseUntil": 0.0, "Expires": now + self.retention}, mode=UpdateMode.REPLACE)

    def release(self, key: str) -> None:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError

        partition, row = _address(self.namespace, key)
        try:
            current = self._table.get_entity(partition, row)
            if current.get("Owner") != self.owner:
                return  # taken over by another instance after our lease: theirs now
            self._table.delete_entity(partition, row, etag=current.metadata["etag"],
                                      match_condition=MatchConditions.IfNotModified)
        except (ResourceModifiedError, ResourceNotFoundError):
            pass

    def close(self) -> None:
        """Nothing of its own: the ``TableState`` owns the connection."""


class TableFolds:
    """``Folds`` in an Azure Storage table: insert, or replace with the ETag read when the rank is higher."""

    def __init__(self, table: Any, namespace: str, *, retention: float, clock: Callable[[], float] = time.time) -> None:
        self._table = table
        self.namespace = namespace
        self.retention = retention
        self._clock = clock

    def fold(self, key: str, value: str, rank: int) -> tuple[str, bool]:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError
        from azure.data.tables import UpdateMode

        partition, row = _address(self.namespace, key)
        now = self._clock()
        entity = {"PartitionKey": partition, "RowKey": row, "Namespace": self.namespace, "Key": key[:1000],
                  "Value": value, "Rank": int(rank), "At": now, "Expires": now + self.retention}
        while True:  # each round ends in a decision or a conflict that someone else's write caused
            try:
                self._table.create_entity(entity)
                return value, True
            except ResourceExistsError:
                pass
            try:
                current = self._table.get_entity(partition, row)
            except ResourceNotFoundError:
                continue
            expired = self._clock() - float(current.get("At") or 0) >= self.retention
            if not expired and int(current.get("Rank") or 0) >= rank:
                return str(current.get("Value")), False
            try:
                self._table.update_entity(entity, mode=UpdateMode.REPLACE, etag=current.metadata["etag"],
                                          match_condition=MatchConditions.IfNotModified)
                return value, True
            except (ResourceModifiedError, ResourceNotFoundError):
                continue  # another instance folded meanwhile: compare with its value


BACKENDS = ("sqlite", "table")


def table_settings(env: Mapping[str, str], problems: list[str], *, default_table: str = DEFAULT_TABLE) -> dict[str, str]:
    """STATE_BACKEND (``sqlite``: one instance; ``table``: any number) and STATE_TABLE_CONNECTION, _ENDPOINT and
    _NAME, as every consumer reads them: {"backend", "connection", "endpoint", "table"}; problems appended."""
    backend = env.get("STATE_BACKEND", "").strip().lower() or "sqlite"
    if backend not in BACKENDS:
        problems.append(f"STATE_BACKEND must be one of {', '.join(BACKENDS)}, got {backend!r}")
        backend = "sqlite"
    connection = env.get("STATE_TABLE_CONNECTION", "").strip()
    endpoint = env.get("STATE_TABLE_ENDPOINT", "").strip().rstrip("/")
    if backend == "table":
        if not connection and not endpoint:
            problems.append("STATE_BACKEND=table needs STATE_TABLE_ENDPOINT (https://<account>.table.core.windows.net, "
                            "with the app's managed identity) or STATE_TABLE_CONNECTION (a connection string)")
        elif endpoint and not connection and not endpoint.lower().startswith("https://"):
            problems.append(f"STATE_TABLE_ENDPOINT must be https:// (tokens never go over plain HTTP), got {endpoint!r}")
    table = env.get("STATE_TABLE_NAME", "").strip() or default_table
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]{2,62}", table):
        problems.append(f"STATE_TABLE_NAME must be 3-63 letters and digits, starting with a letter, got {table!r}")
    return {"backend": backend, "connection": connection, "endpoint": endpoint, "table": table}


class TableState:
    """One table client shared by the namespaces of one process."""

    def __init__(self, table: Any, owner: str | None = None, clock: Callable[[], float] = time.time) -> None:
        self.table = table
        self.owner = owner or instance_owner()
        self._clock = clock

    @classmethod
    def open(cls, *, table: str = DEFAULT_TABLE, connection_string: str | None = None, endpoint: str | None = None,
             credential: Any = None, create: bool = True, **client_options: Any) -> TableState:
        """A connection string (account key or Azurite) or an endpoint with a token credential (managed
        identity); ``create`` makes the table when it is missing (needs the same data role)."""
        from azure.core.exceptions import ResourceExistsError
        from azure.data.tables import TableClient

        if connection_string:
            client = TableClient.from_connection_string(connection_string, table_name=table, **client_options)
        elif endpoint and credential is not None:
            client = TableClient(endpoint=endpoint, table_name=table, credential=credential, **client_options)
        else:
            raise ValueError("TableState needs a connection string, or an endpoint and a credential")
        if create:
            try:
                client.create_table()
            except ResourceExistsError:
                pass
        return cls(client)

    def claims(self, namespace: str, *, lease: float = 600.0, retention: float = 6 * 3600.0) -> TableClaims:
        return TableClaims(self.table, namespace, lease=lease, retention=retention, owner=self.owner, clock=self._clock)

    def folds(self, namespace: str, *, retention: float = 6 * 3600.0) -> TableFolds:
        return TableFolds(self.table, namespace, retention=retention, clock=self._clock)

    def purge(self, now: float | None = None) -> int:
        """Delete the rows whose ``Expires`` passed (and rows without one ``LEGACY_AGE`` after their ``At``),
        each only if unchanged since it was listed; returns how many went. Safe from any number of instances."""
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError

        now = self._clock() if now is None else now
        # One scan, paged as it goes (a property a row lacks, or holds as another type, matches nothing).
        found = self.table.query_entities("Expires lt @now or At lt @cutoff",
                                          parameters={"now": float(now), "cutoff": float(now - LEGACY_AGE)},
                                          select=["PartitionKey", "RowKey", "Expires"])
        deleted = 0
        for entity in found:
            expires = entity.get("Expires")
            if isinstance(expires, (int, float)) and expires >= now:
                continue  # old, but written with an Expires still ahead (a retention beyond LEGACY_AGE)
            try:
                self.table.delete_entity(entity["PartitionKey"], entity["RowKey"], etag=entity.metadata["etag"],
                                         match_condition=MatchConditions.IfNotModified)
                deleted += 1
            except (ResourceModifiedError, ResourceNotFoundError):
                pass  # claimed again, or purged by another instance
        return deleted

    def close(self) -> None:
        self.table.close()


__all__ = ["BACKENDS", "Claims", "DEFAULT_TABLE", "Folds", "LEGACY_AGE", "TableClaims", "TableFolds", "TableState",
           "instance_owner", "table_settings"]
