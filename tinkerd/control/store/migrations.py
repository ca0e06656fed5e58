"""Schema migrations: the store's tables come from the Alembic revisions in store/schema/versions/,
applied on every start (Store.__init__), never from `create_all`.

A fresh database gets every revision; one written by an older tinkerd gets the ones it lacks; a data
directory from before migrations (no `alembic_version` table, tinkerd at a7d511c and earlier) is
adopted by the baseline revision, which adds the columns that tinkerd version lacked. On PostgreSQL
an advisory lock makes replicas starting together apply them once.

Adding a table or column (docs/architecture.md §4): change tables.py, then
    python -m tinkerd.control.store.migrations "add per-step metrics"
writes schema/versions/0002_add_per_step_metrics.py (the next number) from the difference; read it,
then run
tests/unit/control/test_migrations.py, which fails while tables.py and the revisions disagree.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, text

SCRIPTS = Path(__file__).with_name("schema")
# Any constant: the advisory lock's key in PostgreSQL's one namespace for this database.
_PG_LOCK_KEY = 0x74696E6B


def _config(connection=None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPTS))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the database to `revision` (the newest by default), in one transaction."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Held to the end of this transaction: a second replica waits, then finds nothing to do.
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
        command.upgrade(_config(conn), revision)


def current(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def new_revision(message: str) -> None:
    """Autogenerate a revision: the difference between tables.py and a scratch SQLite at head. Its id
    is the next number (0002, 0003, ...), so the files sort in order and two branches that each add
    one collide loudly on merge instead of making two heads."""
    from alembic.script import ScriptDirectory

    rev_id = f"{len(list(ScriptDirectory(str(SCRIPTS)).walk_revisions())) + 1:04d}"
    with tempfile.TemporaryDirectory() as tmp:
        engine = create_engine(f"sqlite:///{tmp}/scratch.sqlite")
        upgrade(engine)
        with engine.begin() as conn:
            command.revision(_config(conn), message=message, autogenerate=True, rev_id=rev_id)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit('usage: python -m tinkerd.control.store.migrations "what the revision adds"')
    new_revision(sys.argv[1])
