"""Log-probabilities of a row's output (issue 26): `job_rows.logprobs`, JSON, null unless the row asked for them
(`logprobs` in the spec or the row): per generated token its text, log-probability, UTF-8 bytes and the most likely
alternatives, in OpenAI's chat shape (a list per output when a row has several). See worker/engines/logprobs.py.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job_rows") as batch:
        batch.add_column(sa.Column("logprobs", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_rows") as batch:
        batch.drop_column("logprobs")
