"""job_events: the run each event belongs to, and whether a resumed fine-tune superseded it.

A job's run is 1 at submit and goes up by one with each `retry` (`jobs.retries + 1`); every event records the run it
was written in, so a job's view shows its current run and the earlier ones stay readable (`gpujobs events --run N`).
A fine-tune that resumes from a checkpoint at step S marks its run's step events after S `superseded`: the steps
run again, and the current view shows each step once (`--all-runs` shows every event as written).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job_events") as batch:
        batch.add_column(sa.Column("run", sa.Integer(), nullable=False, server_default="1"))
        batch.add_column(sa.Column("superseded", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("job_events") as batch:
        batch.drop_column("superseded")
        batch.drop_column("run")
