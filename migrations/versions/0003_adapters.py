"""adapters: the LoRA adapters fine-tune jobs made (base model, tokenizer, LoRA config, metrics, producing job).

One row per fine-tune job, keyed by the job's id, so a generation spec's `adapter: <job id>` is a primary-key read.
The adapter's files live under the artifacts dir (`adapters/<job id>/`); `path` is relative to it, so a cluster
can mount the artifacts anywhere.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("base_model", sa.Text(), nullable=False),
        sa.Column("base_revision", sa.String(length=255), nullable=True),
        sa.Column("tokenizer", sa.Text(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("lora_config", sa.JSON(), nullable=False),
        sa.Column("load_options", sa.JSON(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("adapters", schema=None) as batch_op:
        batch_op.create_index("ix_adapters_owner", ["owner"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("adapters", schema=None) as batch_op:
        batch_op.drop_index("ix_adapters_owner")
    op.drop_table("adapters")
