"""Alembic's entry point: runs the revisions in versions/ on the connection the store hands over
(store/migrations.py); there is no alembic.ini and no URL of its own."""

from alembic import context

from tinkerd.control.store.tables import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata,
                  # SQLite cannot ALTER most things in place: batch mode copies the table instead.
                  render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
