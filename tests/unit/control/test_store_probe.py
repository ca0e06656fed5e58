"""Readiness probes the store's writability itself (Store.write_probe): a SQLite file another
process has locked, or one on a read-only mount, makes readyz say so before any write has failed;
so does a PostgreSQL database that is read-only, refuses connections or has its futures table
locked (on the real server, tests/postgres.py)."""

from __future__ import annotations

import os
import sqlite3
import subprocess

import pytest

from tinkerd.control.control import Control
from tinkerd.control.store.db import Store


class IdleEngine:
    def step(self, batch):
        raise AssertionError("no ops in this test")


def _storage_reasons(control: Control) -> list[str]:
    return [r for r in control.health()["reasons"] if r.startswith("storage")]


def test_a_store_locked_by_another_process_is_not_ready_before_any_write_failed(tmp_path):
    store = Store.sqlite(tmp_path / "db.sqlite")
    control = Control(store, IdleEngine())
    assert store.write_probe() is None and _storage_reasons(control) == []
    locker = sqlite3.connect(tmp_path / "db.sqlite", isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        health = control.health()
        assert _storage_reasons(control) == ["storage not writable: database is locked"]
        assert health["storage"]["writable"] is False and health["storage"]["write_error"] == "database is locked"
        assert control.results.stalled_since is None  # nothing has tried to write, let alone failed
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert _storage_reasons(control) == [] and control.health()["storage"]["writable"] is True


def test_a_store_on_a_read_only_mount_is_not_ready(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    store = Store.sqlite(data / "db.sqlite")
    control = Control(store, IdleEngine())
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    # Over the directory itself: what a filesystem remounted read-only looks like to a new open (the
    # store's own open file keeps writing: the kernel checks the mount when a file is opened).
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(data), str(data)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.strip()}")
    try:
        assert _storage_reasons(control) == ["storage not writable: attempt to write a readonly database"]
    finally:
        subprocess.run(["umount", "-l", str(data)], check=False)
    assert _storage_reasons(control) == []


def _pg(admin_url: str, *statements: str) -> None:
    """Run statements as the cluster's superuser, outside any transaction (ALTER DATABASE needs that)."""
    import psycopg

    with psycopg.connect(admin_url.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


@pytest.fixture
def pg_store(pg_server_url):
    from tests.postgres import fresh_database

    url = fresh_database(pg_server_url)
    store = Store(url)
    yield store, url.split("?")[0].rsplit("/", 1)[1], url
    store.dispose()


def test_a_read_only_postgresql_database_is_not_ready(pg_store, pg_server_url):
    store, db, _ = pg_store
    control = Control(store, IdleEngine())
    assert _storage_reasons(control) == [] and control.health()["storage"]["writable"] is True
    # What an operator (or a failover to a standby) does to stop writes: new sessions are read-only.
    _pg(pg_server_url, f'ALTER DATABASE "{db}" SET default_transaction_read_only = on')
    try:
        assert _storage_reasons(control) == ["storage not writable: cannot execute UPDATE in a read-only transaction"]
        assert control.results.stalled_since is None  # nothing has tried to write, let alone failed
    finally:
        _pg(pg_server_url, f'ALTER DATABASE "{db}" RESET default_transaction_read_only')
    assert _storage_reasons(control) == []


def test_an_unreachable_postgresql_database_is_not_ready(pg_store, pg_server_url):
    store, db, _ = pg_store
    control = Control(store, IdleEngine())
    assert _storage_reasons(control) == []
    # The database refuses connections and its sessions are ended: to the store, the server is gone.
    _pg(pg_server_url, f'ALTER DATABASE "{db}" WITH ALLOW_CONNECTIONS false',
        f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{db}'")
    try:
        reasons = _storage_reasons(control)
        assert len(reasons) == 1 and reasons[0].startswith("storage not writable: connection failed") \
            and f'database "{db}" is not currently accepting connections' in reasons[0], reasons
    finally:
        _pg(pg_server_url, f'ALTER DATABASE "{db}" WITH ALLOW_CONNECTIONS true')
    assert _storage_reasons(control) == []


def test_a_postgresql_table_locked_by_another_session_is_not_ready(pg_store, pg_server_url):
    store, db, _ = pg_store
    control = Control(store, IdleEngine())
    import psycopg

    # A migration or a manual LOCK TABLE elsewhere: every accept would wait on it.
    with psycopg.connect(pg_server_url.replace("postgresql+psycopg://", "postgresql://", 1).replace(
            "/postgres?", f"/{db}?")) as locker:
        locker.execute("LOCK TABLE futures IN ACCESS EXCLUSIVE MODE")
        assert _storage_reasons(control) == ["storage not writable: canceling statement due to lock timeout"]
    assert _storage_reasons(control) == []
