"""ServerConfig: the only place environment variables are read."""

from __future__ import annotations

import os
from pathlib import Path

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Field(default_factory=lambda: Path(os.environ.get("TINKERD_DATA_DIR", "~/.tinkerd")).expanduser())
    # The durable store (control/store/db.py): None = SQLite in the data directory (db_path);
    # `postgresql+psycopg://user:pass@host/db` for a database several processes can share.
    db_url: str | None = Field(default_factory=lambda: os.environ.get("TINKERD_DB_URL") or None)
    base_models: list[str] = Field(default_factory=lambda: [DEFAULT_BASE_MODEL])
    # A key to register for the local account at start (tests, scripts); None = create one on
    # first start and keep it in the data directory.
    api_key: str | None = None
    # LoRA scaling is alpha / rank; 32 is the value Tinker documents and what exports carry.
    lora_alpha: float = 32.0
    max_lora_rank: int = 256
    # Long-poll hold for retrieve_future: below the SDK's 45 s read timeout.
    retrieve_future_timeout_s: float = 20.0
    # forward_backward bodies: the SDK chunks at ~5 MB estimated; leave headroom.
    max_body_bytes: int = 64 * 1024 * 1024
    # GET .../checkpoints/{name}/archive (hpcai's download, api/routes/archive.py): the most checkpoint
    # bytes one archive streams. A rank-32 adapter of an 8B model with its AdamW state is ~0.5 GB.
    max_archive_bytes: int = Field(default=8 * 1024**3, gt=0)
    # The HTTP edge (api/connection.py, cli/serve.py). Deadlines for reading one request, never
    # extended by trickled bytes: the head within request_head_timeout_s of the connection opening
    # (or of the next request's first byte), the body within request_body_timeout_s of the head. An
    # SDK head is ~1 KB sent in one write, so 10 s only ever cuts off a stalled or hostile client; 60 s
    # takes the SDK's ~5 MB forward_backward chunks at 85 KB/s (the 64 MiB max_body_bytes needs
    # 1.1 MB/s). Then the connection is closed; the SDK retries a dropped connection.
    request_head_timeout_s: float = Field(default=10.0, gt=0)
    request_body_timeout_s: float = Field(default=60.0, gt=0)
    # An idle kept-alive connection is closed after this. Longer than the SDK's 5 s (httpx) idle
    # expiry, so the client, not the server, ends idle connections: no request races a server close.
    # A proxy's upstream keep-alive must be shorter than this, for the same reason.
    keep_alive_timeout_s: float = Field(default=75.0, gt=0)
    # Open connections (idle, reading and long-polling ones alike) before new requests get 503, which
    # the SDK retries. The SDK's own pool allows 1000 per client; each connection is a file descriptor,
    # so `ulimit -n` must be above this (serve warns when it is not).
    max_connections: int = Field(default=2048, ge=1)
    # The listen queue of connections not yet accepted (the kernel caps it at net.core.somaxconn).
    listen_backlog: int = Field(default=2048, ge=1)
    # A request head (request line and headers) larger than this is a 400 from h11 and a close. SDK
    # heads are ~1 KB; 16 KiB (h11's default) leaves room for a proxy's X-Forwarded-* headers.
    max_request_head_bytes: int = Field(default=16 * 1024, ge=1024)
    max_sample_tokens_default: int = 256
    # ImageChunks (vision-language models, tinkerd/images.py): the encoded bytes of all images of one
    # request, and the pixels (width x height, read from the header before decoding) of one image.
    # 16 Mi pixels is the Qwen3-VL/3.5 processors' max_pixels: a larger image is only scaled down to
    # it, after its decode took 3 bytes a pixel (a 100-megapixel PNG: 300 MB).
    max_image_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    max_image_pixels: int = Field(default=16 * 1024 * 1024, gt=0)
    # GET /metrics (Prometheus, unauthenticated: control/metrics.py says why); False answers 404.
    metrics: bool = True
    # OpenTelemetry spans per op (control/tracing.py) go to this OTLP/HTTP endpoint; None: no tracing.
    # Default: OpenTelemetry's own variables, the traces-specific one first (as its SDKs read them).
    otlp_endpoint: str | None = Field(default_factory=lambda: os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                                      or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)
    max_num_samples: int = 128
    # The sampler's KV cache budget in GiB (None: a quarter of the device's memory). A sample request
    # that alone needs more is refused; others wait until rows leave instead of exhausting memory.
    sample_kv_cache_gb: float | None = Field(default=None, gt=0)
    torch_threads: int | None = None
    # Where the engine computes and in which dtype (engine/precision.py, docs/precision.md). float32 is
    # the exact path, pinned to HF + PEFT at 1e-5; bfloat16 keeps the base model and activations in
    # bf16 and the LoRA weights, gradients and AdamW state in fp32, within the stated tolerances.
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    # "process": the engine runs in a child process that is restarted and rebuilt if it dies;
    # "thread": in the server process (no crash isolation, no pipe).
    engine: Literal["process", "thread"] = "process"
    # Which part of the server this process is (docs/deployment.md). "all": API, control and engine
    # in one process (the embedded default). On one shared PostgreSQL (db_url): "api", a stateless
    # replica that stores ops and answers from the database, no engine; "worker", the one engine
    # driver, which claims the ops api replicas stored, runs them and stores their results.
    role: Literal["all", "api", "worker"] = "all"
    # Rank processes forming the one engine (engine/sharding.py, docs/sharding.md): above 1 the base
    # model's decoder is sharded across them with FSDP2 and each forward_backward's datums are split
    # between them. Needs the process engine; with --device cuda, one GPU per rank.
    engine_ranks: int = Field(default=1, ge=1)
    # Ray placement (engine/ray_engine.py): each base model's engine a Ray actor of the cluster at
    # this address ("local": a private Ray on this machine, sized to the actors); None: `engine` above.
    ray_address: str | None = None
    # Each actor's Ray resources: its CPUs also size its torch threads unless torch_threads is set.
    ray_num_cpus: float = Field(default=1.0, gt=0)
    ray_num_gpus: float = Field(default=0.0, ge=0)
    # Most tokens (all datums' tokens) one training step carries when forward_backward ops of several
    # runs on one base model share a pass (control/scheduler.py, engine/cotrain.py); the step's first
    # op goes whatever its size. Activations grow with it: ~1.2 MB per token on SmolLM2-135M in fp32,
    # so 2048 tokens (4 runs of 2 x 256, issue 20's multi-tenant case) hold ~2.5 GB. 0: one op a step.
    train_batch_tokens: int = Field(default=2048, ge=0)
    # Least seconds between two recovery snapshots of a run (taken after an optim_step). A rank-32
    # SmolLM2 adapter with its AdamW state is ~120 MB: after every 5 s step that cost ~7% of
    # throughput (benchmarks/training.py); every 10 s bounds replay to ~10 s of recompute.
    snapshot_interval_s: float = 10.0
    # A forward_backward whose loss or gradients are NaN or inf, or an optim_step whose update would
    # leave weights or AdamW state so, fails with a user error and changes nothing (engine/training.py).
    # True applies them anyway: for studying divergence. It is server-wide because the SDK's request
    # schemas are fixed and carry no field for it.
    allow_non_finite: bool = False
    # A session whose last heartbeat (the SDK sends one every 10 s) and whose runs' last requests
    # are all older than this has its adapters released from the engine: training adapters are
    # snapshotted first and rebuilt, bit-exact, on the run's next op. 300 s is 30 missed
    # heartbeats, well past the SDK's own 120 s warning. 0 never releases a quiet session's runs (an
    # ended session's runs are released at once either way).
    session_expiry_s: float = Field(default=300.0, ge=0)
    # Retention of finished futures (control/retention.py): a result or error expires this long
    # after retrieve_future first handed it out (room for a re-poll after a lost response: 20x the
    # SDK's 30 s longest reconnect backoff), or this long after its op finished if never retrieved;
    # an expired future is remembered as expired for future_tombstone_s, then deleted. Ops recovery
    # still replays are never deleted.
    future_retrieved_grace_s: float = Field(default=600.0, gt=0)
    future_max_age_s: float = Field(default=86400.0, gt=0)
    future_tombstone_s: float = Field(default=86400.0, gt=0)
    # Sequences sampled with record_stability_info (control/stability.py) can be trained on with
    # stable_reinforce this long after sampling, each training request that names one restarting
    # the clock (the Tinker docs: one day); expired ones answer "expired" for the same time again.
    recorded_sequence_ttl_s: float = Field(default=86400.0, gt=0)
    # save_weights_and_get_sampling_client writes a sampler per call (an RL loop: one per step).
    # The newest this many per session are kept; older ones are deleted once no queued or decoding
    # request uses them, and asking for one later is a 404.
    ephemeral_samplers_kept: int = Field(default=4, ge=1)
    # Prices for billing estimates (GET /api/v1/billing/usage/*, `tinkerd usage`), gross USD. Applied
    # when usage is read; queue wait is never billed. Forward-only passes are billed as training.
    price_train_usd_per_mtok: float = 3.0
    price_forward_usd_per_mtok: float = 1.0
    price_prefill_usd_per_mtok: float = 0.5
    price_sample_usd_per_mtok: float = 1.5
    price_storage_usd_per_gb_month: float = 0.0
    # Per-account quotas, the server-wide defaults (an account's own values, set with
    # `tinkerd accounts set-quota`, replace them); None = unlimited. An op over a quota is never
    # failed: it waits in the queue and its retrieve_future answers try_again "paused_rate_limit".
    # Concurrent runs: the account's runs the engine holds (an ended session's runs are released at
    # once, a quiet one's after session_expiry_s; a released run used again waits for a place).
    max_concurrent_runs: int | None = Field(default=None, ge=1)
    # Trained + forward + prefill + sampled tokens per minute, over a sliding window.
    max_tokens_per_minute: int | None = Field(default=None, ge=1)
    # The sliding window's length; the budget in it is max_tokens_per_minute * window / 60. 60 s
    # except in tests, where a short window lets a paused op resume in seconds.
    quota_window_s: float = Field(default=60.0, gt=0)
    # Back-pressure (control/backpressure.py): ops waiting in the queue of one target (a training run
    # or a sampling session) and on the whole server. A new op beyond either is answered 429 with
    # Retry-After, which the SDK retries after backing off; accepted ops are never dropped. 256 is
    # minutes of training steps or a GRPO batch of sample requests; 4096 such ops of a few MB each
    # bound the queue's memory. None = unbounded.
    max_queued_ops_per_model: int | None = Field(default=256, ge=1)
    max_queued_ops: int | None = Field(default=4096, ge=1)
    # Free space the data directory keeps for work already accepted (results, saves, snapshots):
    # under it new sessions and ops are refused with a 503 naming the cause. None: min(1 GiB, 5% of
    # the filesystem), see control/diskspace.py for why; 0 never refuses.
    min_free_disk_gb: float | None = Field(default=None, ge=0)

    def token_price_usd_per_mtok(self, kind: str) -> float:
        """The price of a metered token kind (a UsageRow column name)."""
        return {"trained_tokens": self.price_train_usd_per_mtok, "forward_tokens": self.price_forward_usd_per_mtok,
                "prefill_tokens": self.price_prefill_usd_per_mtok, "sampled_tokens": self.price_sample_usd_per_mtok}[kind]

    @property
    def sample_kv_cache_bytes(self) -> int | None:
        return None if self.sample_kv_cache_gb is None else int(self.sample_kv_cache_gb * 2**30)

    @property
    def min_free_disk_bytes(self) -> int | None:
        return None if self.min_free_disk_gb is None else int(self.min_free_disk_gb * 2**30)

    @property
    def db_path(self) -> Path:
        return self.data_dir / "tinkerd.sqlite"

    @property
    def checkpoints_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"
