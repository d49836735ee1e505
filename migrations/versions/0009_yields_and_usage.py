"""Yields and usage (issue 17): when a shard last became queued (`shards.queued_at`: how long work has waited, which
decides a yield) and last yielded (`shards.yielded_at`); one `shard_runs` row per ended attempt of a shard (the
owner, the GPUs it held, when it started and ended), so owners' GPU-seconds count every attempt, a yielded one
too, not only a shard's last; and an optional cap on an owner's GPU-seconds per day (`quotas`). See
core/scheduling.py. Existing queued shards are taken as queued since their job's creation; every shard that ran to
an end becomes one run.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("queued_at", sa.Float(), nullable=True))
        batch.add_column(sa.Column("yielded_at", sa.Float(), nullable=True))
    op.execute(
        "UPDATE shards SET queued_at = (SELECT jobs.created_at FROM jobs WHERE jobs.id = shards.job_id) "
        "WHERE state = 'queued'"
    )
    with op.batch_alter_table("quotas") as batch:
        batch.add_column(sa.Column("max_gpu_seconds_per_day", sa.Float(), nullable=True))
    op.create_table(
        "shard_runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("shard_id", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=False),
        sa.Column("ended_as", sa.String(length=16), nullable=False),
        sa.ForeignKeyConstraint(["shard_id"], ["shards.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_shard_runs_owner_ended", "shard_runs", ["owner", "ended_at"])
    op.create_index("ix_shard_runs_shard", "shard_runs", ["shard_id"])
    op.execute(
        "INSERT INTO shard_runs (shard_id, owner, weight, started_at, ended_at, ended_as) "
        "SELECT shards.id, jobs.owner, CASE WHEN jobs.gpus > 0 THEN jobs.gpus ELSE 1 END, shards.started_at, "
        "shards.finished_at, shards.state FROM shards JOIN jobs ON jobs.id = shards.job_id "
        "WHERE shards.started_at IS NOT NULL AND shards.finished_at IS NOT NULL"
    )


def downgrade() -> None:
    op.drop_index("ix_shard_runs_shard", table_name="shard_runs")
    op.drop_index("ix_shard_runs_owner_ended", table_name="shard_runs")
    op.drop_table("shard_runs")
    with op.batch_alter_table("quotas") as batch:
        batch.drop_column("max_gpu_seconds_per_day")
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("yielded_at")
        batch.drop_column("queued_at")
