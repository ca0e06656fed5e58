"""Readiness probes the store's writability itself (Store.write_probe): a SQLite file another
process has locked, or one on a read-only mount, makes readyz say so before any write has failed."""

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
