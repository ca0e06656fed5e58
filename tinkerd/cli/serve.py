"""`tinkerd serve`: the API, the control plane and the in-process engine on one machine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import uvicorn

from tinkerd.cli import LOG_FORMAT
from tinkerd.config import DEFAULT_BASE_MODEL, ServerConfig
from tinkerd.errors import UserError

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the server on embedded defaults (SQLite, in-process engine)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed in the ready line)")
    p.add_argument("--data-dir", type=Path, default=None, help="default: $TINKERD_DATA_DIR or ~/.tinkerd")
    p.add_argument("--db-url", default=None, help="the store: postgresql+psycopg://user:pass@host/db "
                   "(default: $TINKERD_DB_URL, else SQLite in the data directory)")
    p.add_argument("--base-model", action="append", dest="base_models", default=None,
                   help=f"a model to serve; repeatable (default: {DEFAULT_BASE_MODEL})")
    p.add_argument("--api-key", default=None,
                   help="register this tml- key for the local account (default: a random key is created on first start)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="where the engine computes (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="base model and activation dtype (default float32, exact); bfloat16 keeps LoRA weights "
                        "and AdamW state in fp32 (docs/precision.md)")
    p.add_argument("--engine", choices=["process", "thread"], default=None,
                   help="process (default): the engine in its own process, restarted and rebuilt if it dies; "
                        "thread: in the server process")
    p.add_argument("--role", choices=["all", "api", "worker"], default=None,
                   help="all (default): the whole server in one process; on a shared PostgreSQL (--db-url): api, a "
                        "stateless replica for a load balancer, or worker, the one engine driver (docs/deployment.md)")
    p.add_argument("--engine-ranks", type=_positive_int, default=None,
                   help="rank processes of the engine; above 1 the base model is FSDP2-sharded across them "
                        "(gloo on CPU, NCCL on CUDA; docs/sharding.md) (default 1)")
    p.add_argument("--ray-address", default=None,
                   help="run each base model's engine as a Ray actor on this Ray cluster (an address, 'auto', or "
                        "'local' for a private Ray on this machine); default: the embedded engine (--engine)")
    p.add_argument("--ray-num-cpus", type=_positive, default=None, help="CPUs per engine actor (default 1)")
    p.add_argument("--ray-num-gpus", type=float, default=None, help="GPUs per engine actor (default 0)")
    p.add_argument("--snapshot-interval-s", type=float, default=None,
                   help="least seconds between a run's recovery snapshots, taken after an optim_step (default 10)")
    p.add_argument("--train-batch-tokens", type=int, default=None,
                   help="most tokens of one training step whose forward_backward ops of several runs share a pass "
                        "over the base model (default 2048; 0: one op a step)")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="apply training steps whose loss, gradients or update are NaN or inf (default: such a "
                        "step fails with a user error and changes nothing)")
    p.add_argument("--checkpoint-sweep-interval-s", type=_positive, default=60.0,
                   help="how often files of expired checkpoints are deleted (default: 60)")
    p.add_argument("--session-expiry-s", type=float, default=None,
                   help="release the engine adapters of a session silent (no heartbeat, no request) this long; "
                        "they are rebuilt exactly on its next op (default 300; 0: never, though an ended session's runs always go at once)")
    p.add_argument("--ephemeral-samplers-kept", type=_positive_int, default=None,
                   help="save_weights_and_get_sampling_client samplers kept per session, newest first; "
                        "older unused ones are deleted (default 4)")
    p.add_argument("--max-lora-rank", type=_positive_int, default=None,
                   help="highest LoRA rank create_model and load_weights accept (default 256); runs accepted "
                        "under a higher one still recover (docs/op-contract.md)")
    p.add_argument("--max-concurrent-runs", type=_positive_int, default=None,
                   help="default per-account limit on training runs of open sessions (default: unlimited; "
                        "per account: tinkerd accounts set-quota)")
    p.add_argument("--max-tokens-per-minute", type=_positive_int, default=None,
                   help="default per-account limit on trained+forward+prefill+sampled tokens per minute "
                        "(default: unlimited); ops over it wait, they never fail")
    p.add_argument("--quota-window-s", type=_positive, default=None,
                   help="the tokens-per-minute sliding window (default 60; shorter for tests)")
    p.add_argument("--max-queued-ops-per-model", type=_bound, default=None,
                   help="ops waiting per training run or sampling session before new ones are answered 429, "
                        "which the SDK retries (default 256; 0: no bound)")
    p.add_argument("--max-queued-ops", type=_bound, default=None,
                   help="ops waiting on the whole server before new ones are answered 429 (default 4096; 0: no bound)")
    p.add_argument("--sample-kv-cache-gb", type=_positive, default=None,
                   help="memory the sampler's KV cache may take, in GiB (default: a quarter of the machine's); "
                        "a sample request needing more alone is refused, others wait for room")
    p.add_argument("--future-retrieved-grace-s", type=_positive, default=None,
                   help="a finished future's result is deleted this long after it was first retrieved (default 600)")
    p.add_argument("--future-max-age-s", type=_positive, default=None,
                   help="a finished future's result is deleted this long after its op finished, even if never retrieved (default 86400)")
    p.add_argument("--future-tombstone-s", type=_positive, default=None,
                   help="an expired future answers 'expired' to its owner this long, then is forgotten (default 86400)")
    p.add_argument("--recorded-sequence-ttl-s", type=_positive, default=None,
                   help="sequences sampled with record_stability_info can be trained on (stable_reinforce) this long "
                        "after sampling or their last use (default 86400)")
    p.add_argument("--min-free-disk-gb", type=float, default=None,
                   help="free space (GiB) the data directory keeps for accepted work; under it new sessions and ops "
                        "are refused with 503 (default: 1, or 5%% of the filesystem if less; 0: never refuse)")
    p.add_argument("--retrieve-future-timeout-s", type=_positive, default=None,
                   help="how long retrieve_future holds a pending request before try_again (default 20)")
    p.add_argument("--no-metrics", dest="metrics", action="store_false",
                   help="do not serve GET /metrics (default: served without a key; docs/configuration.md)")
    p.add_argument("--otlp-endpoint", default=None,
                   help="send OpenTelemetry spans per op to this OTLP/HTTP endpoint (default: "
                        "$OTEL_EXPORTER_OTLP_ENDPOINT; unset: no tracing)")
    edge = p.add_argument_group("HTTP connections (docs/configuration.md: behind a proxy)")
    edge.add_argument("--request-head-timeout-s", type=_positive, default=None,
                      help="close a connection whose request head is not complete this long after it opened "
                           "or after the request's first byte (default 10)")
    edge.add_argument("--request-body-timeout-s", type=_positive, default=None,
                      help="close a connection whose request body is not complete this long after its head (default 60)")
    edge.add_argument("--keep-alive-timeout-s", type=_positive, default=None,
                      help="close an idle kept-alive connection after this long (default 75)")
    edge.add_argument("--max-connections", type=_positive_int, default=None,
                      help="open connections before new requests get 503, which the SDK retries (default 2048)")
    edge.add_argument("--listen-backlog", type=_positive_int, default=None,
                      help="connections waiting to be accepted (default 2048)")
    edge.add_argument("--max-request-head-bytes", type=_positive_int, default=None,
                      help="largest request line plus headers; larger is a 400 (default 16384)")
    p.set_defaults(func=run)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _bound(text: str) -> int | str:
    """A positive integer, or 0 for no bound ("none", kept apart from not given)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (no bound) or a positive integer, got {text}")
    return value or "none"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_config(args) -> ServerConfig:
    values = {"host": args.host, "port": args.port}
    if args.data_dir is not None:
        values["data_dir"] = args.data_dir.expanduser().resolve()
    if args.db_url:
        values["db_url"] = args.db_url
    if args.base_models:
        values["base_models"] = args.base_models
    if args.api_key:
        values["api_key"] = args.api_key
    if args.threads:
        values["torch_threads"] = args.threads
    if args.engine:
        values["engine"] = args.engine
    if getattr(args, "role", None):
        values["role"] = args.role
    if args.engine_ranks:
        values["engine_ranks"] = args.engine_ranks
    for name in ("ray_address", "ray_num_cpus", "ray_num_gpus"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    for name in ("device", "dtype"):
        if getattr(args, name, None):
            values[name] = getattr(args, name)
    if args.snapshot_interval_s is not None:
        values["snapshot_interval_s"] = args.snapshot_interval_s
    if args.allow_non_finite:
        values["allow_non_finite"] = True
    if args.session_expiry_s is not None:
        values["session_expiry_s"] = args.session_expiry_s
    if args.ephemeral_samplers_kept is not None:
        values["ephemeral_samplers_kept"] = args.ephemeral_samplers_kept
    for name in ("max_lora_rank", "max_concurrent_runs", "max_tokens_per_minute", "quota_window_s", "retrieve_future_timeout_s",
                 "sample_kv_cache_gb", "future_retrieved_grace_s", "future_max_age_s", "future_tombstone_s",
                 "recorded_sequence_ttl_s", "min_free_disk_gb", "request_head_timeout_s", "request_body_timeout_s", "keep_alive_timeout_s",
                 "max_connections", "listen_backlog", "max_request_head_bytes", "train_batch_tokens"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    for name in ("max_queued_ops_per_model", "max_queued_ops"):
        if getattr(args, name) is not None:
            values[name] = None if getattr(args, name) == "none" else getattr(args, name)
    if not args.metrics:
        values["metrics"] = False
    if args.otlp_endpoint:  # else ServerConfig reads $OTEL_EXPORTER_OTLP_*: the only place env vars are read
        values["otlp_endpoint"] = args.otlp_endpoint
    return ServerConfig(**values)


def build_app(config: ServerConfig, client=None):
    """Wire store, engine, control plane and API from one config. `client`: an engine client already
    started (`run` spawns the engine child before anything else); None starts one here."""
    from tinkerd.api.app import create_app
    from tinkerd.api.deps import AppState
    from tinkerd.api import legacy
    from tinkerd.artifacts import LocalArtifactStore
    from tinkerd.cli.tokenizers import Tokenizers
    from tinkerd.control.accounts import Accounts
    from tinkerd.control.audit import AuditLog
    from tinkerd.control.backpressure import QueueBudget
    from tinkerd.control.control import Control
    from tinkerd.control.diskspace import DiskReserve
    from tinkerd.control.quotas import Quotas
    from tinkerd.control.recovery import Recovery
    from tinkerd.control.residency import Residency
    from tinkerd.control.retention import FutureRetention
    from tinkerd.control.runs import Runs
    from tinkerd.control.stability import StabilityRecords
    from tinkerd.control.stepmetrics import StepMetrics
    from tinkerd.control.store.db import Store
    from tinkerd.control.tokens import Tokens

    from tinkerd.control import replicas

    config.data_dir.mkdir(parents=True, exist_ok=True)
    if client is None and config.role != "api":  # an api replica has no engine (docs/deployment.md)
        client = build_engine_client(config)
    store = Store.open(config)
    replicas.check(config.role, store)
    worker_id = replicas.worker_id(config.role)
    reserve = DiskReserve(config.data_dir, config.min_free_disk_bytes)
    artifacts = LocalArtifactStore(config.data_dir)  # checkpoints, snapshots, exports (tinkerd/artifacts.py)
    recovery = Recovery(store, artifacts, snapshot_interval_s=config.snapshot_interval_s)
    # One audit log for the accounts' events and the checkpoints': only one instance folds failed
    # authentications in memory, and the audit route reads through it.
    audit = AuditLog(store)
    runs = Runs(store, artifacts, audit=audit)
    runs.reserve = reserve
    control = Control(store, client, recovery, quotas=Quotas(store, config),
                      residency=Residency(store, recovery, config.session_expiry_s),
                      retention=FutureRetention(store, recovery, config.future_retrieved_grace_s,
                                                config.future_max_age_s, config.future_tombstone_s),
                      reserve=reserve, runs=runs, ephemeral_samplers_kept=config.ephemeral_samplers_kept,
                      worker_id=worker_id)
    if config.role != "all":
        replicas.use_database_notifier(control, store)
    control.budget = QueueBudget(config.max_queued_ops_per_model, config.max_queued_ops)
    control.scheduler.batch_tokens = config.train_batch_tokens
    if not config.metrics:
        control.metrics.disable()
    if config.otlp_endpoint:
        from tinkerd.control.tracing import OpTracer

        control.metrics.tracer = OpTracer.otlp(config.otlp_endpoint)
    # Crash debris of checkpoint saves, swept with the snapshots' at start and after engine restarts.
    recovery.sweeps.append(lambda: runs.sweep_stale_temp(older_than_s=0))
    served = {m.name: m for m in replicas.served_models(config.role, store, client, worker_id)}
    accounts = Accounts(store, audit)
    records = StabilityRecords(store, config.recorded_sequence_ttl_s)
    control.results.recorders.append(records.record)
    control.results.recorders.append(StepMetrics(store).record)  # the console's curves (control/stepmetrics.py)
    app_state = AppState(config=config, control=control, runs=runs, served=served, accounts=accounts, records=records,
                         tokenizers=Tokenizers(served), tokens=Tokens.in_dir(config.data_dir))
    legacy.convert(app_state)  # a data directory from before the op log: once, before control recovers
    return create_app(app_state), control


def build_engine_client(config: ServerConfig, wait: bool = True):
    """The EngineRouter over the engines serving config.base_models: one Ray actor each with
    --ray-address (engine/ray_engine.py), else the one embedded engine. wait=False (process engine
    only): return once the child is spawned; its first use waits."""
    from tinkerd.control.engines import EngineRouter

    if config.engine_ranks > 1 and (config.ray_address or config.engine != "process"):
        raise UserError("--engine-ranks above 1 needs the process engine (no --engine thread, no --ray-address)")
    if config.ray_address:
        from tinkerd.engine.ray_engine import ray_engines, shutdown

        return EngineRouter(ray_engines(config, logging.getLogger().getEffectiveLevel(), LOG_FORMAT), on_close=shutdown)
    return EngineRouter([_embedded_engine_client(config, wait)])


def _embedded_engine_client(config: ServerConfig, wait: bool):
    from tinkerd.artifacts import LocalArtifactStore

    if config.engine == "process":
        from tinkerd.engine.precision import Precision
        from tinkerd.engine.process import EngineSpec, ProcessEngineClient

        log.info("starting the engine process for %s", ", ".join(config.base_models))
        return ProcessEngineClient(EngineSpec(config.models_dir, tuple(config.base_models), config.max_lora_rank,
                                              config.torch_threads, config.sample_kv_cache_bytes,
                                              precision=Precision(config.device, config.dtype),
                                              log_level=logging.getLogger().getEffectiveLevel(), log_format=LOG_FORMAT,
                                              ranks=config.engine_ranks, artifacts=LocalArtifactStore(config.data_dir)),
                                   wait=wait)
    import torch

    from tinkerd.engine.client import InProcessEngineClient
    from tinkerd.engine.engine import Engine
    from tinkerd.engine.malloc import keep_freed_memory
    from tinkerd.engine.precision import Precision
    from tinkerd.engine.sampler.sample import SamplerConfig

    keep_freed_memory()  # as the engine process does (engine/malloc.py)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    engine = Engine(config.models_dir, config.max_lora_rank, SamplerConfig(kv_cache_bytes=config.sample_kv_cache_bytes),
                    Precision(config.device, config.dtype), LocalArtifactStore(config.data_dir))
    engine.load_base_models(config.base_models)
    return InProcessEngineClient(engine)


def local_key(config: ServerConfig, accounts) -> str | None:
    """The key to print in the ready line. No server starts open: on a first start with no keys,
    one is created for the local account and kept (mode 0600) in the data directory."""
    path = config.data_dir / "local_api_key"
    if config.api_key:
        if accounts.verify(config.api_key) is None:
            from tinkerd.errors import UserError

            try:
                accounts.create_key("serve --api-key", key=config.api_key)
            except UserError:  # replicas starting together on one database: another registered it
                if accounts.verify(config.api_key) is None:
                    raise
        return config.api_key
    if not accounts.has_keys():
        key = accounts.create_key("local").key
        path.write_text(key + "\n")
        path.chmod(0o600)
        return key
    return path.read_text().strip() if path.exists() else None


def hub_unreachable(timeout_s: float = 2.0) -> bool:
    """Whether this machine cannot reach the Hugging Face hub (or is told to stay off it).

    Then the ready line tells clients HF_HUB_OFFLINE=1: their `get_tokenizer()` resolves a hub name
    from the local cache at once (engine/model/hub_alias.py), where huggingface_hub would otherwise
    retry the unreachable hub for about two minutes and log a warning for every retry."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return False
    except OSError:  # no DNS, refused, or timed out
        return True


def uvicorn_config(app, config: ServerConfig) -> uvicorn.Config:
    """uvicorn with tinkerd's connection limits. The protocol is h11 with request deadlines
    (api/connection.py), not the faster httptools: uvicorn has no deadline for reading a request,
    and h11 takes a head size limit. Requests here are few and long (a step, a long-poll), so the
    parser's speed does not show."""
    from tinkerd.api.connection import TimedH11Protocol

    return uvicorn.Config(
        app, log_level="warning",
        http=TimedH11Protocol.with_timeouts(config.request_head_timeout_s, config.request_body_timeout_s),
        timeout_keep_alive=config.keep_alive_timeout_s, limit_concurrency=config.max_connections,
        backlog=config.listen_backlog, h11_max_incomplete_event_size=config.max_request_head_bytes)


def warn_if_few_file_descriptors(max_connections: int) -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    # ~100 descriptors go to the database, the engine pipe, model files and logs.
    if soft != resource.RLIM_INFINITY and soft < max_connections + 100:
        log.warning("the open-file limit (ulimit -n) is %d, below --max-connections %d plus ~100 the server "
                    "itself uses: past it accept() fails and new clients wait unanswered instead of getting a 503",
                    soft, max_connections)


def import_sdk_types_without_torch() -> None:
    """Import the SDK's types (which the API's wire schemas are) without torch: `tinker.types`
    imports torch only to accept torch tensors (`try: import torch`), which a server never receives
    (bodies are JSON and protobuf). Without it the server starts ~1.5 s sooner (2 shared cores,
    torch 2.x) and ~300 MB smaller, and the engine child, which needs torch, imports it meanwhile.
    Only for --engine process: --engine thread imports torch in this process anyway."""
    if "tinker" in sys.modules or "torch" in sys.modules:
        return  # too late, or torch is here anyway
    sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
    try:
        import tinker.types  # noqa: F401
    finally:
        del sys.modules["torch"]  # a later `import torch` (none in this process) works as usual


def run(args) -> int:
    """Listen at once, build the rest behind a StartupGate (api/gate.py), then print the ready line.

    Order, for a restart after a crash (tiny model, 2 shared cores, numbers from issue 16 part 5):
    the engine child is spawned first (its torch + transformers imports and model load take ~6 s);
    the port is bound and answers at once, holding requests, so SDK clients stop backing off; the
    API imports, store, key and hub check run meanwhile on a thread; then the engine's first use
    waits for its child, and recovery replays. Ready (the ready line) is when the app serves."""
    config = build_config(args)
    client = build_engine_client(config, wait=False) if config.role != "api" else None
    if config.engine == "process":
        import_sdk_types_without_torch()
    from tinkerd.api.gate import StartupGate

    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"
    gate = StartupGate()
    server = uvicorn.Server(uvicorn_config(gate, config))
    warn_if_few_file_descriptors(config.max_connections)
    state: dict = {}

    def start_control_plane() -> None:
        # Off the event loop: imports, SQLite, the engine's start and replay block for seconds.
        from tinkerd.control.runs import CheckpointSweeper

        app, control = build_app(config, client)
        state["control"] = control
        runs = app.state.tinkerd.runs
        if config.role != "api":  # one process deletes expired checkpoints' files: the driver
            state["sweeper"] = CheckpointSweeper(runs, args.checkpoint_sweep_interval_s)
        state["key"] = local_key(config, app.state.tinkerd.accounts)
        # A resolver can take seconds to fail: asked here, off the loop, while the engine starts.
        state["offline_env"] = " HF_HUB_OFFLINE=1" if hub_unreachable() else ""
        control.start()  # recovery: rebuilds adapters, queues pending ops again
        if "sweeper" in state:
            state["sweeper"].start()
        state["app"] = app

    async def main() -> None:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        starting = _in_thread(start_control_plane)
        try:
            await asyncio.wait({serving, starting}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():  # stopped (Ctrl-C, SIGTERM) while starting
                return
            starting.result()  # a start that failed raises here (EngineStartFailed: the engine's reason)
            await gate.open(state["app"])
            state["ready"] = True
            key = state["key"]
            models = state["app"].state.tinkerd.served.values()
            names = ", ".join(m.name for m in models if not m.unavailable)
            refused = [m.name for m in models if m.unavailable]  # each logged with its reason by the engine
            if refused:
                names += f" (not served: {', '.join(refused)})"
            print(
                f"tinkerd ready at {url} serving {names}\n"
                f"  export TINKER_BASE_URL={url} TINKER_API_KEY={key or '<a key from: tinkerd keys create --name NAME>'}"
                f"{state['offline_env']}",
                flush=True,
            )
            await serving
        finally:
            if not starting.done():  # the start thread waits on the engine child or replays on it: end that
                getattr(client, "kill", lambda: None)()
                await asyncio.wait({starting})
                starting.exception()  # its EngineCrashed is expected: retrieved, so asyncio logs nothing
            if not serving.done():
                server.should_exit = True
                await asyncio.wait({serving})
            await gate.close()
            if "sweeper" in state:
                state["sweeper"].stop()
            if "control" in state:
                state["control"].stop()
            elif client is not None:
                client.close()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        # uvicorn shuts down on Ctrl-C, then raises the signal again once it is done; by then main()'s
        # finally has stopped the control plane and the engine process: a clean stop, not an error.
        if not state.get("ready"):
            raise  # Ctrl-C before the server was ready: cli/main.py says "interrupted"
        print("tinkerd serve: stopped", file=sys.stderr, flush=True)
    return 0


def _in_thread(fn) -> asyncio.Future:
    """Run fn() on a daemon thread: unlike the loop's executor, one blocked on a dead start never
    holds the process at exit."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not done.done():
            done.set_result(None) if error is None else done.set_exception(error)

    def target() -> None:
        error = None
        try:
            fn()
        except BaseException as e:  # noqa: BLE001  handed to the loop, raised by whoever awaits
            error = e
        try:
            loop.call_soon_threadsafe(settle, error)
        except RuntimeError:  # the loop is gone: nobody waits any more
            pass

    threading.Thread(target=target, name="tinkerd-start", daemon=True).start()
    return done
