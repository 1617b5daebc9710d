"""requests: how many times a request moved off an instance that died, and the instances it left

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("migrations", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("migrated_from", sa.String(length=256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("migrated_from")
        batch.drop_column("migrations")
