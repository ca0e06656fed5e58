"""Alembic's script directory for the store's schema (store/migrations.py): env.py runs the revisions in versions/."""
