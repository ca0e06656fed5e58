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

import sqlite3
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator, TypeVar

from sqlalchemy import create_engine, event, make_url, select
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from tinkerd.control.clock import utcnow  # noqa: F401  (imported from here by most of control)
from tinkerd.control.store.migrations import upgrade
from tinkerd.control.store.tables import FutureRow
from tinkerd.errors import StorageUnavailable, UserError

T = TypeVar("T")


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
            self.engine = create_engine(url, pool_pre_ping=True)
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
        with self._faults(), self._lock, self._sessions() as s:
            row = s.get(row_type, key)
            if row is not None:
                for k, v in values.items():
                    setattr(row, k, v)
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
        process has locked, or a read-only one, shows before a write has failed on it. SQLite only,
        on a connection of its own with a short busy timeout: BEGIN IMMEDIATE takes the write lock
        (in WAL mode readers go on), a CREATE TABLE makes SQLite open the file for writing (BEGIN
        alone passes on a read-only file), and the ROLLBACK leaves nothing. The store's own writes
        hold the lock for well under a millisecond, so they do not make it fail."""
        if self.engine.dialect.name != "sqlite":
            return None
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
