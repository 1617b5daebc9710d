"""requests: predicted output range and a prompt sample for the learned length predictor

Revision ID: 0002
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("predicted_lo", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("predicted_hi", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("prompt_sample", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("prompt_sample")
        batch.drop_column("predicted_hi")
        batch.drop_column("predicted_lo")
