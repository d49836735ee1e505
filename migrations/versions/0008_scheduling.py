"""Fair scheduling (issue 17): a job's priority (0 low, 1 normal, 2 high; existing jobs are normal), the indexes the
claim's choice reads (queued shards by queue and priority; shards that ran recently, for owners' GPU-seconds), and
per-owner quotas (a cap on concurrently running shards). See core/scheduling.py.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("priority", sa.Integer(), nullable=False, server_default="1"))
    op.create_index("ix_jobs_queue_priority", "jobs", ["queue", "priority", "owner", "created_at"])
    op.create_index("ix_shards_finished_at", "shards", ["finished_at"])
    op.create_table(
        "quotas",
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("max_running_shards", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("updated_by", sa.String(length=128), nullable=True),
        sa.PrimaryKeyConstraint("owner"),
    )


def downgrade() -> None:
    op.drop_table("quotas")
    op.drop_index("ix_shards_finished_at", table_name="shards")
    op.drop_index("ix_jobs_queue_priority", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("priority")
