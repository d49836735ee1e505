"""job_rows.output as JSON: generated text may contain NUL characters, which Postgres text columns refuse
(psycopg.DataError), while a JSON string stores them escaped (\\u0000) on Postgres and SQLite alike.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column("job_rows", "output", type_=sa.JSON(), postgresql_using="to_json(output)")
        return
    op.execute("UPDATE job_rows SET output = json_quote(output) WHERE output IS NOT NULL")
    with op.batch_alter_table("job_rows") as batch:
        batch.alter_column("output", type_=sa.JSON(), existing_type=sa.Text())


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column("job_rows", "output", type_=sa.Text(), postgresql_using="output #>> '{}'")
        return
    op.execute("UPDATE job_rows SET output = json_extract(output, '$') WHERE output IS NOT NULL")
    with op.batch_alter_table("job_rows") as batch:
        batch.alter_column("output", type_=sa.Text(), existing_type=sa.JSON())
