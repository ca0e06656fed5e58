"""Storage rows (SQLAlchemy). SQLite in WAL mode by default; the same models serve PostgreSQL."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, Integer, LargeBinary, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class SessionRow(Base):
    __tablename__ = "sessions"
    session_id: Mapped[str] = mapped_column(String, primary_key=True)
    # The account of the key that created the session; its runs, checkpoints and sampling sessions
    # belong to the same account (derived, not stored again). None only for internal callers.
    account_id: Mapped[str | None] = mapped_column(String, index=True, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    last_heartbeat_at: Mapped[datetime] = mapped_column(DateTime)
    tags: Mapped[list] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    sdk_version: Mapped[str | None] = mapped_column(String, nullable=True)
    finished_reason: Mapped[str | None] = mapped_column(String, nullable=True)
    # CreateSessionRequest.display_name: shown and searched (RestClient.search_sessions), not unique.
    display_name: Mapped[str | None] = mapped_column(String, nullable=True)
    # The account's project it belongs to (control/projects.py), with its runs, samplers, checkpoints.
    project_id: Mapped[str | None] = mapped_column(String, nullable=True)


class TrainingRunRow(Base):
    __tablename__ = "training_runs"
    model_id: Mapped[str] = mapped_column(String, primary_key=True)
    session_id: Mapped[str] = mapped_column(String, index=True)
    base_model: Mapped[str] = mapped_column(String)
    lora_rank: Mapped[int] = mapped_column(Integer)
    lora_config: Mapped[dict] = mapped_column(JSON)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    last_request_at: Mapped[datetime] = mapped_column(DateTime)


class SamplingSessionRow(Base):
    __tablename__ = "sampling_sessions"
    sampling_session_id: Mapped[str] = mapped_column(String, primary_key=True)
    session_id: Mapped[str] = mapped_column(String, index=True)
    base_model: Mapped[str] = mapped_column(String)
    # The tinker:// path the user named (None for base-model and ephemeral samplers).
    model_path: Mapped[str | None] = mapped_column(String, nullable=True)
    # The adapter directory the engine loads (None = the base model alone).
    adapter_dir: Mapped[str | None] = mapped_column(String, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # Clients that joined it (join_sampling_session: unpickled SamplingClients); the n-th joiner is
    # clone n and numbers its requests from n * 1e9. NULL: none yet (the original client is clone 0).
    clients_joined: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # An inflight sampler (save_weights_and_get_sampling_client(kind="inflight")): the training run
    # whose shared inflight target it follows; every inflight save of that run repoints adapter_dir.
    inflight_of: Mapped[str | None] = mapped_column(String, nullable=True)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    tinker_path: Mapped[str] = mapped_column(String, primary_key=True)
    model_id: Mapped[str] = mapped_column(String, index=True)
    checkpoint_type: Mapped[str] = mapped_column(String)  # training | sampler | external
    name: Mapped[str] = mapped_column(String)
    dir_path: Mapped[str] = mapped_column(String)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)


class FutureRow(Base):
    """One accepted operation: its op record (the write-ahead log entry) and, once done, its result."""

    __tablename__ = "futures"
    request_id: Mapped[str] = mapped_column(String, primary_key=True)
    request_type: Mapped[str] = mapped_column(String)  # ForwardBackward, OptimStep, Sample, ...
    # The queue it belongs to (model_id or sampling_session_id) and its seq_id there:
    # (target, seq_id) is the idempotency key of re-sent requests.
    target: Mapped[str] = mapped_column(String, index=True)
    seq_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    dedupe_key: Mapped[str | None] = mapped_column(String, unique=True, nullable=True)
    # Who submitted it: only that account may retrieve it, and recovery rebuilds it as that account.
    account_id: Mapped[str | None] = mapped_column(String, index=True, nullable=True)
    # The op as accepted: with op_version set, its OpRecord in the op log's encoding (control/oplog.py);
    # with op_version NULL, the raw HTTP body an older tinkerd stored (converted on start).
    body: Mapped[bytes] = mapped_column(LargeBinary)
    op_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    status: Mapped[str] = mapped_column(String, index=True)  # pending | complete | failed
    # The domain result (result_media_type oplog.DOMAIN_RESULT), or wire bytes an older tinkerd stored.
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    result_media_type: Mapped[str | None] = mapped_column(String, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    error_category: Mapped[str | None] = mapped_column(String, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    completed_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    compute_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Retention (control/retention.py): when retrieve_future first handed out the result or error,
    # and when the retention sweep cleared it (the row is then a tombstone: the result, error and, once
    # recovery no longer replays it, the body are gone; its owner's retrieve_future answers "expired").
    retrieved_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    expired_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # Which engine driver took a pending op into its queue (control/claims.py): set at submit by a
    # process with a worker, and by the worker's claim for ops an `api` replica accepted. NULL: not
    # claimed yet (or accepted by a tinkerd from before replicas; recovery takes every pending op).
    claimed_by: Mapped[str | None] = mapped_column(String, nullable=True)
    # Why the driver's scheduler holds this pending op back (an account quota, control/quotas.py), as
    # the driver last posted it (control/pauses.py), for an api replica's retrieve_future to report;
    # NULL: not held. Only api replicas read it: the driver answers from its scheduler.
    paused_reason: Mapped[str | None] = mapped_column(Text, nullable=True)


class FutureWatermarkRow(Base):
    """Per dedupe identity (request_type|account_id|target), the highest seq_id whose future the
    retention sweep deleted: a re-send at or below it is refused, never run a second time. One row
    per run or sampling session and request type, not per op."""

    __tablename__ = "future_watermarks"
    dedupe_prefix: Mapped[str] = mapped_column(String, primary_key=True)
    seq_id: Mapped[int] = mapped_column(BigInteger)


class UsageRow(Base):
    """What one completed operation consumed. Quantities are raw (tokens, seconds); prices are applied
    when usage is read, so a price change re-prices history. Queue wait is recorded, never billed."""

    __tablename__ = "usage"
    request_id: Mapped[str] = mapped_column(String, primary_key=True)
    account_id: Mapped[str | None] = mapped_column(String, index=True, nullable=True)
    session_id: Mapped[str | None] = mapped_column(String, nullable=True)
    target: Mapped[str] = mapped_column(String)  # model_id, sampling_session_id, model_path or base model
    base_model: Mapped[str | None] = mapped_column(String, nullable=True)
    request_type: Mapped[str] = mapped_column(String)
    prefill_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    sampled_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    trained_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    forward_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    checkpoints: Mapped[int] = mapped_column(Integer, default=0)
    queue_wait_s: Mapped[float] = mapped_column(Float, default=0.0)  # accepted -> handed to the engine
    compute_s: Mapped[float] = mapped_column(Float, default=0.0)  # in the engine
    completed_at: Mapped[datetime] = mapped_column(DateTime, index=True)


class AccountRow(Base):
    """Who owns sessions, runs, checkpoints and futures; every API key belongs to one account."""

    __tablename__ = "accounts"
    account_id: Mapped[str] = mapped_column(String, primary_key=True)
    name: Mapped[str] = mapped_column(String, unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # Quota overrides (`tinkerd accounts set-quota`): NULL = the server's default, 0 = no limit.
    max_concurrent_runs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class CheckpointStorageRow(Base):
    """One registration of a checkpoint's files, for GB-hour storage billing: open while the
    checkpoint lives, closed when it is deleted, expires or is overwritten. Unlike CheckpointRow it
    outlives the checkpoint, so storage already used stays billed."""

    __tablename__ = "checkpoint_storage"
    # f"{tinker_path}@{created_at}": one per registration (an overwrite is a new one).
    storage_id: Mapped[str] = mapped_column(String, primary_key=True)
    tinker_path: Mapped[str] = mapped_column(String, index=True)
    account_id: Mapped[str | None] = mapped_column(String, index=True, nullable=True)
    base_model: Mapped[str | None] = mapped_column(String, nullable=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    start_at: Mapped[datetime] = mapped_column(DateTime)
    end_at: Mapped[datetime | None] = mapped_column(DateTime, index=True, nullable=True)


class ApiKeyRow(Base):
    """Only a hash of each key is stored; the key itself is shown once, when it is created."""

    __tablename__ = "api_keys"
    key_id: Mapped[str] = mapped_column(String, primary_key=True)
    key_hash: Mapped[str] = mapped_column(String, unique=True, index=True)
    account_id: Mapped[str] = mapped_column(String, index=True)
    name: Mapped[str] = mapped_column(String)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)


class UnloadedRunRow(Base):
    """A training run whose adapter is not in the engine: its session stopped heart-beating and it was
    released, or it was not rebuilt at start-up. Its state is its last recovery snapshot plus the
    logged ops after it; the run's next op rebuilds it from there. The row goes when it is loaded."""

    __tablename__ = "unloaded_runs"
    model_id: Mapped[str] = mapped_column(String, primary_key=True)
    unloaded_at: Mapped[datetime] = mapped_column(DateTime)


