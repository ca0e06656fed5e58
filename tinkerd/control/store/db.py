"""The durable store: one SQLAlchemy engine and short transactions, on SQLite or PostgreSQL.

SQLite (the default, a file in the data directory) in WAL mode: readers never block the writer and a
commit costs well under a millisecond on local disk, so storing every accepted op before answering
(the write-ahead rule) is cheap. SQLite allows one writer, so calls are serialised by one lock.
PostgreSQL (`--db-url postgresql+psycopg://...`) takes concurrent writers: no lock, each call is its
own transaction on a pooled connection, and conflicts surface as IntegrityError (the dedupe race in
Control.submit) rather than waits. The schema comes from Alembic migrations (store/migrations.py).

A failed write or read (SQLite's "database or disk is full", "disk I/O error", "database is
locked" after its busy timeout; PostgreSQL's lost connection or server shutdown) raises errors.StorageUnavailable, not the driver's
OperationalError: a request answers 503 naming the cause (the SDK retries it), and the worker
retries storing a finished op's result until it lands (control/results.py).
"""

from __future__ import annotations

import os
import socket
import sqlite3
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from sqlalchemy import create_engine, event, inspect, make_url, select, text, update
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from tinkerd.control.clock import utcnow  # noqa: F401  (imported from here by most of control)
from tinkerd.control.store.migrations import upgrade
from tinkerd.control.store.tables import FutureRow
from tinkerd.errors import StorageUnavailable, UserError

T = TypeVar("T")
# How a process's connections name themselves to PostgreSQL (pg_stat_activity.application_name):
# `tinkerd fsck` finds the other processes using the database by it, as it finds SQLite's holders
# in /proc (cli/fsck.py). At most 63 bytes (PostgreSQL's NAMEDATALEN).
APP_NAME = f"tinkerd {socket.gethostname()[:32]} pid {os.getpid()}"


