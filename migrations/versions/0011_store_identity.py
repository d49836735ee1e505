"""store_identity: the store's random id, made here once, and the artifacts directory it adopted (the mark in that
directory's `.gpujobs-store` marker, where and when). A worker or an API whose JOBS_ARTIFACTS is not that directory
refuses to start (core/artifacts.py; worker exit 78). Downgrading drops the id: the next upgrade makes a new one,
and the directory's marker (of the old id) must then be adopted again (`gpujobs db adopt-artifacts --force`).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-08
"""

import secrets
import time

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "store_identity",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("artifacts_mark", sa.String(length=40), nullable=True),
        sa.Column("artifacts_path", sa.Text(), nullable=True),
        sa.Column("artifacts_host", sa.String(length=255), nullable=True),
        sa.Column("artifacts_adopted_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.bulk_insert(table, [{"id": f"store_{secrets.token_hex(8)}", "created_at": time.time()}])


def downgrade() -> None:
    op.drop_table("store_identity")