class AuditRow(Base):
    """One security-relevant event (control/audit.py): who did what to which key, checkpoint or quota,
    and failed authentications, folded into one row per source and minute with a count."""

    __tablename__ = "audit_log"
    audit_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime, index=True)
    # The account the event concerns; None for failed authentications with an unknown key.
    account_id: Mapped[str | None] = mapped_column(String, index=True, nullable=True)
    event: Mapped[str] = mapped_column(String)  # <resource>_<action>, as the SDK's AuditLogEntry
    details: Mapped[dict] = mapped_column(JSON, default=dict)
    count: Mapped[int] = mapped_column(Integer, default=1)


class RecordedSampleRow(Base):
    """A sample request made with record_stability_info (control/stability.py): what stable_reinforce
    trains against. One row per request; its sequences are `{request_id}:{i}`."""

    __tablename__ = "recorded_samples"
    request_id: Mapped[str] = mapped_column(String, primary_key=True)
    # Recorded sequences belong to the session that sampled them (the Tinker docs' rule).
    session_id: Mapped[str] = mapped_column(String, index=True)
    # int32 prompt tokens; per sequence int64 lengths, then all sampled int32 tokens and fp32
    # log-probs back to back. None once expired (a tombstone, so the owner hears "expired").
    prompt: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    lengths: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    tokens: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    logprobs: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # Sampling time plus the TTL, moved forward by every training request that names a sequence.
    expires_at: Mapped[datetime] = mapped_column(DateTime, index=True)