class Store:
    def __init__(self, url: str):
        parsed = make_url(url)
        self.sqlite = parsed.get_backend_name() == "sqlite"
        if self.sqlite:
            self.engine = create_engine(url, connect_args={"check_same_thread": False})
            event.listen(self.engine, "connect", _sqlite_pragmas)
            # SQLite allows one writer; serialising here avoids "database is locked" retries.
            self._lock = threading.Lock()
            self._where = parsed.database or ""
        else:
            # pre_ping: a pooled connection a PostgreSQL restart closed is replaced before use, not
            # handed to a request. The pool (5 + 10 overflow) exceeds the store's concurrent callers
            # here (the event loop's thread, the worker, the sweeps).
            connect = {"application_name": APP_NAME}
            self.engine = create_engine(url, pool_pre_ping=True, connect_args=connect)
            # The write probe's: a new connection each time (below), with a short connect timeout.
            self._probe_engine = create_engine(url, poolclass=NullPool, connect_args={**connect, "connect_timeout": 2})
            self._lock = nullcontext()
            self._where = parsed.render_as_string(hide_password=True)
        with self._faults():
            upgrade(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def _faults(self) -> Iterator[None]:
        try:
            yield
        except DataError as e:
            # PostgreSQL refuses values SQLite takes: a NUL character in text ("a\x00b" as a session
            # name or a request id looked up), an integer beyond a column's 32 or 64 bits. Control's
            # own values are in range, so such a value came from the caller: a `user` 400 naming it.
            reason = str(e.orig).splitlines()[0] if e.orig is not None else str(e)
            raise UserError(f"a value in the request cannot be stored or looked up: {reason}") from e
        except OperationalError as e:
            # SQLite's extended code says which call failed ("disk I/O error" alone does not):
            # SQLITE_IOERR_WRITE / _FSYNC for a read-only or failing disk, SQLITE_FULL, SQLITE_BUSY.
            code = getattr(e.orig, "sqlite_errorname", None) or getattr(e.orig, "sqlstate", None)
            raise StorageUnavailable(f"server storage is failing: {e.orig}{f' [{code}]' if code else ''} "
                                     f"({self._where})") from e

    @classmethod
    def sqlite(cls, path: Path) -> "Store":
        path.parent.mkdir(parents=True, exist_ok=True)
        return cls(f"sqlite:///{path}")

    @classmethod
    def open(cls, config) -> "Store":
        """The server's store: `config.db_url`, or SQLite in the data directory when unset."""
        return cls(config.db_url) if config.db_url else cls.sqlite(config.db_path)

    def get(self, row_type: type[T], key: Any) -> T | None:
        with self._faults(), self._lock, self._sessions() as s:
            return s.get(row_type, key)

    def add(self, row: Any) -> bool:
        """Insert; False when the primary or a unique key already exists."""
        with self._faults(), self._lock, self._sessions() as s:
            s.add(row)
            try:
                s.commit()
            except IntegrityError:
                s.rollback()
                return False
            return True

    def update(self, row_type: type, key: Any, **values: Any) -> None:
        """Set `values` on the row of primary key `key` (a tuple for a composite key); nothing if there
        is none. One UPDATE: loading the row first read every column of it (a future's op body, its
        datums) only to write a few."""
        keys = key if isinstance(key, tuple) else (key,)
        match = [column == k for column, k in zip(inspect(row_type).primary_key, keys, strict=True)]
        with self._faults(), self._lock, self._sessions() as s:
            s.execute(update(row_type).where(*match).values(**values))
            s.commit()

    def delete(self, row_type: type, key: Any) -> None:
        with self._faults(), self._lock, self._sessions() as s:
            row = s.get(row_type, key)
            if row is not None:
                s.delete(row)
                s.commit()

    def query(self, stmt) -> list:
        """The first column of each result row (whole rows for `select(SomeRow)`)."""
        with self._faults(), self._lock, self._sessions() as s:
            return list(s.scalars(stmt))

    def rows(self, stmt) -> list:
        """Every column of each result row (named tuples): for selects of several columns or a join."""
        with self._faults(), self._lock, self._sessions() as s:
            return list(s.execute(stmt))

    def write_probe(self, timeout_s: float = 0.1) -> str | None:
        """Why a write would fail now, or None: for readiness (GET /readyz), so that a store another
        process has locked, a read-only one or (PostgreSQL) an unreachable one shows before a write
        has failed on it. On a connection of its own, with a short timeout, and rolled back.

        SQLite: BEGIN IMMEDIATE takes the write lock (in WAL mode readers go on), a CREATE TABLE makes
        SQLite open the file for writing (BEGIN alone passes on a read-only file). The store's own
        writes hold the lock for well under a millisecond, so they do not make it fail.
        PostgreSQL: a new connection (a pooled one would hide a server that refuses new ones, and
        settings such as default_transaction_read_only take effect on new sessions), then an UPDATE
        of no rows of the futures table, which every accepted op writes: refused in a read-only
        transaction or on a standby, and it waits for the table's write lock, up to the timeout."""
        if not self.sqlite:
            return self._pg_write_probe(timeout_s)
        try:
            db = sqlite3.connect(self._where, timeout=timeout_s, isolation_level=None)
        except sqlite3.Error as e:
            return str(e)
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute("CREATE TABLE tinkerd_write_probe (x)")
            return None
        except sqlite3.Error as e:
            return str(e)
        finally:
            try:
                if db.in_transaction:
                    db.execute("ROLLBACK")
            finally:
                db.close()

    def _pg_write_probe(self, timeout_s: float) -> str | None:
        ms = max(1, int(timeout_s * 1000))
        try:
            with self._probe_engine.connect() as conn:
                conn.execute(text(f"SET lock_timeout = {ms}"))
                conn.execute(text(f"SET statement_timeout = {ms * 10}"))
                conn.execute(text("UPDATE futures SET status = status WHERE false"))
                conn.rollback()
            return None
        except DBAPIError as e:  # refused, unreachable, read-only, locked: the reason is the answer
            return str(e.orig).strip().splitlines()[0] if str(e.orig).strip() else type(e.orig).__name__

    def holders(self) -> list[str]:
        """PostgreSQL: the other tinkerd processes connected to this database now, one line each
        (their application_name and address); this process's own connections are left out. Empty on
        SQLite (cli/fsck.py looks in /proc there)."""
        if self.sqlite:
            return []
        with self._faults(), self.engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT pid, application_name, coalesce(host(client_addr), 'local socket') FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name LIKE 'tinkerd %' "
                "AND application_name <> :me"), {"me": APP_NAME}).all()
        return [f"{name} (backend {pid}, from {addr})" for pid, name, addr in rows]

    def dispose(self) -> None:
        """Close the pooled connections (PostgreSQL: they leave pg_stat_activity)."""
        self.engine.dispose()

    def time_statements(self, observe: Callable[[str, float], None]) -> Callable[[], None]:
        """Call observe(verb, seconds) after every statement the store runs (verb: its first word,
        lower case: select, insert, ...), for the metrics (control/metrics.py); returns the function
        that stops it."""
        def start(conn, cursor, statement, parameters, context, executemany):
            conn.info.setdefault("tinkerd_t0", []).append(time.perf_counter())

        def end(conn, cursor, statement, parameters, context, executemany):
            starts = conn.info.get("tinkerd_t0")
            if starts:
                observe(statement.lstrip()[:6].lower(), time.perf_counter() - starts.pop())

        listeners = (("before_cursor_execute", start), ("after_cursor_execute", end))
        for name, fn in listeners:
            event.listen(self.engine, name, fn)

        def stop() -> None:
            for name, fn in listeners:
                event.remove(self.engine, name, fn)
        return stop

    def future_by_dedupe_key(self, key: str) -> FutureRow | None:
        rows = self.query(select(FutureRow).where(FutureRow.dedupe_key == key))
        return rows[0] if rows else None

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A multi-statement write transaction under the writer lock; commits on a clean exit."""
        with self._faults(), self._lock, self._sessions() as s:
            yield s
            s.commit()


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    # NORMAL in WAL mode survives a process crash (only an OS crash may lose the last commits).
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()
