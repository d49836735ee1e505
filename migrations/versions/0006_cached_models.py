"""cached_models: the snapshots of Hub repos in each host's Hugging Face cache, their downloads' progress, and the
pull/remove requests `gpujobs models pull/rm --workers` leave for the workers of a host (core/model_cache.py).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cached_models",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("cache_dir", sa.String(length=1024), nullable=False),
        sa.Column("repo", sa.String(length=255), nullable=False),
        sa.Column("commit", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("revision", sa.String(length=255), nullable=True),
        sa.Column("refs", sa.JSON(), nullable=True),
        sa.Column("state", sa.String(length=24), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("bytes_done", sa.BigInteger(), nullable=False),
        sa.Column("bytes_total", sa.BigInteger(), nullable=False),
        sa.Column("rate", sa.Float(), nullable=True),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("requested_by", sa.String(length=128), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("last_used_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("host", "cache_dir", "repo", "commit", name="uq_cached_models_place"),
    )
    op.create_index("ix_cached_models_repo", "cached_models", ["repo"])


def downgrade() -> None:
    op.drop_index("ix_cached_models_repo", table_name="cached_models")
    op.drop_table("cached_models")