class CustomLossRow(Base):
    """A loss uploaded with create_custom_loss (control/custom_losses.py): the traced graph as JSON
    data, usable by the training runs of the session that created it. `loss_id` is
    `<session>:loss:<custom_loss_seq_id>`, so a re-sent upload finds its row."""

    __tablename__ = "custom_losses"
    loss_id: Mapped[str] = mapped_column(String, primary_key=True)
    session_id: Mapped[str] = mapped_column(String, index=True)
    name: Mapped[str] = mapped_column(String)
    inputs: Mapped[list] = mapped_column(JSON)  # [[name, rank], ...], logprobs first
    graph_json: Mapped[str] = mapped_column(Text)  # lossgraph.check's canonical JSON
    created_at: Mapped[datetime] = mapped_column(DateTime)


class UnrecoverableRunRow(Base):
    """A training run recovery could not rebuild, and why (its base model is no longer served, a
    logged op failed on replay). Its ops fail with this reason instead of running on a missing or
    wrong adapter; its snapshots and log are kept, and the row goes when a later start rebuilds it."""

    __tablename__ = "unrecoverable_runs"
    model_id: Mapped[str] = mapped_column(String, primary_key=True)
    reason: Mapped[str] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(DateTime)


class StepMetricRow(Base):
    """The metrics one training op returned (forward_backward, forward, optim_step), stored as it
    completes (control/stepmetrics.py): the console's loss and metric curves. One row per op, so a
    redone op (recovery re-running a pending one) keeps the first."""

    __tablename__ = "step_metrics"
    request_id: Mapped[str] = mapped_column(String, primary_key=True)
    model_id: Mapped[str] = mapped_column(String, index=True)
    # The op's seq_id in its run (the SDK numbers a run's ops from 1): the curves' x axis.
    seq_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    request_type: Mapped[str] = mapped_column(String)  # ForwardBackward | Forward | OptimStep
    metrics: Mapped[dict] = mapped_column(JSON)  # name -> float, the keys the SDK's result carries
    recorded_at: Mapped[datetime] = mapped_column(DateTime)


class ServedModelRow(Base):
    """A base model the engine driver serves, as its engine reported it (types.ServedModel), written
    when the driver starts: `api` replicas have no engine and answer get_server_capabilities,
    get_info and the OpenAI tokenizers from these rows (control/replicas.py)."""

    __tablename__ = "served_models"
    name: Mapped[str] = mapped_column(String, primary_key=True)
    model: Mapped[dict] = mapped_column(JSON)  # dataclasses.asdict(ServedModel)
    worker_id: Mapped[str] = mapped_column(String)
    updated_at: Mapped[datetime] = mapped_column(DateTime)
