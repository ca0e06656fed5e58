"""Alembic migrations (store/migrations.py) on both backends: the revisions build exactly the schema
tables.py declares (so a column added to tables.py without a revision fails here), and a database
made before migrations — by create_all, perhaps lacking columns a later tinkerd added — is adopted
with its rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from tinkerd.control.store.db import Store
from tinkerd.control.store.migrations import SCRIPTS, current
from tinkerd.control.store.tables import Base, FutureRow


def _baseline() -> sa.MetaData:
    """The tables of revision 0001 as it spells them: what a7d511c's create_all made, whatever
    tables.py declares now (later revisions add tables that database never had)."""
    spec = importlib.util.spec_from_file_location("baseline_0001", Path(SCRIPTS) / "versions" / "0001_baseline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.md


def _head() -> str:
    return ScriptDirectory(str(SCRIPTS)).get_current_head()


def _diff(engine) -> list:
    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn), Base.metadata)


def test_the_revisions_build_the_schema_tables_py_declares(db_url):
    store = Store(db_url)
    assert current(store.engine) == _head()
    assert _diff(store.engine) == []


def test_a_column_in_tables_py_without_a_revision_is_caught(db_url):
    store = Store(db_url)
    extra = sa.Column("not_migrated", sa.String, nullable=True)
    Base.metadata.tables["futures"].append_column(extra)
    try:
        assert [d[0] for d in _diff(store.engine)] == ["add_column"]
    finally:
        Base.metadata.tables["futures"]._columns.remove(extra)


def test_a_database_from_before_migrations_is_adopted_with_its_rows(db_url):
    # What a7d511c's create_all made, less a column an older tinkerd lacked (op_version came with the op
    # log; that tinkerd added such columns on start). Built from the baseline revision's own tables.
    engine = sa.create_engine(db_url)
    old = sa.MetaData()
    for table in _baseline().sorted_tables:
        cols = [c._copy() for c in table.columns if (table.name, c.name) != ("futures", "op_version")]
        sa.Table(table.name, old, *cols)
    old.create_all(engine)
    with engine.begin() as conn:
        conn.execute(old.tables["futures"].insert().values(
            request_id="r", request_type="OptimStep", target="m", seq_id=3, dedupe_key="k", body=b"{}",
            status="complete", created_at=sa.func.now()))
    engine.dispose()
    store = Store(db_url)
    assert current(store.engine) == _head()
    row = store.get(FutureRow, "r")
    assert (row.seq_id, row.body, row.op_version) == (3, b"{}", None)
    assert _diff(store.engine) == []
    Store(db_url)  # a second start finds nothing to do
