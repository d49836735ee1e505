"""job_rows.finish_reason as JSON: a row generated with num_return_sequences > 1 has one finish reason per output
(a list), which a String(32) column cannot hold; a single reason stays a JSON string.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column("job_rows", "finish_reason", type_=sa.JSON(), postgresql_using="to_json(finish_reason)")
        return
    op.execute("UPDATE job_rows SET finish_reason = json_quote(finish_reason) WHERE finish_reason IS NOT NULL")
    with op.batch_alter_table("job_rows") as batch:
        batch.alter_column("finish_reason", type_=sa.JSON(), existing_type=sa.String(32))


def downgrade() -> None:
    """A list of reasons comes back as its JSON text (longer lists are cut to the old column's 32 characters)."""
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column("job_rows", "finish_reason", type_=sa.String(32),
                        postgresql_using="left(CASE WHEN json_typeof(finish_reason) = 'string' THEN "
                                         "finish_reason #>> '{}' ELSE finish_reason::text END, 32)")
        return
    op.execute("UPDATE job_rows SET finish_reason = substr(CASE WHEN json_type(finish_reason) = 'text' THEN "
               "json_extract(finish_reason, '$') ELSE finish_reason END, 1, 32) WHERE finish_reason IS NOT NULL")
    with op.batch_alter_table("job_rows") as batch:
        batch.alter_column("finish_reason", type_=sa.String(32), existing_type=sa.JSON())
