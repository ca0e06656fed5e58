"""ServerConfig: the only place environment variables are read."""

from __future__ import annotations

import os
from pathlib import Path

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


class ServerConfig(BaseModel):
    """Every setting of a server. Each field is a `tinkerd serve` flag (cli/flags.py: `--` + the
    field with dashes, its description the help, its default the default) and a row of
    docs/configuration.md's tables; tests/unit/test_config_flags.py keeps the three together."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(default="127.0.0.1", description="the address the API listens on")
    port: int = Field(default=8000, ge=0, le=65535,
                      description="the port the API listens on; 0 picks a free port (printed in the ready line)")
    data_dir: Path = Field(default_factory=lambda: Path(os.environ.get("TINKERD_DATA_DIR", "~/.tinkerd")).expanduser(),
                           description="all state: the SQLite store, checkpoints, recovery snapshots, converted models "
                                       "(default: $TINKERD_DATA_DIR, else ~/.tinkerd)")
    # The durable store (control/store/db.py): None = SQLite in the data directory (db_path).
    db_url: str | None = Field(default_factory=lambda: os.environ.get("TINKERD_DB_URL") or None,
                               description="the store: postgresql+psycopg://user:pass@host/db, a database several "
                                           "processes can share (default: $TINKERD_DB_URL, else SQLite in the data "
                                           "directory)")
    base_models: list[str] = Field(default_factory=lambda: [DEFAULT_BASE_MODEL],
                                   description="a model to serve, repeatable: a local HF directory or a hub name "
                                               f"(docs/models.md) (default: {DEFAULT_BASE_MODEL})")
    # For tests and scripts that need to know the key before the server prints it.
    api_key: str | None = Field(default=None, description="register this tml- key for the local account (default: a "
                                                          "random key is created on first start and kept in the data "
                                                          "directory)")
    # 32 is the value Tinker documents and what exports carry (adapter_config.json's lora_alpha).
    lora_alpha: float = Field(default=32.0, gt=0, description="LoRA alpha of new runs: their scaling is alpha / rank")
    max_lora_rank: int = Field(default=256, ge=1,
                               description="highest LoRA rank create_model and load_weights accept; runs accepted "
                                           "under a higher one still recover (docs/op-contract.md)")
    # Below the SDK's 45 s read timeout.
    retrieve_future_timeout_s: float = Field(default=20.0, gt=0, description="how long retrieve_future holds a poll "
                                                                             "for a pending op before try_again")
    # forward_backward bodies: the SDK chunks at ~5 MB estimated; leave headroom.
    max_body_bytes: int = Field(default=64 * 1024 * 1024, gt=0,
                                description="largest request body, after zstd decompression too; larger is a 413")
    # GET .../checkpoints/{name}/archive is hpcai's download (api/routes/archive.py). A rank-32 adapter
    # of an 8B model with its AdamW state is ~0.5 GB.
    max_archive_bytes: int = Field(default=8 * 1024**3, gt=0,
                                   description="most checkpoint bytes one checkpoint archive download streams")
    # The HTTP edge (api/connection.py, cli/serve.py). Deadlines for reading one request, never
    # extended by trickled bytes: the head within request_head_timeout_s of the connection opening
    # (or of the next request's first byte), the body within request_body_timeout_s of the head. An
    # SDK head is ~1 KB sent in one write, so 10 s only ever cuts off a stalled or hostile client; 60 s
    # takes the SDK's ~5 MB forward_backward chunks at 85 KB/s (the 64 MiB max_body_bytes needs
    # 1.1 MB/s). Then the connection is closed; the SDK retries a dropped connection.
    request_head_timeout_s: float = Field(default=10.0, gt=0,
                                          description="close a connection whose request head is not complete this "
                                                      "long after it opened or after the request's first byte")
    request_body_timeout_s: float = Field(default=60.0, gt=0, description="close a connection whose request body is "
                                                                          "not complete this long after its head")
    # An idle kept-alive connection is closed after this. Longer than the SDK's 5 s (httpx) idle
    # expiry, so the client, not the server, ends idle connections: no request races a server close.
    # A proxy's upstream keep-alive must be shorter than this, for the same reason.
    keep_alive_timeout_s: float = Field(default=75.0, gt=0,
                                        description="close an idle kept-alive connection after this long")
    # Open connections (idle, reading and long-polling ones alike) before new requests get 503, which
    # the SDK retries. The SDK's own pool allows 1000 per client; each connection is a file descriptor,
    # so `ulimit -n` must be above this (serve warns when it is not).
    max_connections: int = Field(default=2048, ge=1, description="open connections before new requests get 503, "
                                                                 "which the SDK retries")
    listen_backlog: int = Field(default=2048, ge=1, description="connections waiting to be accepted (the kernel caps "
                                                                "it at net.core.somaxconn)")
    # A request head (request line and headers) larger than this is a 400 from h11 and a close. SDK
    # heads are ~1 KB; 16 KiB (h11's default) leaves room for a proxy's X-Forwarded-* headers.
    max_request_head_bytes: int = Field(default=16 * 1024, ge=1024,
                                        description="largest request line plus headers; larger is a 400")
    max_sample_tokens_default: int = Field(default=256, ge=1,
                                           description="max_tokens of a sample request that sets none")
    # ImageChunks (vision-language models, tinkerd/images.py). 16 Mi pixels is the Qwen3-VL/3.5
    # processors' max_pixels: a larger image is only scaled down to it, after its decode took 3 bytes a
    # pixel (a 100-megapixel PNG: 300 MB).
    max_image_bytes: int = Field(default=32 * 1024 * 1024, gt=0,
                                 description="encoded bytes of all images of one request (vision-language models)")
    max_image_pixels: int = Field(default=16 * 1024 * 1024, gt=0, description="pixels (width x height, read from the "
                                                                              "header before decoding) of one image")
    # Prometheus, unauthenticated: control/metrics.py says why.
    metrics: bool = Field(default=True, description="serve GET /metrics (without an API key; docs/configuration.md); "
                                                    "--no-metrics answers 404 and counts nothing")
    # control/tracing.py. The default is OpenTelemetry's own variables, the traces-specific one first
    # (as its SDKs read them).
    otlp_endpoint: str | None = Field(default_factory=lambda: os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                                      or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
                                      description="send OpenTelemetry spans per op to this OTLP/HTTP endpoint "
                                                  "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else "
                                                  "$OTEL_EXPORTER_OTLP_ENDPOINT; unset: no tracing)")
    max_num_samples: int = Field(default=128, ge=1, description="most num_samples one sample request asks for")
    # Others wait until rows leave instead of exhausting memory.
    sample_kv_cache_gb: float | None = Field(default=None, gt=0,
                                             description="memory the sampler's KV cache may take, in GiB (default: a "
                                                         "quarter of the device's); a sample request needing more "
                                                         "alone is refused, others wait for room")
    # engine/recompute.py: past it a decoder call keeps each layer's input alone and replays the layer
    # in the backward, with the same bits. The default follows the memory free at each call.
    activation_memory_gb: float | None = Field(default=None, ge=0,
                                               description="memory a training pass's activations may hold for "
                                                           "its backward, in GiB (default: 80% of what is free "
                                                           "when each decoder call starts); past it the fewest "
                                                           "layers that fit replay their forward in the backward, "
                                                           "~40% more time each, the same numbers (0: all, always)")
    # 0 is torch's choice too (EngineSpec treats it as unset).
    torch_threads: int | None = Field(default=None, ge=0,
                                      description="torch intra-op threads of the engine (default: torch's choice)")
    # engine/precision.py, docs/precision.md. float32 is the exact path, pinned to HF + PEFT at 1e-5;
    # bfloat16 keeps the LoRA weights, gradients and AdamW state in fp32, within the stated tolerances.
    device: Literal["cpu", "cuda"] = Field(default="cpu", description="where the engine computes")
    dtype: Literal["float32", "bfloat16"] = Field(default="float32",
                                                  description="base model and activation dtype (float32: exact); "
                                                              "bfloat16 keeps LoRA weights and AdamW state in fp32 "
                                                              "(docs/precision.md)")
    # "thread" has no crash isolation and no pipe.
    engine: Literal["process", "thread"] = Field(default="process",
                                                 description="process: the engine in its own process, restarted and "
                                                             "rebuilt if it dies; thread: in the server process")
    # "api" stores ops and answers from the database, no engine; "worker" claims the ops api replicas
    # stored, runs them and stores their results.
    role: Literal["all", "api", "worker"] = Field(default="all",
                                                  description="all: the whole server in one process; on a shared "
                                                              "PostgreSQL (--db-url): api, a stateless replica for a "
                                                              "load balancer, or worker, the one engine driver "
                                                              "(docs/deployment.md)")
    # engine/sharding.py: each forward_backward's datums are split between the ranks. With --device
    # cuda, one GPU per rank.
    engine_ranks: int = Field(default=1, ge=1,
                              description="rank processes of the engine; above 1 the base model is FSDP2-sharded "
                                          "across them (gloo on CPU, NCCL on CUDA; docs/sharding.md); needs --engine "
                                          "process")
    # engine/ray_engine.py. "local" is sized to the actors.
    ray_address: str | None = Field(default=None,
                                    description="run each base model's engine as a Ray actor on this Ray cluster (an "
                                                "address, 'auto', or 'local' for a private Ray on this machine) "
                                                "(default: the embedded engine, --engine)")
    ray_num_cpus: float = Field(default=1.0, gt=0, description="Ray CPUs per engine actor; also its torch threads "
                                                               "unless --threads is given")
    ray_num_gpus: float = Field(default=0.0, ge=0, description="Ray GPUs per engine actor")
    # control/scheduler.py, engine/cotrain.py; the step's first op goes whatever its size. Activations
    # grow with it: ~1.2 MB per token on SmolLM2-135M in fp32, so 2048 tokens (4 runs of 2 x 256, issue
    # 20's multi-tenant case) hold ~2.5 GB.
    train_batch_tokens: int = Field(default=2048, ge=0,
                                    description="most tokens of one training step whose forward_backward ops of "
                                                "several runs share a pass over the base model (their optim_steps then share a "
                                                "step too); 0: one op a step")
    # control/scheduler.py: Scheduler._together. An SDK loop's next forward_backward comes tens of ms
    # after its optim_step's result; without the wait, the run whose optim_step ran last took a pass
    # of its own every round (4 tenants of 1 x 32 tokens on SmolLM2).
    train_batch_wait_ms: float = Field(default=50.0, ge=0,
                                       description="longest wait of a shared training pass for the next forward_backward "
                                                   "of a run that was in the last one and has none queued (at most a "
                                                   "tenth of that pass's time); 0: never wait")
    # A rank-32 SmolLM2 adapter with its AdamW state is ~120 MB: after every 5 s step that cost ~7% of
    # throughput (benchmarks/training.py); every 10 s bounds replay to ~10 s of recompute.
    snapshot_interval_s: float = Field(default=10.0, ge=0, description="least seconds between a run's recovery "
                                                                       "snapshots, taken after an optim_step")
    # control/recovery.py: four tenants on 2 CPU cores ran ~6% slower with a snapshot of each every 10 s.
    snapshot_budget: float = Field(default=0.05, gt=0, le=1, description="largest share of the engine's time "
                                   "recovery snapshots may take; beyond it each run's snapshots are spaced further "
                                   "apart than --snapshot-interval-s (1: no limit)")
    # engine/training.py. For studying divergence. It is server-wide because the SDK's request schemas
    # are fixed and carry no field for it.
    allow_non_finite: bool = Field(default=False,
                                   description="apply training steps whose loss, gradients or update are NaN or inf "
                                               "(off: such a step fails with a user error and changes nothing)")
    # control/checkpoints.py: CheckpointSweeper. Expired checkpoints are hidden from the API at once; only this
    # sweep deletes their files, off every request path.
    checkpoint_sweep_interval_s: float = Field(default=60.0, gt=0,
                                               description="how often files of expired checkpoints are deleted")
    # The SDK heartbeats every 10 s: 300 s is 30 missed heartbeats, well past the SDK's own 120 s
    # warning. Training adapters are snapshotted first and rebuilt, bit-exact, on the run's next op.
    session_expiry_s: float = Field(default=300.0, ge=0,
                                    description="release the engine adapters of a session silent (no heartbeat, no "
                                                "request) this long; they are rebuilt exactly on its next op (0: "
                                                "never, though an ended session's runs always go at once)")
    # Retention of finished futures (control/retention.py): a result or error expires this long
    # after retrieve_future first handed it out (room for a re-poll after a lost response: 20x the
    # SDK's 30 s longest reconnect backoff), or this long after its op finished if never retrieved;
    # an expired future is remembered as expired for future_tombstone_s, then deleted. Ops recovery
    # still replays are never deleted.
    future_retrieved_grace_s: float = Field(default=600.0, gt=0,
                                            description="a finished future's result is deleted this long after it "
                                                        "was first retrieved")
    future_max_age_s: float = Field(default=86400.0, gt=0,
                                    description="a finished future's result is deleted this long after its op "
                                                "finished, even if never retrieved")
    future_tombstone_s: float = Field(default=86400.0, gt=0,
                                      description="an expired future answers 'expired' to its owner this long, then "
                                                  "is forgotten")
    # control/stability.py. One day is the Tinker docs' value; expired ones answer "expired" for the
    # same time again.
    recorded_sequence_ttl_s: float = Field(default=86400.0, gt=0,
                                           description="sequences sampled with record_stability_info can be trained "
                                                       "on (stable_reinforce) this long after sampling or their last "
                                                       "use")
    # save_weights_and_get_sampling_client writes a sampler per call (an RL loop: one per step). Older
    # ones are deleted once no queued or decoding request uses them; asking for one later is a 404.
    ephemeral_samplers_kept: int = Field(default=4, ge=1,
                                         description="save_weights_and_get_sampling_client samplers kept per "
                                                     "session, newest first; older unused ones are deleted")
    # Prices for billing estimates (GET /api/v1/billing/usage/*, the console, `tinkerd usage`), gross
    # USD. Applied when usage is read; queue wait is never billed. Forward-only passes are billed as
    # training.
    price_train_usd_per_mtok: float = Field(default=3.0, ge=0, description="USD per million trained tokens")
    price_forward_usd_per_mtok: float = Field(default=1.0, ge=0,
                                              description="USD per million tokens of forward-only passes")
    price_prefill_usd_per_mtok: float = Field(default=0.5, ge=0, description="USD per million sampling prompt tokens")
    price_sample_usd_per_mtok: float = Field(default=1.5, ge=0, description="USD per million sampled tokens")
    price_storage_usd_per_gb_month: float = Field(default=0.0, ge=0,
                                                  description="USD per GB-month of checkpoint storage")
    # Per-account quotas, the server-wide defaults (an account's own values, set with
    # `tinkerd accounts set-quota`, replace them); None = unlimited. An op over a quota is never
    # failed: it waits in the queue and its retrieve_future answers try_again "paused_rate_limit".
    # Concurrent runs: the account's runs the engine holds (an ended session's runs are released at
    # once, a quiet one's after session_expiry_s; a released run used again waits for a place).
    max_concurrent_runs: int | None = Field(default=None, ge=1,
                                            description="default per-account limit on training runs the engine "
                                                        "holds (default: unlimited; per account: tinkerd accounts "
                                                        "set-quota)")
    max_tokens_per_minute: int | None = Field(default=None, ge=1,
                                              description="default per-account limit on trained+forward+prefill+"
                                                          "sampled tokens per minute, over a sliding window (default: "
                                                          "unlimited); ops over it wait, they never fail")
    # The budget in it is max_tokens_per_minute * window / 60. 60 s except in tests, where a short
    # window lets a paused op resume in seconds.
    quota_window_s: float = Field(default=60.0, gt=0, description="the tokens-per-minute sliding window")
    # Back-pressure (control/backpressure.py): ops waiting in the queue of one target (a training run
    # or a sampling session) and on the whole server. A new op beyond either is answered 429 with
    # Retry-After, which the SDK retries after backing off; accepted ops are never dropped. 256 is
    # minutes of training steps or a GRPO batch of sample requests; 4096 such ops of a few MB each
    # bound the queue's memory. None = unbounded.
    max_queued_ops_per_model: int | None = Field(default=256, ge=1,
                                                 description="ops waiting per training run or sampling session before "
                                                             "new ones are answered 429, which the SDK retries; 0: no "
                                                             "bound")
    max_queued_ops: int | None = Field(default=4096, ge=1, description="ops waiting on the whole server before new "
                                                                       "ones are answered 429; 0: no bound")
    # None: min(1 GiB, 5% of the filesystem), see control/diskspace.py for why.
    min_free_disk_gb: float | None = Field(default=None, ge=0,
                                           description="free space (GiB) the data directory keeps for accepted work "
                                                       "(results, saves, snapshots); under it new sessions and ops "
                                                       "are refused with 503 (default: 1, or 5% of the filesystem if "
                                                       "less; 0: never refuse)")

    def token_price_usd_per_mtok(self, kind: str) -> float:
        """The price of a metered token kind (a UsageRecord field name)."""
        return {"trained_tokens": self.price_train_usd_per_mtok, "forward_tokens": self.price_forward_usd_per_mtok,
                "prefill_tokens": self.price_prefill_usd_per_mtok, "sampled_tokens": self.price_sample_usd_per_mtok}[kind]

    @property
    def sample_kv_cache_bytes(self) -> int | None:
        return None if self.sample_kv_cache_gb is None else int(self.sample_kv_cache_gb * 2**30)

    @property
    def activation_memory_bytes(self) -> int | None:
        return None if self.activation_memory_gb is None else int(self.activation_memory_gb * 2**30)

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
