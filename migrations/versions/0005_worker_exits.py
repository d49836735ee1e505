"""workers: why a worker stopped (exit code and reason, from the worker or its supervisor) and how many times its
slot was restarted, so `gpujobs workers` and /metrics show restarts and why a worker stays down.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("stopped_at", sa.Float(), nullable=True))
        batch.add_column(sa.Column("exit_code", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("reason", sa.Text(), nullable=True))
        batch.add_column(sa.Column("restarts", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        for column in ("restarts", "reason", "exit_code", "stopped_at"):
            batch.drop_column(column)
