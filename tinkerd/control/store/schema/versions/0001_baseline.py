"""Baseline: the schema of tinkerd at a7d511c, the last version that made its tables with create_all.

A fresh database gets these tables. A data directory from before migrations (tables present, no
alembic_version) is adopted: that tinkerd added nullable columns on start when its code declared
them, so a directory last opened by an older one may lack some; they are added here (existing rows
hold NULL, which every such column's reader takes as "not recorded then"), with their indexes.

The tables are spelled out rather than read from tables.py: a revision states the schema at its
point in history, and tables.py moves on.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy import JSON, BigInteger, Boolean, Column, DateTime, Float, Integer, LargeBinary, String, Text

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

md = sa.MetaData()
sa.Table("accounts", md,
         Column("account_id", String, primary_key=True),
         Column("name", String, nullable=False, unique=True),
         Column("created_at", DateTime, nullable=False),
         Column("max_concurrent_runs", Integer),
         Column("max_tokens_per_minute", BigInteger))
sa.Table("api_keys", md,
         Column("key_id", String, primary_key=True),
         Column("key_hash", String, nullable=False, unique=True, index=True),
         Column("account_id", String, nullable=False, index=True),
         Column("name", String, nullable=False),
         Column("created_at", DateTime, nullable=False),
         Column("revoked_at", DateTime))
sa.Table("audit_log", md,
         Column("audit_id", Integer, primary_key=True, autoincrement=True),
         Column("at", DateTime, nullable=False, index=True),
         Column("account_id", String, index=True),
         Column("event", String, nullable=False),
         Column("details", JSON, nullable=False),
         Column("count", Integer, nullable=False))
sa.Table("checkpoint_storage", md,
         Column("storage_id", String, primary_key=True),
         Column("tinker_path", String, nullable=False, index=True),
         Column("account_id", String, index=True),
         Column("base_model", String),
         Column("size_bytes", BigInteger, nullable=False),
         Column("start_at", DateTime, nullable=False),
         Column("end_at", DateTime, index=True))
sa.Table("checkpoints", md,
         Column("tinker_path", String, primary_key=True),
         Column("model_id", String, nullable=False, index=True),
         Column("checkpoint_type", String, nullable=False),
         Column("name", String, nullable=False),
         Column("dir_path", String, nullable=False),
         Column("created_at", DateTime, nullable=False),
         Column("expires_at", DateTime),
         Column("size_bytes", BigInteger),
         Column("public", Boolean, nullable=False),
         Column("user_metadata", JSON, nullable=False))
sa.Table("custom_losses", md,
         Column("loss_id", String, primary_key=True),
         Column("session_id", String, nullable=False, index=True),
         Column("name", String, nullable=False),
         Column("inputs", JSON, nullable=False),
         Column("graph_json", Text, nullable=False),
         Column("created_at", DateTime, nullable=False))
sa.Table("future_watermarks", md,
         Column("dedupe_prefix", String, primary_key=True),
         Column("seq_id", BigInteger, nullable=False))
sa.Table("futures", md,
         Column("request_id", String, primary_key=True),
         Column("request_type", String, nullable=False),
         Column("target", String, nullable=False, index=True),
         Column("seq_id", BigInteger),
         Column("dedupe_key", String, unique=True),
         Column("account_id", String, index=True),
         Column("body", LargeBinary, nullable=False),
         Column("op_version", Integer),
         Column("status", String, nullable=False, index=True),
         Column("result", LargeBinary),
         Column("result_media_type", String),
         Column("error", Text),
         Column("error_category", String),
         Column("created_at", DateTime, nullable=False),
         Column("completed_at", DateTime),
         Column("compute_s", Float),
         Column("retrieved_at", DateTime),
         Column("expired_at", DateTime))
sa.Table("recorded_samples", md,
         Column("request_id", String, primary_key=True),
         Column("session_id", String, nullable=False, index=True),
         Column("prompt", LargeBinary),
         Column("lengths", LargeBinary),
         Column("tokens", LargeBinary),
         Column("logprobs", LargeBinary),
         Column("created_at", DateTime, nullable=False),
         Column("expires_at", DateTime, nullable=False, index=True))
sa.Table("sampling_sessions", md,
         Column("sampling_session_id", String, primary_key=True),
         Column("session_id", String, nullable=False, index=True),
         Column("base_model", String, nullable=False),
         Column("model_path", String),
         Column("adapter_dir", String),
         Column("created_at", DateTime, nullable=False),
         Column("clients_joined", Integer),
         Column("inflight_of", String))
sa.Table("sessions", md,
         Column("session_id", String, primary_key=True),
         Column("account_id", String, index=True),
         Column("created_at", DateTime, nullable=False),
         Column("last_heartbeat_at", DateTime, nullable=False),
         Column("tags", JSON, nullable=False),
         Column("user_metadata", JSON, nullable=False),
         Column("sdk_version", String),
         Column("finished_reason", String),
         Column("display_name", String),
         Column("project_id", String))
sa.Table("training_runs", md,
         Column("model_id", String, primary_key=True),
         Column("session_id", String, nullable=False, index=True),
         Column("base_model", String, nullable=False),
         Column("lora_rank", Integer, nullable=False),
         Column("lora_config", JSON, nullable=False),
         Column("user_metadata", JSON, nullable=False),
         Column("created_at", DateTime, nullable=False),
         Column("last_request_at", DateTime, nullable=False))
sa.Table("unloaded_runs", md,
         Column("model_id", String, primary_key=True),
         Column("unloaded_at", DateTime, nullable=False))
sa.Table("unrecoverable_runs", md,
         Column("model_id", String, primary_key=True),
         Column("reason", Text, nullable=False),
         Column("at", DateTime, nullable=False))
sa.Table("usage", md,
         Column("request_id", String, primary_key=True),
         Column("account_id", String, index=True),
         Column("session_id", String),
         Column("target", String, nullable=False),
         Column("base_model", String),
         Column("request_type", String, nullable=False),
         Column("prefill_tokens", BigInteger, nullable=False),
         Column("sampled_tokens", BigInteger, nullable=False),
         Column("trained_tokens", BigInteger, nullable=False),
         Column("forward_tokens", BigInteger, nullable=False),
         Column("checkpoints", Integer, nullable=False),
         Column("queue_wait_s", Float, nullable=False),
         Column("compute_s", Float, nullable=False),
         Column("completed_at", DateTime, nullable=False, index=True))


def upgrade() -> None:
    bind = op.get_bind()
    inspector = sa.inspect(bind)
    for table in md.sorted_tables:
        if not inspector.has_table(table.name):
            table.create(bind)
            continue
        have = {c["name"] for c in inspector.get_columns(table.name)}
        for col in table.columns:
            if col.name not in have:
                op.add_column(table.name, Column(col.name, col.type, nullable=True))
        indexes = {i["name"] for i in inspector.get_indexes(table.name)}
        for index in table.indexes:
            if index.name not in indexes:
                index.create(bind)


def downgrade() -> None:
    md.drop_all(op.get_bind())
