"""${message}

Revision ${up_revision}, after ${down_revision | comma,n}. Say why the schema changes (which feature
reads the new column or table), and what existing rows hold after the upgrade.
"""

from alembic import op
import sqlalchemy as sa
${imports if imports else ""}

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = None
depends_on = None


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
