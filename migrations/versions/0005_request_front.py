"""requests: the front process that serves each request (a dead front's rows end `interrupted`)

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("front", sa.String(length=64), nullable=True))
        batch.create_index("ix_requests_status_front", ["status", "front"])


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_index("ix_requests_status_front")
        batch.drop_column("front")
